"""``baton chaos`` on real parts: a local cluster (tiny model, 2 prefill + 2 decode, prefill and
decode on two store nodes that pull from each other) under four concurrent streams while workers
are killed and replaced, store nodes are killed mid-pull and replaced, and Redis is restarted.
Every request is accounted for, no answer differs from a plain engine's, none is lost, and
nothing is left pinned (in the last store nodes) or booked."""

from __future__ import annotations

import pytest

from bench.chaos import run_chaos
from cluster.config import load_config

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


async def test_killing_workers_and_the_store_and_restarting_redis_loses_and_leaks_nothing(tiny_model):
    config = load_config(None, {"engine.model": "tiny", "name": "chaostest", "gateway.port": 0,
                                "http.enabled": False, "prefill.num_instances": 2,
                                "decode.num_instances": 2, "kvstore.host_capacity_bytes": 256 << 20,
                                "conductor.tuning.short_prefill_tokens": 0})

    report = await run_chaos(config, duration_s=30, concurrency=4, kill_every_s=6, seed=3,
                             kill_store_every_s=10, restart_redis_every_s=12)

    assert report.sent == (report.completed + report.failed_clean + report.failed_other
                           + report.lost + report.wrong)
    assert (report.lost, report.wrong, report.leaked, report.failed_other) == (0, 0, 0, 0), report
    assert report.ok and report.seed == 3 and report.store_nodes == 2
    assert report.completed > 0 and len(report.kills) >= 2
    assert report.faults["store_mid_pull"] >= 1 and report.faults["redis"] >= 1, report.faults
    worker_kinds = ("prefill_mid_transfer", "prefill_worker", "decode_worker")
    assert sum(report.faults[kind] for kind in worker_kinds) == len(report.kills)
    assert len(report.hits) == sum(report.faults.values())
    assert [h.victim for h in report.hits if h.kind in worker_kinds] == report.kills
    assert any(h.in_flight > 0 for h in report.hits)  # faults met requests in flight
    assert report.retried > 0 or report.failed_clean > 0, report  # and some request met a fault
    assert set(report.failed_by_status) <= {"UNAVAILABLE"}  # a decode worker died mid-stream
    assert report.leaks == {"pinned_blocks": 0, "booked_prefills": 0, "booked_decodes": 0,
                            "engine_sequences": 0}


async def test_the_positive_control_corrupted_kv_is_caught_as_wrong_answers(tiny_model):
    """The drill's ``wrong`` is not blind: with every stored block corrupted, decode instances
    that load KV answer from garbage, and the drill counts those answers wrong."""
    config = load_config(None, {"engine.model": "tiny", "name": "chaosctl", "gateway.port": 0,
                                "http.enabled": False, "prefill.num_instances": 1,
                                "decode.num_instances": 1, "kvstore.host_capacity_bytes": 256 << 20,
                                "conductor.tuning.short_prefill_tokens": 0})

    report = await run_chaos(config, duration_s=8, concurrency=4, kill_every_s=0, seed=5,
                             kill_store_every_s=0, restart_redis_every_s=0, corrupt_kv=True)

    assert report.wrong > 0, report
    assert report.ok and report.lost == 0
    assert report.sent == (report.completed + report.failed_clean + report.failed_other
                           + report.lost + report.wrong)


async def test_a_prefill_killed_mid_transfer_is_retried_and_its_reserved_slots_come_back(tiny_model):
    """The drill's mid-transfer kill, on its own: a prefill worker dies with half of a prompt's
    blocks copied into the slots it reserved and none committed. Every request is still
    answered (placed again on the other prefill worker), the store node aborts the dead
    process's reservations by itself, and the prompt is stored whole by the next prefill."""
    import asyncio
    import random
    import time

    import ray

    from bench.chaos import fresh_prompts, prompt_pool
    from cluster.serve import BatonServer
    from gateway import client, metrics

    config = load_config(None, {"engine.model": "tiny", "name": "chaosmid", "gateway.port": 0,
                                "http.enabled": False, "prefill.num_instances": 2,
                                "decode.num_instances": 1, "kvstore.host_capacity_bytes": 256 << 20,
                                "conductor.tuning.short_prefill_tokens": 0})
    server = BatonServer(config)
    await server.start()
    try:
        cluster = server.cluster
        victim = cluster.prefill_ids[0]
        retried = metrics.RETRIES.labels("prefill_worker_died")
        retried_before = retried._value.get()
        prompts = fresh_prompts(prompt_pool(3, 9), 64, 9)
        random.Random(0).shuffle(prompts)
        await cluster.actor(victim).crash_mid_save.remote()
        answers, died = [], False
        for start in range(0, len(prompts), 4):  # rounds of 4 until the victim has died
            batch = prompts[start:start + 4]
            answers += await asyncio.gather(*(client.generate(
                server.target, token_ids=p, max_tokens=4, timeout_s=60) for p in batch))
            try:
                await asyncio.wait_for(cluster.actor(victim).ready.remote(), 5)
            except (ray.exceptions.RayActorError, ValueError):
                died = True
                break
        assert died, "the victim never reached a save of two blocks"
        assert [len(a["token_ids"]) for a in answers] == [4] * len(answers)  # none failed
        assert retried._value.get() - retried_before >= 1
        store = cluster.store
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (await store.stats.remote()).pinned_blocks == 0 and await store.reclaimed.remote() != (0, 0):
                break
            await asyncio.sleep(0.2)
        aborted, _ = await store.reclaimed.remote()
        holders = await store.holder_counts.remote()
        assert aborted >= 2, holders  # the victim died holding at least two blocks' reservations
        assert (await store.stats.remote()).pinned_blocks == 0
        assert victim not in holders
        # the survivor's memory report reads its own process: a KV cache, partly touched
        memory = await cluster.actor(cluster.prefill_ids[1]).memory.remote()
        assert 0 < memory.kv_cache_resident_mb <= memory.kv_cache_mb
        assert memory.malloc_in_use_mb >= memory.kv_cache_resident_mb
        assert memory.rss_mb >= memory.kv_cache_resident_mb
    finally:
        await server.stop()


async def test_a_store_node_killed_mid_pull_as_reader_or_as_source_loses_nothing(tiny_model):
    """The drill's mid-pull kill, on its own, on a cluster whose prefill and decode workers use
    two store nodes (every hand-off a pull from node0 to node1 over TCP). Node1 dies as the
    reader (the blocks read into its reserved slots, none committed), then node0 as the source
    (half of a reply's blocks sent). Every request in between is answered as a plain engine
    answers it, the watchdog replaces each victim, pulls work again through the new nodes, and
    nothing is left pinned or booked."""
    import asyncio

    import ray

    from bench.chaos import fresh_prompts, prompt_pool, reference_answers, with_transfer
    from bench.leaks import leaks
    from cluster.serve import BatonServer
    from gateway import client

    config = with_transfer(load_config(None, {
        "engine.model": "tiny", "name": "chaospull", "gateway.port": 0, "http.enabled": False,
        "prefill.num_instances": 1, "decode.num_instances": 1,
        "kvstore.host_capacity_bytes": 256 << 20, "conductor.tuning.short_prefill_tokens": 0}))
    server = BatonServer(config, store_nodes=2)
    await server.start()
    try:
        cluster = server.cluster
        assert sorted(cluster.stores) == ["node0", "node1"]
        prompts = fresh_prompts(prompt_pool(3, 11), 12, 11)
        references = await reference_answers(cluster.model, prompts, 4)
        todo = list(range(len(prompts)))

        async def answer_next() -> None:
            i = todo.pop(0)
            result = await client.generate(server.target, token_ids=prompts[i], max_tokens=4,
                                           timeout_s=60)
            assert result["token_ids"] == references[i], i

        await answer_next()  # a hand-off: node1 pulled the prompt's blocks from node0
        assert (await cluster.stores["node1"].tier_counters.remote()).pulled_blocks >= 2
        for node_id in ("node1", "node0"):  # the reader, then the source
            old = cluster.stores[node_id]
            await old.crash_mid_pull.remote()
            died = False
            while todo and not died:
                await answer_next()
                try:
                    await asyncio.wait_for(old.arena_info.remote(), 5)
                except ray.exceptions.RayActorError:
                    died = True
            assert died, f"{node_id} took part in no pull"
            for _ in range(600):  # the watchdog replaces it
                if cluster.stores[node_id] is not old:
                    break
                await asyncio.sleep(0.1)
            assert cluster.stores[node_id] is not old
        pulled_before = (await cluster.stores["node1"].tier_counters.remote()).pulled_blocks
        await answer_next()  # both nodes new: the hand-off pulls again
        pulled_after = (await cluster.stores["node1"].tier_counters.remote()).pulled_blocks
        assert pulled_after >= pulled_before + 2
        assert await leaks(server) == {"pinned_blocks": 0, "booked_prefills": 0,
                                       "booked_decodes": 0, "engine_sequences": 0}
    finally:
        await server.stop()
