"""The gateway over real gRPC, with a scripted FakeRouter standing in for placement and workers.

These tests are about the gateway's wire logic only: status codes and messages, streaming,
usage and placement accounting, health, reflection, cancellation and the client helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import msgspec
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.models import prepare_model
from gateway import client
from gateway.inference import NOT_READY_MESSAGE, InferenceServicer, start_gateway
from gateway.router import Placed
from gateway.tokenization import PromptTokenizer
from protos.baton.v1 import inference_pb2 as pb
from protos.baton.v1 import inference_pb2_grpc as pb_grpc
from protos.errors import WorkerFailed
from protos.wire import (
    EngineRequest,
    Placement,
    PositionLogprobs,
    PrefillResult,
    TokenChunk,
    TokenLogprob,
)
from tests.tls import self_signed as _self_signed

SERVED = "tiny"
MAX_MODEL_LEN = 100
PLACEMENT = Placement(
    prefill_instance="prefill-0",
    decode_instance="decode-1",
    policy="kv-aware",
    reason="cost = 1.0 x 2 prefill blocks + 3 decode blocks = 5.0",
    transfer_ms=1.5,
    queue_ms=20.0,
    prefill_ms=12.25,
    expected_cached_blocks=1,
    pulled_from="prefill-1",
)
SCRIPTED_CHUNKS = (
    TokenChunk(token_ids=(5, 6), text="ab"),
    TokenChunk(token_ids=(), text=""),  # nothing new: no delta is sent
    TokenChunk(token_ids=(7,), text="c"),
    TokenChunk(token_ids=(8,), text="d", finish_reason="stop", num_loaded_tokens=12),
)
EXPECTED_DELTAS = [([5, 6], "ab"), ([7], "c"), ([8], "d")]


class FakeRouter:
    """A fake ``Router`` for gateway tests: one ``Placed``, then scripted chunks.

    After the script it raises ``error`` if given, or hangs if ``hang`` (to test cancellation).
    It records the requests it got and how many of its streams were closed.
    """

    def __init__(self, chunks=SCRIPTED_CHUNKS, ready=True, error=None, hang=False):
        self.chunks = chunks
        self.ready = ready
        self.error = error
        self.hang = hang
        self.requests: list[EngineRequest] = []
        self.num_closed_streams = 0

    def is_ready(self) -> bool:
        return self.ready

    async def stream(self, request: EngineRequest):
        self.requests.append(request)
        try:
            prefill = PrefillResult(
                request_id=request.request_id,
                instance_id=PLACEMENT.prefill_instance,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=16,
                num_stored_blocks=1,
                prefill_ms=3.0,
            )
            yield Placed(placement=PLACEMENT, prefill=prefill)
            for chunk in self.chunks:
                await asyncio.sleep(0.001)
                yield chunk
            if self.error is not None:
                raise self.error
            if self.hang:
                await asyncio.Event().wait()
        finally:
            self.num_closed_streams += 1


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest_asyncio.fixture
async def gateway(router, tokenizer):
    servicer = InferenceServicer(router, tokenizer, SERVED, MAX_MODEL_LEN)
    running = await start_gateway(servicer, "127.0.0.1", 0)
    yield running
    await running.stop(None)


@pytest_asyncio.fixture
async def channel(gateway):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield channel


async def collect(channel, request):
    """(deltas as (token_ids, text), final) of one Generate stream."""
    deltas, final = [], None
    async for response in pb_grpc.InferenceStub(channel).Generate(request, timeout=10):
        if response.HasField("final"):
            final = response.final
        else:
            deltas.append((list(response.delta.token_ids), response.delta.text))
    return deltas, final


async def expect_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def consume(call):
    return [response async for response in call]


@pytest.mark.asyncio
async def test_stream_has_deltas_then_final_with_usage_and_placement(
    channel, router, tokenizer
):
    request = pb.GenerateRequest(text="Hello world", request_id="req-7")
    request.sampling.max_tokens = 4

    deltas, final = await collect(channel, request)

    assert deltas == EXPECTED_DELTAS
    assert final.finish_reason == "stop"
    assert final.request_id == "req-7"
    assert (
        final.usage.prompt_tokens,
        final.usage.cached_tokens,
        final.usage.completion_tokens,
        final.usage.loaded_tokens,
    ) == (2, 16, 4, 12)
    assert 0 < final.usage.ttft_ms <= final.usage.e2e_ms
    assert final.placement == pb.PlacementInfo(
        prefill="prefill-0", decode="decode-1", policy="kv-aware", reason=PLACEMENT.reason,
        transfer_ms=1.5, queue_ms=20.0, prefill_ms=12.25, expected_cached_blocks=1,
        pulled_from="prefill-1",
    )
    [engine_request] = router.requests
    assert engine_request.prompt_token_ids == tuple(tokenizer.encode_text("Hello world"))
    assert engine_request.sampling.max_tokens == 4
    assert router.num_closed_streams == 1


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "logprobs", "json_schema", "json_object",
                   "n", "seed", "prompt_logprobs")


def _request(**fields) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text="Hello world")
    for name, value in fields.items():
        target = request.sampling if name in SAMPLING_FIELDS else request
        setattr(target, name, value)
    return request


BAD_REQUESTS = {
    "unknown model": (_request(model="gpt"), "model 'gpt' is not served here"),
    "no prompt": (pb.GenerateRequest(), "the request has no prompt"),
    "empty text": (_request(text=""), "prompt text is empty"),
    "bad token id": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])),
        "prompt token id 99999 at position 1 is outside the vocabulary [0, 49152)",
    ),
    "prompt too long": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100)),
        "prompt is 100 tokens but the context window (max_model_len) is 100 tokens",
    ),
    "max_tokens zero": (_request(max_tokens=0), "sampling.max_tokens must be positive, got 0"),
    "max_tokens too large": (
        _request(max_tokens=99),
        "at most 98 new tokens fit, so set max_tokens to 98 or less",
    ),
    "negative temperature": (_request(temperature=-1.0), "sampling.temperature must be"),
    "temperature above two": (_request(temperature=2.5), "must be at most 2"),
    # echoed in full, the status message would pass the client's 16 KiB header limit
    "huge unknown model": (_request(model="x" * 100_000), "characters cut)"),
    "huge emoji role": (  # percent-encoded: 12 bytes a character, past the 8 KiB soft limit
        pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="🙂" * 1_000)])),
        "characters cut)",
    ),
    "top_p zero": (_request(top_p=0.0), "sampling.top_p must be in (0, 1], got 0.0"),
    "logprobs 21": (_request(logprobs=21), "sampling.logprobs must be an integer from 0 to 20"),
    "both structured outputs": (
        _request(json_schema="{}", json_object=True),
        "sampling.json_schema and sampling.json_object are exclusive",
    ),
    "json_schema not JSON": (_request(json_schema="{"), "sampling.json_schema is not valid JSON"),
    "n 17": (_request(n=17), "sampling.n must be from 1 to 16"),
    "prompt_logprobs 21": (_request(prompt_logprobs=21),
                           "sampling.prompt_logprobs must be an integer from 0 to 20"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("request_, fragment", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
async def test_bad_request_is_invalid_argument_and_server_keeps_serving(
    channel, router, request_, fragment
):
    error = await expect_error(collect(channel, request_))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in error.details()
    assert router.requests == []
    deltas, final = await collect(channel, _request())
    assert deltas == EXPECTED_DELTAS and final.finish_reason == "stop"


@pytest.mark.asyncio
async def test_n_choices_stream_side_by_side_each_ending_with_its_own_final(channel, router):
    request = _request(n=3, seed=40, max_tokens=4, request_id="req-n")
    responses = await consume(pb_grpc.InferenceStub(channel).Generate(request, timeout=10))

    assert [r.request_id for r in router.requests] == ["req-n", "req-n-n1", "req-n-n2"]
    assert [r.sampling.seed for r in router.requests] == [40, 41, 42]  # vLLM's seed + index
    tagged = [(r.WhichOneof("kind"), getattr(r, r.WhichOneof("kind")).index) for r in responses]
    for index in range(3):
        mine = [r for r, (_, at) in zip(responses, tagged) if at == index]
        assert [(list(r.delta.token_ids), r.delta.text) for r in mine[:-1]] == EXPECTED_DELTAS
        final = mine[-1].final
        assert (final.finish_reason, final.request_id, final.usage.completion_tokens,
                final.usage.prompt_tokens) == ("stop", router.requests[index].request_id, 4, 2)
        assert 0 < final.usage.ttft_ms <= final.usage.e2e_ms
        # a choice's final comes right after its last delta, not after every choice ended
        at = tagged.index(("final", index))
        assert tagged[at - 1] == ("delta", index)
    assert sorted(kind for kind in tagged if kind[0] == "final") == [
        ("final", 0), ("final", 1), ("final", 2)]
    assert len(responses) == 3 * 4
    assert router.num_closed_streams == 3


@pytest.mark.asyncio
async def test_the_prompts_logprobs_come_with_the_first_delta(channel, router):
    position = PositionLogprobs(TokenLogprob(905, " world", -3.5, 2),
                                (TokenLogprob(11, ",", -0.5, 1), TokenLogprob(905, " world", -3.5, 2)))
    router.chunks = (msgspec.structs.replace(SCRIPTED_CHUNKS[0], prompt_logprobs=(position,)),
                     *SCRIPTED_CHUNKS[1:])
    responses = await consume(pb_grpc.InferenceStub(channel).Generate(
        _request(prompt_logprobs=1), timeout=10))

    [engine_request] = router.requests
    assert engine_request.sampling.num_prompt_logprobs == 1
    first = responses[0].delta
    assert [(p.chosen.token_id, p.chosen.token, p.chosen.logprob, p.chosen.rank)
            for p in first.prompt_logprobs] == [(905, " world", -3.5, 2)]
    assert [(t.token_id, t.logprob) for t in first.prompt_logprobs[0].top] == [
        (11, -0.5), (905, -3.5)]
    assert [len(r.delta.prompt_logprobs) for r in responses[1:-1]] == [0, 0]


@pytest.mark.asyncio
async def test_one_choice_is_the_stream_it_always_was(channel, router):
    for n in (0, 1):
        responses = await consume(pb_grpc.InferenceStub(channel).Generate(
            _request(n=n, request_id=f"one-{n}"), timeout=10))
        assert [r.WhichOneof("kind") for r in responses] == ["delta"] * 3 + ["final"]
        assert {getattr(r, r.WhichOneof("kind")).index for r in responses} == {0}
    assert [r.request_id for r in router.requests] == ["one-0", "one-1"]


@pytest.mark.asyncio
async def test_one_failing_choice_fails_the_request_and_closes_every_stream(channel, router):
    router.chunks = SCRIPTED_CHUNKS[:1]
    router.hang = True
    failing = router.stream

    async def stream(request):
        async with contextlib.aclosing(failing(request)) as events:
            async for event in events:
                yield event
                if request.request_id.endswith("-n1") and not isinstance(event, Placed):
                    raise WorkerFailed("decode-1 died; the request was not completed")

    router.stream = stream
    error = await expect_error(collect(channel, _request(n=2)))

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    for _ in range(100):
        if router.num_closed_streams == 2:
            break
        await asyncio.sleep(0.02)
    assert router.num_closed_streams == 2


@pytest.mark.asyncio
async def test_router_not_ready_is_unavailable_at_once(channel, router):
    router.ready = False
    started = time.perf_counter()

    error = await expect_error(collect(channel, _request()))

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == NOT_READY_MESSAGE
    assert time.perf_counter() - started < 1.0
    assert router.requests == []


def _generate_raw(channel):
    return channel.unary_stream("/baton.v1.Inference/Generate")  # bytes in, bytes out


@pytest.mark.asyncio
async def test_invalid_utf8_text_is_invalid_argument(channel):
    # Field 2 (text), wire type 2 (length-delimited), 2 bytes that are not UTF-8.
    payload = bytes([(2 << 3) | 2, 2, 0xFF, 0xFE])

    error = await expect_error(consume(_generate_raw(channel)(payload)))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid baton.v1.GenerateRequest" in error.details()
    assert "String field had bad UTF-8" in error.details()


@pytest.mark.asyncio
async def test_invalid_utf8_in_chat_content_and_tokenize_is_invalid_argument(channel):
    chat = pb.GenerateRequest()
    chat.chat.messages.add(role="user", content="@@")
    chat_payload = chat.SerializeToString().replace(b"@@", b"\xc3\x28")
    tokenize_payload = pb.TokenizeRequest(text="@@").SerializeToString().replace(b"@@", b"\xff")
    tokenize_payload = tokenize_payload.replace(b"\x12\x02", b"\x12\x01")

    chat_error = await expect_error(consume(_generate_raw(channel)(chat_payload)))
    tokenize_error = await expect_error(
        channel.unary_unary("/baton.v1.Inference/Tokenize")(tokenize_payload)
    )

    assert chat_error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert tokenize_error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid baton.v1.TokenizeRequest" in tokenize_error.details()


@pytest.mark.asyncio
async def test_worker_failure_mid_stream_keeps_its_status_and_message(channel, router):
    router.error = WorkerFailed("decode-1 died; the request was not completed")
    router.chunks = SCRIPTED_CHUNKS[:1]
    stream = pb_grpc.InferenceStub(channel).Generate(_request(), timeout=10)
    received = []

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in stream:
            received.append(list(response.delta.token_ids))

    assert received == [[5, 6]]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "decode-1 died; the request was not completed"
    assert dict(info.value.trailing_metadata())["retry-after-ms"] == "1000"  # the default hint


@pytest.mark.asyncio
async def test_the_client_reads_the_retry_hint_and_a_bad_request_has_none(gateway, router):
    from gateway import client

    router.error = WorkerFailed("prefill-0 died")
    router.chunks = ()
    target = f"127.0.0.1:{gateway.port}"
    with pytest.raises(client.GenerateFailed) as retryable:
        await client.generate(target, text="hi", max_tokens=2)
    with pytest.raises(client.GenerateFailed) as bad:
        await client.generate(target, text="hi", max_tokens=-1)

    assert (retryable.value.status, retryable.value.retry_after_ms) == ("UNAVAILABLE", 1000)
    assert (bad.value.status, bad.value.retry_after_ms) == ("INVALID_ARGUMENT", None)


@pytest.mark.asyncio
async def test_unexpected_router_error_is_internal(channel, router):
    router.error = KeyError("boom")
    router.chunks = ()

    error = await expect_error(collect(channel, _request(request_id="req-9")))

    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == (
        "internal error while serving request req-9; the gateway log has the details"
    )


@pytest.mark.asyncio
async def test_client_cancellation_closes_the_router_stream(channel, router):
    router.chunks = SCRIPTED_CHUNKS[:1]
    router.hang = True
    stream = pb_grpc.InferenceStub(channel).Generate(_request())

    first = await stream.read()
    stream.cancel()

    assert list(first.delta.token_ids) == [5, 6]
    for _ in range(100):
        if router.num_closed_streams:
            break
        await asyncio.sleep(0.02)
    assert router.num_closed_streams == 1


@pytest.mark.asyncio
async def test_a_chat_prefill_is_left_open_for_the_model(channel, tokenizer):
    stub = pb_grpc.InferenceStub(channel)
    request = pb.TokenizeRequest()
    request.chat.messages.add(role="user", content="hi")
    request.chat.messages.add(role="assistant", content="Hello, I")
    request.chat.continue_final_message = True
    not_the_assistant = pb.TokenizeRequest()
    not_the_assistant.chat.messages.add(role="user", content="hi")
    not_the_assistant.chat.continue_final_message = True

    response = await stub.Tokenize(request)
    error = await expect_error(stub.Tokenize(not_the_assistant))

    hf = tokenizer._tokenizer
    text = hf.apply_chat_template([{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "Hello, I"}],
                                  continue_final_message=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\nHello, I")
    assert list(response.token_ids) == hf.encode(text, add_special_tokens=False)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the assistant's answer so far" in error.details()


@pytest.mark.asyncio
async def test_tokenize_returns_the_ids_generate_uses(channel, tokenizer):
    stub = pb_grpc.InferenceStub(channel)
    chat = pb.TokenizeRequest()
    chat.chat.messages.add(role="user", content="hi")

    text_response = await stub.Tokenize(pb.TokenizeRequest(text="Hello world"))
    chat_response = await stub.Tokenize(chat)
    error = await expect_error(stub.Tokenize(pb.TokenizeRequest(model="gpt", text="x")))

    assert list(text_response.token_ids) == tokenizer.encode_text("Hello world")
    assert text_response.num_tokens == 2
    assert list(chat_response.token_ids) == tokenizer.encode_chat([("user", "hi")])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.asyncio
async def test_health_reports_serving_then_not_serving(channel, gateway):
    stub = health_pb2_grpc.HealthStub(channel)

    async def status(service):
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

    assert await status("") == health_pb2.HealthCheckResponse.SERVING
    assert await status("baton.v1.Inference") == health_pb2.HealthCheckResponse.SERVING
    await gateway.set_serving(False)
    assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await status("baton.v1.Inference") == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.asyncio
async def test_reflection_lists_the_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")

    [response] = [r async for r in stub.ServerReflectionInfo(iter([request]))]

    assert sorted(s.name for s in response.list_services_response.service) == [
        "baton.v1.Inference",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ]


@pytest.mark.asyncio
async def test_client_generate_returns_the_result_dict(gateway, router, tokenizer):
    seen = []

    result = await client.generate(
        f"127.0.0.1:{gateway.port}",
        text="hi",
        chat=True,
        max_tokens=4,
        request_id="req-3",
        on_delta=lambda text, token_ids: seen.append((token_ids, text)),
    )

    assert seen == EXPECTED_DELTAS
    usage = result.pop("usage")
    assert 0 < usage.pop("ttft_ms") <= usage.pop("e2e_ms")
    assert usage == {
        "prompt_tokens": len(tokenizer.encode_chat([("user", "hi")])),
        "cached_tokens": 16,
        "completion_tokens": 4,
        "loaded_tokens": 12,
        "cache_creation_input_tokens": 0,  # no session, no breakpoint: nothing leased
        "cache_read_input_tokens": 16,
    }
    assert result == {
        "text": "abcd",
        "token_ids": [5, 6, 7, 8],
        "finish_reason": "stop",
        "placement": {
            "prefill": "prefill-0",
            "decode": "decode-1",
            "policy": "kv-aware",
            "reason": PLACEMENT.reason,
            "transfer_ms": 1.5,
            "queue_ms": 20.0,
            "prefill_ms": 12.25,
            "expected_cached_blocks": 1,
            "pulled_from": "prefill-1",
        },
        "request_id": "req-3",
    }
    assert router.requests[0].prompt_token_ids == tuple(tokenizer.encode_chat([("user", "hi")]))


A, X = TokenLogprob(5, "a", -0.5, 1), TokenLogprob(9, "x", -1.5, 2)
B, C = TokenLogprob(6, "b", -2.25, 3), TokenLogprob(7, "c", float("-inf"), 4)
LOGPROB_CHUNKS = (
    TokenChunk((5, 6), "ab", logprobs=(PositionLogprobs(A, (A, X)), PositionLogprobs(B, (A, X)))),
    TokenChunk((7,), "", logprobs=(PositionLogprobs(C, (A, X)),)),  # its text is held back
    TokenChunk((), "c", finish_reason="stop"),
)


def _entry(entry: TokenLogprob) -> dict:
    return {"token_id": entry.token_id, "token": entry.token, "logprob": entry.logprob,
            "rank": entry.rank}


@pytest.mark.asyncio
async def test_logprobs_and_structured_outputs_reach_the_engine_and_logprobs_the_deltas(
    gateway, channel, router
):
    router.chunks = LOGPROB_CHUNKS
    request = _request(logprobs=2, json_schema='{"type": "object"}')
    deltas = [response.delta async for response in
              pb_grpc.InferenceStub(channel).Generate(request, timeout=10)
              if response.HasField("delta")]

    result = await client.generate(f"127.0.0.1:{gateway.port}", text="hi", logprobs=2,
                                   json_object=True)

    assert [(list(d.token_ids), d.text, len(d.logprobs)) for d in deltas] == [
        ([5, 6], "ab", 2), ([7], "", 1), ([], "c", 0)]
    assert deltas[0].logprobs[1] == pb.PositionLogprobs(
        chosen=pb.TokenLogprob(token_id=6, token="b", logprob=-2.25, rank=3),
        top=[pb.TokenLogprob(token_id=5, token="a", logprob=-0.5, rank=1),
             pb.TokenLogprob(token_id=9, token="x", logprob=-1.5, rank=2)])
    assert result["text"] == "abc" and result["token_ids"] == [5, 6, 7]
    assert result["logprobs"] == [
        {"chosen": _entry(chosen), "top": [_entry(A), _entry(X)]} for chosen in (A, B, C)]
    grpc_request, client_request = router.requests
    assert (grpc_request.sampling.num_logprobs, grpc_request.sampling.json_schema,
            grpc_request.sampling.json_object) == (2, '{"type":"object"}', False)
    assert (client_request.sampling.num_logprobs, client_request.sampling.json_schema,
            client_request.sampling.json_object) == (2, "", True)


@pytest.mark.asyncio
async def test_client_generate_raises_generate_failed(gateway):
    with pytest.raises(client.GenerateFailed) as info:
        await client.generate(f"127.0.0.1:{gateway.port}", token_ids=[1], max_tokens=0)

    assert info.value.status == "INVALID_ARGUMENT"
    assert "sampling.max_tokens must be positive, got 0" in info.value.details


@pytest.mark.asyncio
async def test_api_keys_are_required_when_configured(router, tokenizer):
    servicer = InferenceServicer(router, tokenizer, SERVED, MAX_MODEL_LEN, api_keys=frozenset({"k-1"}))
    running = await start_gateway(servicer, "127.0.0.1", 0)
    target = f"127.0.0.1:{running.port}"
    try:
        for key in ("", "wrong", "k-1x"):
            with pytest.raises(client.GenerateFailed) as info:
                await client.generate(target, text="hi", api_key=key)
            assert info.value.status == "UNAUTHENTICATED"
            assert "authorization: Bearer" in info.value.details
        assert router.requests == []  # nothing reached the router
        result = await client.generate(target, text="hi", api_key="k-1")
        assert result["text"] == "abcd"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            error = await expect_error(stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=5))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = await stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=5,
                                     metadata=(("authorization", "Bearer k-1"),))
            assert list(ok.token_ids) == tokenizer.encode_text("hi")
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # open without a key
    finally:
        await running.stop(None)


@pytest.mark.asyncio
async def test_an_early_rejection_is_resource_exhausted_with_a_retry_after_hint(channel, router):
    from conductor.policy import Overloaded

    router.error = Overloaded("predicted TTFT 900.0 ms exceeds ttft_slo_ms 500", retry_after_s=2.25)
    router.chunks = ()
    call = pb_grpc.InferenceStub(channel).Generate(_request(), timeout=10)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass

    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "predicted TTFT 900.0 ms exceeds ttft_slo_ms 500"
    assert dict(info.value.trailing_metadata())["retry-after-ms"] == "2250"


async def test_tls_is_one_switch_and_plaintext_or_untrusted_clients_are_refused(tokenizer, tmp_path):
    from gateway.config import GatewayConfig

    cert, key = _self_signed(tmp_path, "gateway")
    other_ca, _ = _self_signed(tmp_path, "impostor")
    config = GatewayConfig(port=0, tls_cert_file=str(cert), tls_key_file=str(key))
    servicer = InferenceServicer(FakeRouter(), tokenizer, SERVED, MAX_MODEL_LEN)
    running = await start_gateway(servicer, config.host, config.port, tls=config.tls_credentials())
    target = f"127.0.0.1:{running.port}"
    try:
        result = await client.generate(target, text="hi", tls_ca_file=str(cert), timeout_s=10)
        assert result["token_ids"] == [5, 6, 7, 8] and result["finish_reason"] == "stop"
        for ca in (None, str(other_ca)):  # plaintext, or a certificate it does not trust
            with pytest.raises(client.GenerateFailed) as caught:
                await client.generate(target, text="hi", tls_ca_file=ca, timeout_s=5)
            assert caught.value.status == "UNAVAILABLE"
    finally:
        await running.stop(None)


def test_tls_needs_both_files_and_readable_ones(tmp_path):
    from pydantic import ValidationError

    from gateway.config import GatewayConfig
    from protos.errors import ConfigError

    with pytest.raises(ValidationError, match="needs both tls_cert_file and tls_key_file"):
        GatewayConfig(tls_cert_file="cert.pem")
    missing = GatewayConfig(tls_cert_file=str(tmp_path / "c.pem"), tls_key_file=str(tmp_path / "k.pem"))
    with pytest.raises(ConfigError, match="gateway.tls_key_file: cannot read .*k.pem"):
        missing.tls_credentials()


@pytest.mark.asyncio
async def test_client_generate_names_a_session_and_reports_what_its_lease_wrote(
        gateway, router, tokenizer):
    from gateway.sessions import scoped_session_id

    result = await client.generate(f"127.0.0.1:{gateway.port}", text="hi", chat=True,
                                   max_tokens=4, session_id="agent-7")

    [request] = router.requests
    prompt = len(tokenizer.encode_chat([("user", "hi")]))
    assert request.session_id == scoped_session_id("", "", "agent-7")
    assert [(lease.lease_id, lease.num_tokens, lease.include_output)
            for lease in request.leases] == [(request.session_id, prompt, True)]
    usage = result["usage"]
    assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (
        16, prompt - 16)
