"""A session's KV survives the traffic that evicts everything else, on a real cluster (tiny
model, 1 prefill + 1 decode, one store node, Redis, gRPC): both engines' own KV caches and the
store's host tier are small, so background prompts evict every unleased block. A session step
and an unleased twin of the same shape are sent, then the background traffic; afterwards the
session's next step reads its whole prefix from cache and the twin reads nothing. Closing the
session releases its lease: its blocks are ordinary LRU blocks again, and the same traffic then
evicts them too."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from cluster.local import kv_block_bytes
from engine.builder import dtype_bytes, effective_dtype
from engine.config import EngineConfig
from gateway.client import build_request
from gateway.sessions import scoped_session_id
from protos.baton.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.engines import random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

BS = 128
"""Blocks of 128 tokens: at the CPU default of 32 the tiny model's host tier of HOST_BLOCKS
would fall under the store's 1 MiB minimum."""
PROMPT_BLOCKS = 4
TAIL = 40
HOST_BLOCKS = 24
DEVICE_BLOCKS = 16
NOISE_PROMPTS = 8  # 8 x 4 blocks: more than the host tier and each device cache hold


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    block_bytes = kv_block_bytes(tiny_model, BS, dtype_bytes(effective_dtype(
        EngineConfig(model="tiny"), tiny_model)))
    async with running_server({
            "name": "retention", "engine.model": "tiny", "http.enabled": False,
            "engine.num_kv_blocks": DEVICE_BLOCKS, "engine.max_model_len_tokens": 1024,
            "engine.block_size_tokens": BS,
            "kvstore.host_capacity_bytes": HOST_BLOCKS * block_bytes,
            "kvstore.lease_max_bytes": HOST_BLOCKS * block_bytes,
            "kvstore.lease_max_bytes_per_tenant": HOST_BLOCKS * block_bytes}) as srv:
        yield srv


async def generate(stub, prompt: list[int], session_id: str = "") -> tuple[list[int], object]:
    request = build_request(token_ids=prompt, max_tokens=8, temperature=0.0)
    request.session_id = session_id
    reply, usage = [], None
    async for response in stub.Generate(request, timeout=120):
        if response.HasField("delta"):
            reply.extend(response.delta.token_ids)
        else:
            usage = response.final.usage
    return reply, usage


async def noise(stub, seed: int) -> None:
    for i in range(NOISE_PROMPTS):
        await generate(stub, random_prompt(PROMPT_BLOCKS * BS, seed + i))


async def leased_blocks(server) -> int:
    for _ in range(50):  # the workers' lease calls are sent without waiting
        stats = await server.cluster.store.lease_stats.remote()
        if stats.leased_blocks >= PROMPT_BLOCKS:
            return stats.leased_blocks
        await asyncio.sleep(0.1)
    return stats.leased_blocks


async def test_a_leased_session_prefix_outlives_the_traffic_that_evicts_its_unleased_twin(server):
    session_prompt = random_prompt(PROMPT_BLOCKS * BS + TAIL, 1)
    twin_prompt = random_prompt(PROMPT_BLOCKS * BS + TAIL, 2)
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        reply, first = await generate(stub, session_prompt, "agent-1")
        await generate(stub, twin_prompt)
        assert first.cached_tokens == 0
        assert await leased_blocks(server) == PROMPT_BLOCKS  # the reply completes no block
        await noise(stub, 100)

        step = session_prompt + reply + random_prompt(200, 3)
        _, second = await generate(stub, step, "agent-1")
        _, twin_again = await generate(stub, twin_prompt)
        assert second.cached_tokens == PROMPT_BLOCKS * BS  # its whole prefix, from the store
        assert second.cache_read_input_tokens == second.cached_tokens
        assert second.cache_creation_input_tokens == second.prompt_tokens - second.cached_tokens
        assert twin_again.cached_tokens == 0  # evicted everywhere

        scoped = scoped_session_id("", "", "agent-1")
        closed = await server.cluster.conductor.close_session.remote(scoped)
        assert (closed.session_id, closed.num_steps) == (scoped, 2)
        assert closed.released_blocks >= PROMPT_BLOCKS
        assert (await server.cluster.store.lease_stats.remote()).leased_blocks == 0
        await noise(stub, 200)
        _, after_close = await generate(stub, session_prompt)
        assert after_close.cached_tokens == 0  # plain LRU blocks now: evicted like the rest
        assert await server.cluster.conductor.close_session.remote(scoped) is None
