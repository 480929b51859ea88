"""Segmented salts on a real cluster: a public trunk shared across tenants, each tenant's suffix
isolated (``cache_salt`` from ``cache_salt_offset`` on).

Tiny model, 2 prefill + 1 decode instances, a host-tier store, real gRPC. vLLM's device cache
keeps the whole-prompt salt, so tenant B's trunk comes from the store's host tier, where it was
saved under the unsalted trunk keys by tenant A's request; A's suffix, salted, is out of B's
reach: B asking for it is placed and cached exactly like B asking for a random suffix.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from engine.config import CPU_KV_BLOCK_TOKENS
from gateway import client
from kvstore.connector import kv_layout_tag
from kvstore.keys import KeyExtras, block_keys, first_salted_block
from tests.integration.engines import random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

BLOCK = CPU_KV_BLOCK_TOKENS  # the CPU engines' KV block as shipped (EngineConfig.kv_block_tokens)
TRUNK_BLOCKS = 3
TRUNK_TOKENS = TRUNK_BLOCKS * BLOCK
SUFFIX_TOKENS = 2 * BLOCK + BLOCK * 5 // 16  # two full blocks and a tail


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({
        "name": "salts", "engine.model": "tiny", "http.enabled": False,
        "prefill.num_instances": 2, "decode.num_instances": 1,
        "kvstore.host_capacity_bytes": 256 << 20, "conductor.tuning.short_prefill_tokens": 0,
    }) as srv:
        yield srv


def keys_of(tokens: list[int], salt: str, offset: int) -> list[bytes]:
    extras = KeyExtras("tiny", salt, "", kv_layout_tag("torch.float32", BLOCK),
                       first_salted_block(offset, BLOCK))
    return block_keys(tokens, BLOCK, extras)


async def best_run(server, keys: list[bytes]) -> tuple[int, int]:
    """(blocks, of them in the host tier) of the longest run any instance reaches."""
    hits = (await server.cluster.conductor.prefix_hits.remote(keys)).hits_by_instance
    runs = [(h.num_blocks, h.num_blocks_host) for h in hits.values()]
    return max(runs, default=(0, 0))


async def wait_stored(server, keys: list[bytes], timeout_s: float = 15.0) -> None:
    """Until the index shows every one of ``keys`` in a store's host tier."""
    deadline = time.monotonic() + timeout_s
    while (await best_run(server, keys))[1] < len(keys):
        if time.monotonic() > deadline:
            raise AssertionError(f"the store's blocks never reached the index: "
                                 f"{await best_run(server, keys)}")
        await asyncio.sleep(0.05)


async def generate(server, prompt: list[int], salt: str, offset: int | None = None) -> dict:
    return await client.generate(server.target, token_ids=prompt, max_tokens=2, cache_salt=salt,
                                 cache_salt_offset=offset)


async def test_tenants_share_the_trunk_and_not_each_others_suffix(server):
    trunk = random_prompt(TRUNK_TOKENS, seed=9001)
    suffix_a, suffix_b, suffix_r = (random_prompt(SUFFIX_TOKENS, seed=s) for s in (9002, 9003, 9004))
    prompt_a = trunk + suffix_a

    a = await generate(server, prompt_a, "A", TRUNK_TOKENS)
    assert a["usage"]["cached_tokens"] == 0
    await wait_stored(server, keys_of(prompt_a, "A", TRUNK_TOKENS))
    # the index agrees with the store: B's keys reach A's trunk and none of A's suffix
    assert await best_run(server, keys_of(prompt_a, "B", TRUNK_TOKENS)) == (TRUNK_BLOCKS,) * 2

    b = await generate(server, trunk + suffix_b, "B", TRUNK_TOKENS)
    assert b["usage"]["cached_tokens"] == TRUNK_TOKENS  # loaded from the store's host tier
    assert b["placement"]["expected_cached_blocks"] == TRUNK_BLOCKS
    # the decode engine loaded B's whole prompt: prefill, decode and gateway keyed it alike
    assert b["usage"]["loaded_tokens"] == TRUNK_TOKENS + SUFFIX_TOKENS - 1

    b_for_a = await generate(server, prompt_a, "B", TRUNK_TOKENS)
    b_random = await generate(server, trunk + suffix_r, "B", TRUNK_TOKENS)
    for result in (b_for_a, b_random):
        assert result["usage"]["cached_tokens"] == TRUNK_TOKENS  # 0 tokens of A's suffix
        assert result["placement"]["expected_cached_blocks"] == TRUNK_BLOCKS
    placed = [(r["placement"]["prefill"], r["placement"]["decode"]) for r in (b_for_a, b_random)]
    assert placed[0] == placed[1]

    # A itself reuses its whole prompt (its salted suffix is in the store under its own keys)
    again = await generate(server, prompt_a, "A", TRUNK_TOKENS)
    assert again["usage"]["cached_tokens"] == len(prompt_a) - 1  # vLLM computes the last token


async def test_a_whole_prompt_salt_still_isolates_the_trunk(server):
    trunk = random_prompt(TRUNK_TOKENS, seed=9101)
    prompt_a = trunk + random_prompt(SUFFIX_TOKENS, seed=9102)
    a = await generate(server, prompt_a, "A")
    assert a["usage"]["cached_tokens"] == 0
    await wait_stored(server, keys_of(prompt_a, "A", 0))
    assert await best_run(server, keys_of(prompt_a, "B", 0)) == (0, 0)

    b = await generate(server, trunk + random_prompt(SUFFIX_TOKENS, seed=9103), "B")
    assert b["usage"]["cached_tokens"] == 0
    assert b["placement"]["expected_cached_blocks"] == 0
