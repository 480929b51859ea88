"""The engine gRPC contract (``vllm.grpc.engine.VllmEngine``) over real gRPC, with a scripted
router and a fake conductor: the request mapping, the answers, Abort and client cancels, the
statuses errors map to, the API key, loads and KV events. The interop with the real SMG router is
``tests/integration/test_engine_grpc.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import msgspec
import pytest
import pytest_asyncio
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from conductor.kv_feed import KvEventFeed
from conductor.policy import Overloaded
from engine.models import prepare_model
from gateway import engine_replies as replies
from gateway.engine_contract import EngineContractServicer, ServedModel, start_engine_contract
from gateway.engine_requests import ModelLimits, engine_request
from gateway.router import Placed
from gateway.sessions import SessionsConfig, scoped_session_id
from gateway.tokenization import PromptTokenizer
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from protos.errors import InvalidRequest, NoWorkerReady
from protos.wire import (
    ClusterLoad,
    InstanceStats,
    KvFeedBatch,
    PositionLogprobs,
    TokenChunk,
    TokenLogprob,
)
from tests.unit.test_gateway_wire import PLACEMENT, FakeRouter

MAX_MODEL_LEN = 100
CHUNKS = (
    TokenChunk(token_ids=(5, 6), text="ab"),
    TokenChunk(token_ids=(), text=""),
    TokenChunk(token_ids=(7,), text="c"),
    TokenChunk(token_ids=(8,), text="d", finish_reason="stop", num_loaded_tokens=12,
               stop_sequence="d"),
)


@pytest.fixture(scope="module")
def model():
    return prepare_model("tiny")


@pytest.fixture(scope="module")
def tokenizer(model) -> PromptTokenizer:
    return PromptTokenizer(model.path)


@pytest.fixture(scope="module")
def limits(model, tokenizer) -> ModelLimits:
    return ModelLimits("tiny", MAX_MODEL_LEN, tokenizer.vocab_size,
                       replies.eos_token_ids(model.path))


def tokenized(ids=(1, 2, 3), **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id="r1", tokenized=vpb.TokenizedInput(input_ids=list(ids)),
                               sampling_params=vpb.SamplingParams(**sampling), stream=True)


# ---------------------------------------------------------------- request mapping


def test_a_tokenized_request_maps_onto_batons_sampling(tokenizer, limits):
    built = engine_request(tokenized(temperature=0.0, top_p=0.5, max_tokens=7, seed=3,
                                     stop=["\n"], logprobs=2, ignore_eos=True,
                                     skip_special_tokens=True, repetition_penalty=1.0),
                           tokenizer, limits)
    assert built.request_id == "r1"
    assert built.prompt_token_ids == (1, 2, 3)
    s = built.sampling
    assert (s.temperature, s.top_p, s.max_tokens, s.seed, s.stop, s.num_logprobs, s.ignore_eos) == (
        0.0, 0.5, 7, 3, ("\n",), 2, True)


def test_unset_fields_take_vllms_defaults(tokenizer, limits):
    s = engine_request(tokenized(), tokenizer, limits).sampling
    assert (s.temperature, s.top_p, s.seed, s.num_logprobs, s.ignore_eos) == (1.0, 1.0, None, None,
                                                                             False)
    assert s.max_tokens == 64  # Baton's default, as on its own fronts


def test_text_input_is_tokenized_like_batons_text_prompt(tokenizer, limits):
    request = vpb.GenerateRequest(text="hello there", sampling_params=vpb.SamplingParams())
    assert list(engine_request(request, tokenizer, limits).prompt_token_ids) == \
        tokenizer.encode_text("hello there")


def test_a_json_schema_is_enforced(tokenizer, limits):
    schema = '{"type":"object","properties":{"a":{"type":"integer"}}}'
    assert engine_request(tokenized(json_schema=schema), tokenizer, limits).sampling.json_schema \
        == schema


def test_the_sampling_knobs_reach_the_engine_request(tokenizer, limits):
    sampling = engine_request(tokenized(
        max_tokens=8, top_k=5, min_p=0.25, frequency_penalty=0.5, presence_penalty=-0.5,
        repetition_penalty=1.25, min_tokens=3, logit_bias={7: 2.5, 3: -100.0}),
        tokenizer, limits).sampling
    assert (sampling.top_k, sampling.min_p, sampling.frequency_penalty,
            sampling.presence_penalty, sampling.repetition_penalty, sampling.min_tokens,
            sampling.logit_bias) == (5, 0.25, 0.5, -0.5, 1.25, 3, ((3, -100.0), (7, 2.5)))


def test_regex_and_choice_constraints_are_enforced(tokenizer, limits):
    assert engine_request(tokenized(regex="[ab]+"), tokenizer, limits).sampling.regex == "[ab]+"
    choice = vpb.ChoiceConstraint(choices=["yes", "no"])
    assert engine_request(tokenized(choice=choice), tokenizer, limits).sampling.choice == (
        "yes", "no")


def test_the_contracts_unset_knobs_are_the_neutral_values(tokenizer, limits):
    sampling = engine_request(tokenized(max_tokens=8, repetition_penalty=0.0), tokenizer,
                              limits).sampling
    assert (sampling.top_k, sampling.min_p, sampling.frequency_penalty,
            sampling.presence_penalty, sampling.repetition_penalty, sampling.min_tokens,
            sampling.logit_bias) == (0, 0.0, 0.0, 0.0, 1.0, 0, ())


@pytest.mark.parametrize("sampling, field", [
    ({"n": 17}, "sampling_params.n must be from 1 to 16"), ({"min_p": 1.5}, "min_p"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
    ({"grammar": "root ::= \"a\""}, "grammar"), ({"regex": "(a"}, "regex"),
    ({"stop_token_ids": [77]}, r"stop_token_ids \[77\]"),
    ({"prompt_logprobs": -1}, "sampling_params.prompt_logprobs must be an integer from 0 to 20"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 500}, "context window"), ({"temperature": 3.0}, "temperature"),
])
def test_what_batons_engines_cannot_do_is_refused_by_name(tokenizer, limits, sampling, field):
    with pytest.raises(InvalidRequest, match=field):
        engine_request(tokenized(**sampling), tokenizer, limits)


def test_stop_token_ids_of_the_models_eos_are_accepted(tokenizer, limits):
    assert limits.eos_token_ids
    engine_request(tokenized(stop_token_ids=list(limits.eos_token_ids)), tokenizer, limits)


def test_token_ids_outside_the_vocabulary_are_refused(tokenizer, limits):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine_request(tokenized(ids=(1, limits.vocab_size)), tokenizer, limits)


@pytest.mark.parametrize("params, message", [
    ("{not json", "not valid JSON"), ("[1]", "must be a JSON object"),
    ('{"do_remote_prefill": true}', "do_remote_prefill"),
])
def test_kv_transfer_params_json_is_checked(tokenizer, limits, params, message):
    request = tokenized()
    request.kv_transfer_params_json = params
    with pytest.raises(InvalidRequest, match=message):
        engine_request(request, tokenizer, limits)


def test_other_kv_transfer_params_are_accepted(tokenizer, limits):
    request = tokenized()
    request.kv_transfer_params_json = '{"do_remote_prefill": false, "note": 1}'
    engine_request(request, tokenizer, limits)


# ---------------------------------------------------------------- load and KV events


def _stats(instance_id, role, running, waiting, kv, prompt=0, cached=0):
    return InstanceStats(instance_id, role, running, waiting, 0, True, kv,
                         num_prompt_tokens=prompt, num_cached_tokens=cached)


def test_loads_sum_the_engines_and_average_the_decode_kv():
    load = ClusterLoad([_stats("p0", "prefill", 1, 3, 0.9, 100, 40),
                        _stats("d0", "decode", 5, 1, 0.2, 50, 10),
                        _stats("d1", "decode", 2, 0, 0.4)], 4, 9)
    got = replies.scheduler_load(load)
    assert (got.num_running_reqs, got.num_waiting_reqs, got.num_total_reqs) == (8, 4, 12)
    assert got.token_usage == pytest.approx(0.3)
    assert got.cache_hit_rate == pytest.approx(50 / 150)
    assert replies.scheduler_load(ClusterLoad([], 0, 0)).token_usage == 0.0


def _payload(*events) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=12.5, events=list(events)))


def test_engine_kv_events_become_one_cluster_stream():
    stored = BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=b"h0",
                         token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4, lora_id=None,
                         medium="GPU", lora_name=None)
    batch = replies.kv_event_batch(KvFeedBatch(7, "d0", _payload(
        stored, BlockRemoved(block_hashes=[b"h2"], medium="GPU"), AllBlocksCleared())))
    assert (batch.sequence_number, batch.timestamp) == (7, 12.5)
    assert [e.WhichOneof("data") for e in batch.events] == ["stored", "removed"]
    blocks = batch.events[0].stored.blocks
    assert [list(b.token_ids) for b in blocks] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert batch.events[0].stored.parent_block_hash == replies.block_hash64("d0", b"h0")
    assert list(batch.events[1].removed.block_hashes) == [blocks[1].block_hash]
    # the same vLLM hash on another engine is another block; event ids rise within the stream
    assert replies.block_hash64("d1", b"h2") != blocks[1].block_hash
    assert batch.events[0].event_id < batch.events[1].event_id


def test_an_undecodable_batch_keeps_its_place_in_the_numbering():
    batch = replies.kv_event_batch(KvFeedBatch(3, "d0", b"\xff\x00"))
    assert (batch.sequence_number, len(batch.events)) == (3, 0)


async def test_the_feed_numbers_batches_and_keeps_the_latest():
    feed = KvEventFeed(capacity_batches=3)
    assert feed.record("before", b"p") is None  # nobody asked yet: nothing kept
    feed.arm()
    for i in range(5):
        feed.record(f"e{i}", b"p")
    assert feed.last_seq == 5
    assert [b.seq for b in feed.after(0, 10)] == [3, 4, 5]  # 1 and 2 fell out
    assert [b.seq for b in feed.after(3, 1)] == [4]
    assert await feed.wait_after(5, 0.01, 10) == []
    waiting = asyncio.ensure_future(feed.wait_after(5, 5.0, 10))
    await asyncio.sleep(0.01)
    feed.record("late", b"q")
    assert [(b.seq, b.instance_id) for b in await waiting] == [(6, "late")]


# ---------------------------------------------------------------- the service over gRPC


class FakeCluster:
    def __init__(self) -> None:
        self.feed = KvEventFeed()
        self.feed.arm()
        self.load = ClusterLoad([_stats("d0", "decode", 2, 1, 0.25)], 0, 3)

    async def cluster_load(self) -> ClusterLoad:
        return self.load

    async def kv_event_batches(self, after_seq: int, wait_s: float):
        return await self.feed.wait_after(after_seq, wait_s, 256)

    async def kv_last_seq(self) -> int:
        return self.feed.last_seq

    async def block_size_tokens(self) -> int:
        return 16


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter(chunks=CHUNKS)


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest_asyncio.fixture
async def contract(router, cluster, tokenizer, model):
    servicer = EngineContractServicer(router, cluster, tokenizer,
                                      ServedModel(model.path, "tiny", MAX_MODEL_LEN,
                                                  tokenizer.vocab_size, "float32", 64))
    running = await start_engine_contract(servicer, "127.0.0.1", 0)
    yield running
    await running.stop(None)


@pytest_asyncio.fixture
async def stub(contract):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{contract.port}") as channel:
        yield vpb_grpc.VllmEngineStub(channel)


async def test_generate_streams_chunks_then_completes(stub, router):
    responses = [r async for r in stub.Generate(tokenized(max_tokens=4))]
    assert [r.WhichOneof("response") for r in responses] == ["chunk"] * 3 + ["complete"]
    assert [list(r.chunk.token_ids) for r in responses[:3]] == [[5, 6], [7], [8]]
    assert {r.chunk.prompt_tokens for r in responses[:3]} == {3}
    done = responses[-1].complete
    assert (list(done.output_ids), done.finish_reason, done.prompt_tokens,
            done.completion_tokens, done.cached_tokens, done.matched_stop_str) == (
        [8], "stop", 3, 1, 16, "d")
    handoff = json.loads(done.kv_transfer_params_json)["baton"]
    assert (handoff["prefill_instance"], handoff["decode_instance"], handoff["loaded_tokens"]) == (
        PLACEMENT.prefill_instance, PLACEMENT.decode_instance, 12)
    assert router.requests[0].prompt_token_ids == (1, 2, 3)


async def test_generate_without_stream_answers_once_with_every_token(stub):
    request = tokenized(max_tokens=4)
    request.stream = False
    responses = [r async for r in stub.Generate(request)]
    assert len(responses) == 1
    assert (list(responses[0].complete.output_ids), responses[0].complete.completion_tokens) == (
        [5, 6, 7, 8], 4)


async def test_logprobs_travel_in_the_contracts_layout(stub, cluster, tokenizer, model):
    chosen = TokenLogprob(9, "x", -0.5, 1)
    other = TokenLogprob(4, "y", -1.5, 2)
    chunk = TokenChunk((9,), "x", finish_reason="length",
                       logprobs=(PositionLogprobs(chosen, (chosen, other)),))
    got = replies.output_logprobs(chunk)
    assert (list(got.token_ids), list(got.token_logprobs)) == ([9], [-0.5])
    assert (list(got.top_logprobs[0].token_ids), list(got.top_logprobs[0].values)) == (
        [9, 4], [-0.5, -1.5])


def test_prompt_logprobs_ask_the_engine_for_the_prompts(tokenizer, limits):
    assert engine_request(tokenized(prompt_logprobs=2), tokenizer, limits
                          ).sampling.num_prompt_logprobs == 2
    assert engine_request(tokenized(), tokenizer, limits).sampling.num_prompt_logprobs is None


PROMPT_POSITIONS = (  # prompt (1, 2, 3): the second and third tokens', as an engine gives them
    PositionLogprobs(TokenLogprob(2, "b", -1.5, 2), (TokenLogprob(9, "z", -0.5, 1),
                                                     TokenLogprob(2, "b", -1.5, 2))),
    PositionLogprobs(TokenLogprob(3, "c", -0.25, 1), (TokenLogprob(3, "c", -0.25, 1),
                                                      TokenLogprob(4, "d", -2.0, 2))),
)


def _expected_input_logprobs() -> vpb.InputLogProbs:
    return vpb.InputLogProbs(
        token_logprobs=[vpb.InputTokenLogProb(), vpb.InputTokenLogProb(value=-1.5),
                        vpb.InputTokenLogProb(value=-0.25)],
        token_ids=[1, 2, 3],
        top_logprobs=[vpb.TopLogProbs(), vpb.TopLogProbs(values=[-0.5, -1.5], token_ids=[9, 2]),
                      vpb.TopLogProbs(values=[-0.25, -2.0], token_ids=[3, 4])])


async def test_prompt_logprobs_come_in_the_first_chunk_or_the_complete(stub, contract):
    first = msgspec.structs.replace(CHUNKS[0], prompt_logprobs=PROMPT_POSITIONS)
    contract.servicer._router = FakeRouter(chunks=(first, *CHUNKS[1:]))
    streamed = [r async for r in stub.Generate(tokenized(max_tokens=4, prompt_logprobs=2))]
    request = tokenized(max_tokens=4, prompt_logprobs=2)
    request.stream = False
    [whole] = [r async for r in stub.Generate(request)]

    assert streamed[0].chunk.input_logprobs == _expected_input_logprobs()
    assert [r.chunk.HasField("input_logprobs") for r in streamed[1:3]] == [False, False]
    assert not streamed[-1].complete.HasField("input_logprobs")  # sent once, as vLLM's
    assert whole.complete.input_logprobs == _expected_input_logprobs()
    assert contract.servicer._router.requests[0].sampling.num_prompt_logprobs == 2


async def test_abort_cancels_a_running_generate_like_a_grpc_cancel(stub, contract):
    router = FakeRouter(chunks=CHUNKS[:1], hang=True)
    contract.servicer._router = router
    call = stub.Generate(tokenized(max_tokens=50))
    first = await call.read()
    assert list(first.chunk.token_ids) == [5, 6]
    await stub.Abort(vpb.AbortRequest(request_ids=["r1", "unknown"]))
    last = await call.read()
    assert (last.complete.finish_reason, last.complete.completion_tokens) == ("abort", 2)
    assert await call.code() == grpc.StatusCode.OK
    assert router.num_closed_streams == 1  # the router's stream closed: workers abort
    assert contract.servicer.counters.aborted_by_rpc == 1


async def test_a_client_cancel_closes_the_routers_stream(stub, contract):
    router = FakeRouter(chunks=CHUNKS[:1], hang=True)
    contract.servicer._router = router
    call = stub.Generate(tokenized(max_tokens=50))
    await call.read()
    call.cancel()
    for _ in range(100):
        if router.num_closed_streams:
            break
        await asyncio.sleep(0.01)
    assert router.num_closed_streams == 1
    assert contract.servicer.counters.cancelled_by_client == 1


async def test_n_choices_stream_interleaved_each_with_its_index_and_its_own_complete(stub,
                                                                                     router):
    responses = [r async for r in stub.Generate(tokenized(max_tokens=4, n=3, seed=11))]
    kinds = [(r.WhichOneof("response"), getattr(r, r.WhichOneof("response")).index)
             for r in responses]
    assert [r.request_id for r in router.requests] == ["r1", "r1-n1", "r1-n2"]
    assert [r.sampling.seed for r in router.requests] == [11, 12, 13]  # vLLM's seed + index
    assert {r.prompt_token_ids for r in router.requests} == {(1, 2, 3)}
    for index in range(3):
        mine = [r for r in responses
                if getattr(r, r.WhichOneof("response")).index == index]
        assert [r.WhichOneof("response") for r in mine] == ["chunk"] * 3 + ["complete"]
        assert [list(r.chunk.token_ids) for r in mine[:3]] == [[5, 6], [7], [8]]
        done = mine[-1].complete
        assert (list(done.output_ids), done.finish_reason, done.completion_tokens) == (
            [8], "stop", 1)
    # each choice completes right after its own last chunk
    for index in range(3):
        at = kinds.index(("complete", index))
        assert kinds[at - 1] == ("chunk", index)
        assert list(responses[at - 1].chunk.token_ids) == [8]


async def test_n_choices_without_stream_complete_once_each_in_index_order(stub, router):
    request = tokenized(max_tokens=4, n=2)
    request.stream = False
    responses = [r async for r in stub.Generate(request)]
    assert [(r.WhichOneof("response"), r.complete.index) for r in responses] == [
        ("complete", 0), ("complete", 1)]
    for r in responses:
        assert (list(r.complete.output_ids), r.complete.completion_tokens) == ([5, 6, 7, 8], 4)
    assert [r.sampling.seed for r in router.requests] == [None, None]


async def test_abort_ends_every_choice_of_an_n_choice_request(stub, contract):
    router = FakeRouter(chunks=CHUNKS[:1], hang=True)
    contract.servicer._router = router
    call = stub.Generate(tokenized(max_tokens=50, n=2))
    first = [await call.read(), await call.read()]
    assert sorted(r.chunk.index for r in first) == [0, 1]
    await stub.Abort(vpb.AbortRequest(request_ids=["r1"]))
    last = [await call.read(), await call.read()]
    assert sorted((r.complete.index, r.complete.finish_reason, r.complete.completion_tokens)
                  for r in last) == [(0, "abort", 2), (1, "abort", 2)]
    assert await call.code() == grpc.StatusCode.OK
    assert router.num_closed_streams == 2  # both choices' streams closed: workers abort


async def test_one_failing_choice_fails_the_request_and_closes_the_others(stub, contract):
    class OneFails(FakeRouter):
        """The second choice's stream fails after its first chunk; the first one hangs."""

        async def stream(self, request):
            async with contextlib.aclosing(super().stream(request)) as events:
                async for event in events:
                    yield event
                    if request.request_id.endswith("-n1") and not isinstance(event, Placed):
                        raise NoWorkerReady("no decode instance is ready")

    router = OneFails(chunks=CHUNKS[:1], hang=True)
    contract.servicer._router = router
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(tokenized(max_tokens=50, n=2)):
            pass
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    for _ in range(100):
        if router.num_closed_streams == 2:
            break
        await asyncio.sleep(0.01)
    assert router.num_closed_streams == 2


@pytest.mark.parametrize("error, code", [
    (Overloaded("predicted TTFT 900 ms over the 500 ms SLO", retry_after_s=0.25),
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkerReady("no decode instance is ready"), grpc.StatusCode.UNAVAILABLE),
])
async def test_router_errors_answer_with_the_fronts_statuses(stub, contract, error, code):
    contract.servicer._router = FakeRouter(chunks=(), error=error)
    call = stub.Generate(tokenized(max_tokens=4))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() == code
    assert str(error) in raised.value.details()


async def test_bad_input_is_invalid_argument_before_the_router(stub, router):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(tokenized(min_p=3.0)):
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "min_p" in raised.value.details()
    assert router.requests == []


async def test_a_session_named_in_metadata_makes_a_scoped_leased_session_step(stub, router):
    metadata = (("x-session-id", "agent-7"), ("x-session-ttl-s", "120"),
                ("x-expected-next-step-s", "4.5"))
    [_ async for _ in stub.Generate(tokenized(max_tokens=4), metadata=metadata)]
    [_ async for _ in stub.Generate(tokenized(max_tokens=4))]
    step, plain = router.requests
    assert step.session_id == scoped_session_id("", "", "agent-7")
    assert step.expected_next_step_s == 4.5
    assert [(lease.lease_id, lease.ttl_s, lease.num_tokens) for lease in step.leases] == [
        (step.session_id, 120.0, 3)]
    assert (plain.session_id, plain.expected_next_step_s, plain.leases) == ("", 0.0, ())


@pytest.mark.parametrize("metadata, key", [
    ((("x-session-id", "a"), ("x-session-ttl-s", "soon")), "x-session-ttl-s"),
    ((("x-session-id", "a"), ("x-session-ttl-s", "999999")), "x-session-ttl-s"),
    ((("x-expected-next-step-s", "3"),), "x-expected-next-step-s"),
    ((("x-session-id", "a"), ("x-session-id", "b")), "x-session-id"),
])
async def test_bad_session_metadata_is_invalid_argument_naming_the_key(stub, router, metadata, key):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(tokenized(max_tokens=4), metadata=metadata):
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert key in raised.value.details()
    assert router.requests == []


async def test_sessions_off_serves_a_named_session_as_a_plain_request(router, cluster, tokenizer,
                                                                     model):
    servicer = EngineContractServicer(router, cluster, tokenizer,
                                      ServedModel(model.path, "tiny", MAX_MODEL_LEN,
                                                  tokenizer.vocab_size, "float32", 64),
                                      sessions=SessionsConfig(enabled=False))
    running = await start_engine_contract(servicer, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            call = vpb_grpc.VllmEngineStub(channel).Generate(
                tokenized(max_tokens=4), metadata=(("x-session-id", "agent-7"),))
            [_ async for _ in call]
    finally:
        await running.stop(None)
    assert (router.requests[0].session_id, router.requests[0].leases) == ("", ())


async def test_not_ready_is_unavailable_and_unhealthy(stub, contract):
    contract.servicer._router = FakeRouter(ready=False)
    assert not (await stub.HealthCheck(vpb.HealthCheckRequest())).healthy
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(tokenized()):
            pass
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_model_server_info_and_loads(stub, tokenizer, model):
    info = await stub.GetModelInfo(vpb.GetModelInfoRequest())
    assert (info.served_model_name, info.max_context_length, info.vocab_size, info.is_generation,
            info.model_path) == ("tiny", MAX_MODEL_LEN, tokenizer.vocab_size, True, str(model.path))
    assert list(info.architectures) == ["LlamaForCausalLM"]
    server = await stub.GetServerInfo(vpb.GetServerInfoRequest())
    assert (server.server_type, server.block_size, server.max_num_seqs, server.kv_role) == (
        "baton", 16, 64, "")
    loads = await stub.GetLoads(vpb.GetLoadsRequest())
    assert loads.dp_rank_count == 1
    assert (loads.loads[0].num_running_reqs, loads.loads[0].num_waiting_reqs,
            loads.loads[0].token_usage) == (2, 1, 0.25)


async def test_get_tokenizer_streams_the_model_folders_tokenizer(stub, model):
    import hashlib
    import io
    import zipfile

    chunks = [c async for c in stub.GetTokenizer(cpb.GetTokenizerRequest())]
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names


async def test_subscribe_streams_batches_from_now_or_from_a_sequence(stub, cluster):
    stored = BlockStored(block_hashes=[b"h1"], parent_block_hash=None, token_ids=[1, 2],
                         block_size=2, lora_id=None, medium=None, lora_name=None)
    cluster.feed.record("d0", _payload(stored))
    live = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
    await live.initial_metadata()
    await asyncio.sleep(0.05)
    cluster.feed.record("d1", _payload(stored))
    batch = await live.read()
    assert batch.sequence_number == 2  # from now on: the batch kept before is not replayed
    live.cancel()
    replay = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=1))
    assert [(await replay.read()).sequence_number for _ in range(2)] == [1, 2]
    replay.cancel()


async def test_with_api_keys_every_call_needs_one(router, cluster, tokenizer, model):
    servicer = EngineContractServicer(router, cluster, tokenizer,
                                      ServedModel(model.path, "tiny", MAX_MODEL_LEN,
                                                  tokenizer.vocab_size), api_keys=frozenset({"k1"}))
    running = await start_engine_contract(servicer, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = vpb_grpc.VllmEngineStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.GetModelInfo(vpb.GetModelInfoRequest())
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = await stub.GetModelInfo(vpb.GetModelInfoRequest(),
                                           metadata=(("authorization", "Bearer k1"),))
            assert info.served_model_name == "tiny"
    finally:
        await running.stop(None)


async def test_with_the_gateways_tls_it_serves_tls_only(router, cluster, tokenizer, model,
                                                        tmp_path):
    from tests.tls import self_signed

    cert, key = self_signed(tmp_path, "contract")
    servicer = EngineContractServicer(router, cluster, tokenizer,
                                      ServedModel(model.path, "tiny", MAX_MODEL_LEN,
                                                  tokenizer.vocab_size))
    running = await start_engine_contract(servicer, "127.0.0.1", 0,
                                          tls=(key.read_bytes(), cert.read_bytes()))
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{running.port}", credentials) as channel:
            info = await vpb_grpc.VllmEngineStub(channel).GetModelInfo(vpb.GetModelInfoRequest())
            assert info.served_model_name == "tiny"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await vpb_grpc.VllmEngineStub(channel).GetModelInfo(vpb.GetModelInfoRequest(),
                                                                    timeout=5)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(None)
