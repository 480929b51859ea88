"""The disaggregated request path, end to end on real parts: gRPC over loopback → gateway →
conductor (Ray actor) → prefill actor (vLLM producer) → host-tier KV store → decode actor (vLLM
consumer) → stream back. Tiny random model; outputs compared by token id with a plain engine."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio
import ray

from cluster.serve import BatonServer
from engine.config import CPU_KV_BLOCK_TOKENS
from gateway import client
from protos.wire import ConnectorCounters
from tests.integration.engines import plain_generate, plain_runner, random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

BLOCK = CPU_KV_BLOCK_TOKENS  # the CPU engines' KV block as shipped (EngineConfig.kv_block_tokens)
MAX_TOKENS = 24


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({"engine.model": "tiny", "kvstore.host_capacity_bytes": 256 << 20,
                               "conductor.tuning.short_prefill_tokens": 0}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model):
    runner = plain_runner(tiny_model)
    yield runner
    runner.shutdown()


def decode_counters(srv: BatonServer) -> ConnectorCounters:
    return ray.get(srv.cluster.actor(srv.cluster.decode_ids[0]).connector_counters.remote())


def expected_loaded_tokens(num_prompt_tokens: int) -> int:
    """Every prompt block (full ones and the partial tail) comes from the store; vLLM always
    computes the last prompt token itself."""
    return num_prompt_tokens - 1


@pytest.mark.parametrize(
    "num_tokens,seed",
    [(BLOCK - 7, 1), (BLOCK, 2), (5 * BLOCK + 17, 3), (8 * BLOCK, 4)],
    ids=["shorter-than-a-block", "exactly-one-block", "many-blocks", "many-full-blocks"],
)
async def test_greedy_output_matches_plain_engine_and_decode_loads_kv(server, reference, num_tokens, seed):
    prompt = random_prompt(num_tokens, seed)
    expected = await plain_generate(reference, prompt, MAX_TOKENS, f"ref-{seed}")
    before = decode_counters(server)

    result = await client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS)

    assert result["token_ids"] == expected
    assert result["finish_reason"] == "length"
    usage = result["usage"]
    assert usage["prompt_tokens"] == num_tokens
    assert usage["completion_tokens"] == MAX_TOKENS
    # The decode engine computed only what it did not load: all of the prompt but its last token.
    loaded = expected_loaded_tokens(num_tokens)
    assert usage["loaded_tokens"] == loaded
    after = decode_counters(server)
    assert after.loaded_blocks - before.loaded_blocks == -(-loaded // BLOCK)
    assert result["placement"]["prefill"] == server.cluster.prefill_ids[0]
    assert result["placement"]["decode"] == server.cluster.decode_ids[0]


async def test_shared_prefix_reports_cached_tokens_of_the_shared_full_blocks(server):
    first = random_prompt(3 * BLOCK + 20, seed=11)
    second = first[: 3 * BLOCK] + random_prompt(64, seed=12)

    cold = await client.generate(server.target, token_ids=first, max_tokens=4)
    warm = await client.generate(server.target, token_ids=second, max_tokens=4)

    assert cold["usage"]["cached_tokens"] == 0
    assert warm["usage"]["cached_tokens"] == 3 * BLOCK


async def test_text_prompt_and_chat_prompt_are_served(server):
    text = await client.generate(server.target, text="Why is the sky blue?", max_tokens=5)
    chat = await client.generate(server.target, text="Why is the sky blue?", chat=True, max_tokens=5)
    assert text["usage"]["completion_tokens"] == 5
    assert chat["usage"]["completion_tokens"] == 5
    # The chat template wraps the question in role markers: more prompt tokens than the text.
    assert chat["usage"]["prompt_tokens"] > text["usage"]["prompt_tokens"]


BAD_INPUTS = [
    (dict(text=""), "prompt"),
    (dict(token_ids=[1] * 9000), "context"),
    (dict(text="hi", max_tokens=0), "max_tokens"),
    (dict(text="hi", max_tokens=-5), "max_tokens"),
    (dict(text="hi", max_tokens=9000), "max_tokens"),
    (dict(text="hi", temperature=-0.5), "temperature"),
    (dict(text="hi", top_p=0.0), "top_p"),
    (dict(text="hi", top_p=1.5), "top_p"),
    (dict(text="hi", model="gpt-17"), "gpt-17"),
    (dict(token_ids=[5, 10**7]), "10000000"),
    (dict(token_ids=[5, -3]), "-3"),
]


@pytest.mark.parametrize("kwargs,fragment", BAD_INPUTS, ids=[f[1] + str(i) for i, f in enumerate(BAD_INPUTS)])
async def test_bad_input_is_invalid_argument_and_server_keeps_serving(server, kwargs, fragment):
    with pytest.raises(client.GenerateFailed) as info:
        await client.generate(server.target, **kwargs)
    assert info.value.status == "INVALID_ARGUMENT"
    assert fragment in info.value.details
    ok = await client.generate(server.target, text="still here?", max_tokens=2)
    assert ok["usage"]["completion_tokens"] == 2


async def test_invalid_utf8_is_invalid_argument(server):
    # field 3 (text) of GenerateRequest, length-delimited, with a lone continuation byte.
    raw = b"\x1a\x03a\x80b"
    async with grpc.aio.insecure_channel(server.target) as channel:
        call = channel.unary_stream("/baton.v1.Inference/Generate",
                                    request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call(raw):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in info.value.details()


async def test_sixteen_concurrent_streams_complete_with_correct_outputs(server, reference):
    prompts = [random_prompt(40 + 97 * i, seed=100 + i) for i in range(16)]
    expected = [await plain_generate(reference, p, 16, f"conc-ref-{i}") for i, p in enumerate(prompts)]

    results = await asyncio.gather(*(
        client.generate(server.target, token_ids=p, max_tokens=16) for p in prompts
    ))

    assert [r["token_ids"] for r in results] == expected
    assert all(r["finish_reason"] == "length" for r in results)


async def test_request_while_no_worker_is_ready_is_unavailable(server):
    """A gateway whose conductor has no ready worker answers UNAVAILABLE at once (real Ray
    conductor actor, real gateway, real gRPC)."""
    from conductor.conductor import Conductor
    from conductor.config import ConductorConfig
    from conductor.policy import PolicyConfig
    from gateway.inference import InferenceServicer, start_gateway
    from gateway.live_router import LiveRouter
    from gateway.tokenization import PromptTokenizer
    from protos.wire import Registration

    empty = ray.remote(Conductor).options(num_cpus=0).remote(
        ConductorConfig(), server.cluster.namespace, PolicyConfig())
    await empty.register.remote(
        Registration("not-started-prefill", "prefill", "node0", "m", "float32:128"))
    router = LiveRouter(empty, server.cluster.namespace, readiness_interval_s=0.05)
    router.start()
    model = server.cluster.model
    gateway = await start_gateway(
        InferenceServicer(router, PromptTokenizer(model.path), model.name, 2048), "127.0.0.1", 0)
    try:
        await asyncio.sleep(0.3)
        with pytest.raises(client.GenerateFailed) as info:
            await asyncio.wait_for(
                client.generate(f"127.0.0.1:{gateway.port}", text="hello", max_tokens=2), timeout=5)
        assert info.value.status == "UNAVAILABLE"
    finally:
        router.stop()
        await gateway.stop(0)
        ray.kill(empty)


async def test_store_records_each_stored_block_in_redis(server):
    import redis

    from kvstore.connector import kv_layout_tag
    from kvstore.keys import KeyExtras, block_keys, key_hex
    from kvstore.metadata import BLOCK_PREFIX as REDIS_BLOCK_PREFIX
    from kvstore.metadata import NODES_KEY as REDIS_NODES_KEY

    prompt = random_prompt(4 * BLOCK + 5, seed=21)
    result = await client.generate(server.target, token_ids=prompt, max_tokens=2)
    assert result["usage"]["loaded_tokens"] == 4 * BLOCK + 4

    keys = block_keys(prompt, BLOCK, KeyExtras(model_id="tiny", kv_layout=kv_layout_tag("torch.float32", BLOCK)))
    assert len(keys) == 4
    r = redis.Redis.from_url(server.cluster.redis_url)
    assert [r.hget(REDIS_BLOCK_PREFIX + key_hex(k), "node0") for k in keys] == [b"host"] * 4
    assert r.hexists(REDIS_NODES_KEY, "node0")


async def test_cache_salt_isolates_tenants(server):
    prompt = random_prompt(3 * BLOCK + 10, seed=31)
    first_a = await client.generate(server.target, token_ids=prompt, max_tokens=2, cache_salt="tenant-a")
    again_a = await client.generate(server.target, token_ids=prompt, max_tokens=2, cache_salt="tenant-a")
    as_b = await client.generate(server.target, token_ids=prompt, max_tokens=2, cache_salt="tenant-b")

    assert first_a["usage"]["cached_tokens"] == 0
    # every prompt token but the last (which vLLM always computes) comes from A's KV
    assert again_a["usage"]["cached_tokens"] == 3 * BLOCK + 9
    assert as_b["usage"]["cached_tokens"] == 0
    # tenant B's decode still loads B's own freshly stored blocks, never A's
    assert as_b["usage"]["loaded_tokens"] == 3 * BLOCK + 9
    assert as_b["token_ids"] == first_a["token_ids"]


async def test_a_request_id_already_in_flight_is_rejected_and_the_first_is_unharmed(reference):
    from engine.runner import EngineRejected
    from protos.wire import EngineRequest, SamplingOptions

    prompt = tuple(random_prompt(64, seed=41))
    request = EngineRequest("same-id", prompt, SamplingOptions(max_tokens=8, temperature=0.0))
    first = reference.generate(request)
    first_output = await first.__anext__()  # in flight now
    with pytest.raises(EngineRejected, match="already in flight"):
        await reference.generate(request).__anext__()
    tokens = list(first_output.outputs[0].token_ids)
    async for output in first:
        tokens.extend(output.outputs[0].token_ids)
    assert len(tokens) == 8
    # and once it is done, the id is free again
    again = [t async for o in reference.generate(request) for t in o.outputs[0].token_ids]
    assert again == tokens


# --------------------------------------------------------------- the OpenAI-compatible HTTP front


def _openai(server):
    import openai

    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused",
                              max_retries=0, timeout=60)


async def test_http_greedy_output_equals_grpc_output(server):
    prompt = random_prompt(2 * BLOCK + 30, seed=51)
    via_grpc = await client.generate(server.target, token_ids=prompt, max_tokens=12)
    oai = _openai(server)

    completion = await oai.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    streamed = await oai.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True)
    streamed_text = "".join([chunk.choices[0].text async for chunk in streamed if chunk.choices])

    assert completion.choices[0].text == via_grpc["text"]
    assert streamed_text == via_grpc["text"]
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == len(prompt)


async def test_http_reports_cached_tokens_on_a_repeated_prefix(server):
    base = random_prompt(3 * BLOCK + 7, seed=52)
    oai = _openai(server)
    await oai.completions.create(model="tiny", prompt=base, max_tokens=2, temperature=0)
    again = await oai.completions.create(model="tiny", prompt=base[: 3 * BLOCK] + [7, 8, 9],
                                         max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK


async def test_http_chat_with_openai_client_and_bad_input_exceptions(server):
    import openai

    oai = _openai(server)
    chat = await oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Why is the sky blue?"}],
        max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError):
        await oai.completions.create(model="tiny", prompt="hi", max_tokens=5, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="gpt-17", prompt="hi", max_tokens=5)


async def test_http_32_concurrent_streams_complete(server):
    oai = _openai(server)

    async def one(i: int) -> int:
        stream = await oai.completions.create(model="tiny", prompt=random_prompt(60 + i, seed=600 + i),
                                              max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
        return usage.completion_tokens

    assert await asyncio.gather(*(one(i) for i in range(32))) == [8] * 32


async def test_http_disconnect_mid_stream_frees_the_request(server):
    import httpx

    decode = server.cluster.actor(server.cluster.decode_ids[0])
    finished_before = (await decode.stats.remote()).num_finished_reqs
    body = {"model": "tiny", "prompt": random_prompt(100, seed=61), "max_tokens": 3000,
            "temperature": 0, "stream": True}
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", f"http://127.0.0.1:{server.http_port}/v1/completions",
                               json=body) as response:
            assert response.status_code == 200
            lines = 0
            async for line in response.aiter_lines():
                lines += line.startswith("data: ")
                if lines >= 3:
                    break  # leave mid-stream
            assert (await decode.stats.remote()).num_running_reqs == 1
    for _ in range(100):
        if (await decode.stats.remote()).num_running_reqs == 0:
            break
        await asyncio.sleep(0.05)
    assert (await decode.stats.remote()).num_running_reqs == 0
    # aborted, not run to its 3,000 tokens
    assert (await decode.stats.remote()).num_finished_reqs == finished_before


async def test_a_grpc_cancel_mid_stream_releases_everything_the_request_held(server):
    """A client that cancels a gRPC stream: within 5 s the decode engine has dropped the
    sequence (aborted, not finished), the conductor's books are closed, and the store holds no
    pin for it."""
    from gateway.client import open_channel
    from protos.baton.v1 import inference_pb2 as pb
    from protos.baton.v1 import inference_pb2_grpc as pb_grpc

    decode = server.cluster.actor(server.cluster.decode_ids[0])
    finished_before = (await decode.stats.remote()).num_finished_reqs
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=random_prompt(3 * BLOCK + 9, seed=62)),
                                 sampling=pb.SamplingParams(max_tokens=3000, temperature=0.0))
    async with open_channel(server.target) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(request)
        deltas = 0
        async for response in call:
            deltas += response.HasField("delta")
            if deltas >= 3:
                break
        assert (await decode.stats.remote()).num_running_reqs == 1
        call.cancel()
        cancelled = time.monotonic()

        async def held() -> tuple:
            books = await server.cluster.conductor.status.remote()
            store = ray.get_actor(server.cluster.store_actor_name, namespace=server.cluster.namespace)
            return ((await decode.stats.remote()).num_running_reqs, books.num_in_flight_prefills,
                    books.num_in_flight_decodes, (await store.stats.remote()).pinned_blocks)

        while await held() != (0, 0, 0, 0) and time.monotonic() - cancelled < 5:
            await asyncio.sleep(0.05)
        assert await held() == (0, 0, 0, 0)
    assert (await decode.stats.remote()).num_finished_reqs == finished_before


async def test_the_next_agent_step_loads_the_replys_kv_the_decode_engine_saved(server):
    """A decode engine saves the blocks its output completed when the request finishes, so the
    agent's next step (prompt = prompt + reply + tool result), prefilled on another engine,
    loads the reply's KV instead of recomputing it. The control: the same step after a reply
    the decode engine never produced loads only the prompt's full blocks."""
    from protos.wire import EngineRequest, SamplingOptions

    cluster = server.cluster
    decode = cluster.actor(cluster.decode_ids[0])
    prefill = cluster.actor(cluster.prefill_ids[0])
    prompt = random_prompt(BLOCK + BLOCK * 9 // 16, seed=71)  # one full block and a tail
    saved_before = (await decode.connector_counters.remote()).saved_blocks
    reply: list[int] = []
    step = EngineRequest("agent-step-1", tuple(prompt), SamplingOptions(max_tokens=2 * BLOCK,
                                                                        temperature=0.0))
    async for ref in decode.generate.options(num_returns="streaming").remote(step):
        reply.extend((await ref).token_ids)
    assert len(reply) == 2 * BLOCK
    tool_result = random_prompt(40, seed=72)
    # prompt + reply = 3 9/16 blocks: the reply completed blocks 1 and 2, and the KV of the
    # last reply token was never computed
    reply_blocks = (len(prompt) + len(reply) - 1) // BLOCK
    assert reply_blocks == 3

    # the decode engine computed the prompt itself: it saves its full block and its tail, then,
    # once the request finished, the two blocks the reply completed (off its step)
    deadline = time.monotonic() + 10
    while (await decode.connector_counters.remote()).saved_blocks - saved_before < 4:
        assert time.monotonic() < deadline, (
            f"the decode engine saved {(await decode.connector_counters.remote())} since "
            f"{saved_before}")
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # their commit, sent once written

    done = await prefill.prefill.remote(EngineRequest(
        "agent-step-2", tuple(prompt + reply + tool_result), SamplingOptions(max_tokens=1)))
    assert done.num_loaded_tokens == reply_blocks * BLOCK
    other_reply = random_prompt(len(reply), seed=73)
    control = await prefill.prefill.remote(EngineRequest(
        "agent-step-2-control", tuple(prompt + other_reply + tool_result),
        SamplingOptions(max_tokens=1)))
    # nothing of the other reply is anywhere; the prompt's full block is in the prefill
    # engine's own prefix cache by now (cached, not loaded)
    assert control.num_loaded_tokens == 0
