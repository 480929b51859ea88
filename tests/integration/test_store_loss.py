"""The KV store node lost, and Redis restarted, while requests stream through a local cluster
(tiny model, one prefill and one decode worker, every prompt disaggregated).

Store lost: every request completes with a plain engine's greedy output; while the store is gone
the decode engine loads nothing (it recomputes) and the prefill engine's saves are dropped and
counted; the conductor's index holds nothing of the lost node; once a new store node is up, the
connectors find it by themselves, a new prompt is loaded from it again (every token but the
last), a repeated one is cached, its blocks are indexed again, and no pin is left in it.

Redis restarted: serving goes on, and the store node re-registers with what it holds."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import pytest_asyncio
import ray

from gateway import client
from kvstore.keys import KeyExtras, block_keys
from kvstore.metadata import BlockDirectory
from protos.wire import ConnectorCounters
from tests.integration.engines import plain_generate, plain_runner, random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MAX_TOKENS = 8
STREAMS = 3
_seeds = itertools.count(1000)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({"engine.model": "tiny", "http.enabled": False, "name": "storeloss",
                               "kvstore.host_capacity_bytes": 64 << 20,
                               "conductor.tuning.short_prefill_tokens": 0}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model):
    runner = plain_runner(tiny_model)
    yield runner
    runner.shutdown()


def fresh_prompt() -> list[int]:
    """A prompt no earlier request shares a block with (two full blocks and a tail)."""
    return random_prompt(300, seed=next(_seeds))


async def stream_until(server, stop: asyncio.Event) -> list[tuple[list[int], dict, float]]:
    """``STREAMS`` concurrent clients sending fresh prompts until ``stop``; (prompt, result,
    monotonic send time) of each."""
    done: list[tuple[list[int], dict, float]] = []

    async def one_stream() -> None:
        while not stop.is_set():
            prompt, sent = fresh_prompt(), time.monotonic()
            result = await asyncio.wait_for(
                client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS), 60)
            done.append((prompt, result, sent))

    await asyncio.gather(*(one_stream() for _ in range(STREAMS)))
    return done


async def assert_exact(reference, results) -> None:
    for i, (prompt, result, _sent) in enumerate(results):
        expected = await plain_generate(reference, prompt, MAX_TOKENS, f"ref-{i}")
        assert result["token_ids"] == expected


async def counters(server, instance_id: str) -> ConnectorCounters:
    return await server.cluster.actor(instance_id).connector_counters.remote()


async def test_requests_complete_while_the_store_node_is_lost_and_it_comes_back(server, reference):
    cluster = server.cluster
    [prefill_id], [decode_id] = cluster.prefill_ids, cluster.decode_ids
    warm = fresh_prompt()
    before = await client.generate(server.target, token_ids=warm, max_tokens=MAX_TOKENS)
    assert before["usage"]["loaded_tokens"] == len(warm) - 1  # the store path works
    dropped_before = (await counters(server, prefill_id)).dropped_save_blocks

    stop = asyncio.Event()
    load = asyncio.create_task(stream_until(server, stop))
    await asyncio.sleep(2)
    await asyncio.to_thread(cluster.kill_store)
    killed_at = time.monotonic()
    await asyncio.sleep(4)  # serving without a store
    index_while_gone = (await cluster.conductor.status.remote()).indexed_blocks
    await asyncio.to_thread(cluster.start_store)
    back_at = time.monotonic()
    await asyncio.sleep(4)
    stop.set()
    results = await load

    await assert_exact(reference, [(warm, before, 0.0), *results])
    during = [r for _p, r, sent in results
              if killed_at < sent and sent + r["usage"]["e2e_ms"] / 1000 < back_at]
    assert len(during) >= STREAMS  # requests were served from start to end without a store
    assert all(r["usage"]["loaded_tokens"] == 0 for r in during)  # recomputed
    assert index_while_gone["host"] == 0  # the lost node's entries were dropped
    assert (await counters(server, prefill_id)).dropped_save_blocks > dropped_before

    # recovered: the connectors use the new store without being told
    again = fresh_prompt()
    first = await client.generate(server.target, token_ids=again, max_tokens=MAX_TOKENS)
    assert first["usage"]["loaded_tokens"] == len(again) - 1
    repeated = await client.generate(server.target, token_ids=again, max_tokens=MAX_TOKENS)
    assert repeated["usage"]["cached_tokens"] == len(again) - 1
    assert repeated["token_ids"] == first["token_ids"] == await plain_generate(
        reference, again, MAX_TOKENS, "ref-again")
    status = await cluster.conductor.status.remote()
    assert status.indexed_blocks["host"] > 0 and status.last_seq_by_source["node0"] >= 0
    assert (await cluster.store.stats.remote()).pinned_blocks == 0
    assert (await counters(server, decode_id)).failed_load_blocks == 0
    assert (status.num_in_flight_prefills, status.num_in_flight_decodes) == (0, 0)


async def test_a_redis_restart_under_load_loses_no_request_and_the_store_re_registers(
        server, reference):
    cluster = server.cluster
    stop = asyncio.Event()
    load = asyncio.create_task(stream_until(server, stop))
    await asyncio.sleep(2)
    stopped_at = time.monotonic()
    await asyncio.to_thread(cluster.restart_redis, 1.0)
    restarted_at = time.monotonic()
    await asyncio.sleep(3)
    stop.set()
    results = await load

    await assert_exact(reference, results)
    finished = [(p, sent + r["usage"]["e2e_ms"] / 1000) for p, r, sent in results]
    assert any(stopped_at < end < restarted_at for _p, end in finished)  # served while down
    assert any(end > restarted_at for _p, end in finished)
    directory = BlockDirectory.from_url(cluster.redis.url)
    arena = (await cluster.store.arena_info.remote()).path
    deadline = time.monotonic() + 10
    while directory.nodes() != {"node0": arena} and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert directory.nodes() == {"node0": arena}
    # what was stored before the restart and while Redis was down is back by re-registration:
    # the directory says of node0 exactly what node0 holds, block by block (the host tier is
    # LRU, so the oldest of these prompts may have been evicted since: then neither has it)
    scheme = await cluster.conductor.key_scheme.remote()
    extras = KeyExtras(scheme.model_id, "", "", scheme.kv_layout)
    held_while_down = 0
    for prompt, end in finished:
        keys = block_keys(prompt, scheme.block_size_tokens, extras)
        tiers = await cluster.store.tiers.remote(keys)
        assert directory.locate(keys) == [{"node0": t} if t else {} for t in tiers]
        held_while_down += stopped_at < end < restarted_at and tiers == ["host"] * len(keys)
    assert held_while_down > 0  # blocks stored while Redis was down were re-registered
    # and nothing the node does not hold
    assert directory.node_block_count("node0") == (await cluster.store.stats.remote()).ready_blocks


async def test_a_store_node_that_dies_on_its_own_is_replaced_by_the_cluster(server, reference):
    cluster = server.cluster
    old = cluster.store
    ray.kill(old, no_restart=True)  # a crash: nobody tells the cluster
    deadline = time.monotonic() + 60
    while cluster.store is old and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert cluster.store is not old  # the watchdog started a new one

    prompt = fresh_prompt()
    result = await client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS)
    assert result["usage"]["loaded_tokens"] == len(prompt) - 1  # loaded from the new store
    assert result["token_ids"] == await plain_generate(reference, prompt, MAX_TOKENS, "ref-crash")
    assert (await cluster.store.stats.remote()).pinned_blocks == 0
