"""A request's cached tokens by tier, on a real cluster (tiny model, 1 prefill + 1 decode, every
request disaggregated, one store node): a prompt repeated at once is found in the prefill
engine's own prefix cache (device); once background prompts have evicted it there (the engines'
own caches are a few blocks), it is loaded from the store's host tier (host). Reported in gRPC
``Usage`` (through the client, as ``baton generate --json`` prints it) and in the HTTP usage."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio

from gateway import client
from tests.integration.engines import random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

BLOCK = 128  # the engines' KV block, configured (the CPU default is 32): DEVICE_BLOCKS hold 1,536 tokens
DEVICE_BLOCKS = 12
PROMPT_TOKENS = 3 * BLOCK + 20  # three full blocks and a partial tail
LOADABLE = PROMPT_TOKENS - 1  # vLLM computes the last prompt token itself


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({"engine.model": "tiny", "kvstore.host_capacity_bytes": 256 << 20,
                               "engine.num_kv_blocks": DEVICE_BLOCKS, "engine.block_size_tokens": BLOCK,
                               "engine.max_model_len_tokens": 1024,
                               "conductor.tuning.short_prefill_tokens": 0}) as srv:
        yield srv


def tiers(usage: dict) -> dict:
    """The breakdown, checked to add up to ``cached_tokens``."""
    by_tier = usage["cached_tokens_by_tier"]
    assert sum(by_tier.values()) == usage["cached_tokens"]
    return by_tier


async def test_a_repeated_prompt_is_reused_from_the_prefill_engines_own_cache(server):
    prompt = random_prompt(PROMPT_TOKENS, seed=61)

    cold = await client.generate(server.target, token_ids=prompt, max_tokens=4)
    warm = await client.generate(server.target, token_ids=prompt, max_tokens=4)

    assert tiers(cold["usage"]) == {"device": 0, "host": 0, "disk": 0, "pulled": 0}
    assert warm["placement"]["prefill"] == cold["placement"]["prefill"]
    # the full blocks are in the engine's own cache; the partial tail (vLLM caches only full
    # blocks) comes from the store, which the prefill saved it to
    assert warm["usage"]["cached_tokens"] == LOADABLE
    assert tiers(warm["usage"]) == {"device": 3 * BLOCK, "host": LOADABLE - 3 * BLOCK,
                                    "disk": 0, "pulled": 0}


async def test_a_prompt_evicted_from_the_device_cache_is_loaded_from_the_host_tier(server):
    prompt = random_prompt(PROMPT_TOKENS, seed=71)
    await client.generate(server.target, token_ids=prompt, max_tokens=4)
    for seed in range(72, 76):  # 4 x 4 blocks through each engine's 12: the prompt's are gone
        await client.generate(server.target, token_ids=random_prompt(4 * BLOCK - 8, seed),
                              max_tokens=2)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}",
                                 timeout=60) as http:
        answer = await http.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})

    details = answer.json()["usage"]["prompt_tokens_details"]
    assert details == {"cached_tokens": LOADABLE, "cached_tokens_by_tier": {
        "device": 0, "host": LOADABLE, "disk": 0, "pulled": 0}}
