"""``baton chaos``: sustained streaming load while workers, the store node and Redis fail.

Starts a whole local cluster (as ``baton serve`` does), computes each prompt's greedy answer once
on a plain vLLM engine in this process (the reference), then for ``duration_s`` keeps
``concurrency`` gRPC streams going over a pool of prompts that share prefixes, while three fault
schedules run side by side:

- every ``kill_every_s`` a random prefill or decode worker is killed without warning and a
  fresh one started in its place;
- about every ``kill_store_every_s`` (a random draw between half and one and a half times it)
  the KV store node is killed without warning; the cluster's watchdog starts a new one, and the
  engines recompute while it is gone and find the new one by themselves;
- about every ``restart_redis_every_s`` (drawn the same way) Redis is stopped and started again,
  empty, on the same port a second later: the store node re-registers.

``0`` turns a schedule off. ``ChaosReport.faults`` counts what was injected, by kind. Every
request ends in exactly one bucket:

- ``completed``: the answer equals the reference token for token;
- ``wrong``: an answer that differs (must be 0);
- ``failed_clean``: a gRPC error with a defined status (e.g. UNAVAILABLE when a decode worker
  died mid-stream and no other could continue it: the message says how many tokens were
  delivered);
- ``lost``: neither an answer nor an error before the client's deadline (must be 0).

``retried`` counts requests the router placed again because their prefill worker died before
answering, or moved to another decode instance because theirs died mid-stream (they then end in
one of the buckets above). ``leaked``, measured once the load has
stopped and the books had time to close: KV blocks still pinned in the store node serving then
(the last one started), requests still booked in the conductor, and sequences still running or
waiting in the surviving engines (must be 0).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Callable

import msgspec
import ray

from cluster.config import ClusterConfig
from cluster.serve import BatonServer
from gateway import client, metrics

CLIENT_TIMEOUT_S = 120.0
"""A request with no answer and no error by then is counted as lost."""


class ChaosReport(msgspec.Struct):
    sent: int = 0
    completed: int = 0
    retried: int = 0
    failed_clean: int = 0
    lost: int = 0
    wrong: int = 0
    leaked: int = 0
    failed_by_status: dict[str, int] = {}
    kills: list[str] = []
    """The workers killed, in order."""
    faults: dict[str, int] = {}
    """Faults injected by kind: prefill_worker, decode_worker, store_node, redis."""
    leaks: dict[str, int] = {}
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.wrong == 0 and self.leaked == 0


def prompt_pool(num_prompts: int, seed: int, block_tokens: int = 128) -> list[list[int]]:
    """Prompts in groups that share a two-block prefix (so the KV store and the index matter),
    each with its own tail."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 30_000) for _ in range(2 * block_tokens)] for _ in range(3)]
    return [prefixes[i % len(prefixes)] + [rng.randrange(100, 30_000) for _ in range(rng.randrange(8, 200))]
            for i in range(num_prompts)]


async def _references(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import os

    from engine.builder import build_engine_args, engine_env
    from engine.config import EngineConfig
    from protos.wire import EngineRequest, SamplingOptions

    for name, value in engine_env(EngineConfig(model=model.name), "nobind").items():
        os.environ.setdefault(name, value)  # before vLLM is imported in this process
    from engine.runner import EngineRunner

    runner = EngineRunner(build_engine_args(EngineConfig(model=model.name), model, "plain", "reference", None))
    try:
        answers = []
        for i, prompt in enumerate(prompts):
            request = EngineRequest(f"reference-{i}", tuple(prompt),
                                    SamplingOptions(max_tokens=max_tokens, temperature=0.0))
            tokens: list[int] = []
            async for output in runner.generate(request):
                tokens.extend(output.outputs[0].token_ids)
            answers.append(tokens)
        return answers
    finally:
        runner.shutdown()


async def _client_loop(server: BatonServer, prompts, references, max_tokens: int, deadline: float,
                       rng: random.Random, report: ChaosReport) -> None:
    while time.monotonic() < deadline:
        i = rng.randrange(len(prompts))
        report.sent += 1
        try:
            result = await asyncio.wait_for(
                client.generate(server.target, token_ids=prompts[i], max_tokens=max_tokens,
                                timeout_s=CLIENT_TIMEOUT_S),
                CLIENT_TIMEOUT_S + 10)
        except client.GenerateFailed as exc:
            if exc.status == "DEADLINE_EXCEEDED":
                report.lost += 1
            else:
                report.failed_clean += 1
                report.failed_by_status[exc.status] = report.failed_by_status.get(exc.status, 0) + 1
            continue
        except asyncio.TimeoutError:
            report.lost += 1
            continue
        if result["token_ids"] == references[i]:
            report.completed += 1
        else:
            report.wrong += 1


async def _chaos_loop(server: BatonServer, deadline: float, kill_every_s: float, rng: random.Random,
                      report: ChaosReport, progress: Callable[[str], None]) -> None:
    """Kill a random worker every ``kill_every_s``, never the last live one of its pool, and
    start its replacement in the background (an engine takes tens of seconds to come up)."""
    cluster = server.cluster
    replacing: list[asyncio.Future] = []
    while kill_every_s > 0 and time.monotonic() + kill_every_s < deadline:
        await asyncio.sleep(kill_every_s)
        up = [[i for i in ids if i in cluster.engine_start_s] for ids in (cluster.prefill_ids,
                                                                          cluster.decode_ids)]
        pools = [ids for ids in up if len(ids) >= 2]
        if not pools:
            continue
        victim = rng.choice(rng.choice(pools))
        progress(f"killing {victim}")
        report.kills.append(victim)
        kind = "prefill_worker" if victim in cluster.prefill_ids else "decode_worker"
        report.faults[kind] = report.faults.get(kind, 0) + 1
        ray.kill(cluster.actor(victim), no_restart=True)
        replacing.append(asyncio.ensure_future(asyncio.to_thread(cluster.replace_worker, victim)))
    for new_id in await asyncio.gather(*replacing):
        progress(f"{new_id} replaced a killed worker")


def _lose_store(cluster, timeout_s: float = 120.0) -> None:
    """Kill the store node without warning, as a crash would, and return once the cluster's
    watchdog has started a new one."""
    old = cluster.store
    ray.kill(old, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while cluster.store is old:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no new store node {timeout_s:.0f} s after the old one was killed")
        time.sleep(0.1)


async def _fault_loop(kind: str, inject: Callable[[], object], every_s: float, deadline: float,
                      rng: random.Random, report: ChaosReport,
                      progress: Callable[[str], None]) -> None:
    """Inject one fault of ``kind`` (``inject`` runs in a thread and returns when it is over:
    the store node or Redis is back) at random intervals of ``every_s`` give or take half."""
    if every_s <= 0:
        return
    while True:
        wait_s = every_s * rng.uniform(0.5, 1.5)
        if time.monotonic() + wait_s >= deadline:
            return
        await asyncio.sleep(wait_s)
        started = time.monotonic()
        progress(f"injecting a fault: {kind}")
        report.faults[kind] = report.faults.get(kind, 0) + 1
        await asyncio.to_thread(inject)
        progress(f"{kind} back after {time.monotonic() - started:.1f} s")


async def _leaks(server: BatonServer, settle_s: float = 30.0) -> dict[str, int]:
    """What is still held once the load stopped, after up to ``settle_s`` for books to close.
    Pins are read from the store node serving now (the last one started)."""
    cluster = server.cluster
    deadline = time.monotonic() + settle_s
    while True:
        stores = {"node0": (await cluster.store.stats.remote()).pinned_blocks}
        books = await cluster.conductor.status.remote()
        prefills, decodes = books.num_in_flight_prefills, books.num_in_flight_decodes
        in_engines = 0
        for instance_id in cluster.prefill_ids + cluster.decode_ids:
            stats = await cluster.actor(instance_id).stats.remote()
            in_engines += stats.num_running_reqs + stats.num_waiting_reqs
        leaks = {"pinned_blocks": sum(stores.values()), "booked_prefills": prefills,
                 "booked_decodes": decodes, "engine_sequences": in_engines}
        if not any(leaks.values()) or time.monotonic() > deadline:
            return leaks
        await asyncio.sleep(0.5)


async def run_chaos(config: ClusterConfig, duration_s: float, concurrency: int = 4,
                    kill_every_s: float = 10.0, max_tokens: int = 16, num_prompts: int = 12,
                    seed: int = 0, progress: Callable[[str], None] = lambda _m: None,
                    kill_store_every_s: float = 20.0,
                    restart_redis_every_s: float = 25.0) -> ChaosReport:
    server = BatonServer(config, progress=progress)
    await server.start()
    report = ChaosReport()
    try:
        prompts = prompt_pool(num_prompts, seed)
        progress(f"computing {len(prompts)} reference answers on a plain engine")
        references = await _references(server.cluster.model, prompts, max_tokens)
        retries = [metrics.RETRIES.labels(reason)
                   for reason in ("prefill_worker_died", "decode_worker_died")]
        retried_before = sum(r._value.get() for r in retries)
        started = time.monotonic()
        deadline = started + duration_s
        cluster = server.cluster
        if restart_redis_every_s > 0 and cluster.redis is None:
            progress("redis.url is set: Redis is not the cluster's own, so it is not restarted")
            restart_redis_every_s = 0
        progress(f"load: {concurrency} streams for {duration_s:.0f} s; faults about every: worker "
                 f"{kill_every_s:.0f} s, store node {kill_store_every_s:.0f} s, Redis "
                 f"{restart_redis_every_s:.0f} s (0: never)")
        report.faults = {"prefill_worker": 0, "decode_worker": 0, "store_node": 0, "redis": 0}
        rng = random.Random(seed)
        await asyncio.gather(
            _chaos_loop(server, deadline, kill_every_s, random.Random(seed + 1), report, progress),
            _fault_loop("store_node", lambda: _lose_store(cluster), kill_store_every_s, deadline,
                        random.Random(seed + 2), report, progress),
            _fault_loop("redis", cluster.restart_redis, restart_redis_every_s, deadline,
                        random.Random(seed + 3), report, progress),
            *(_client_loop(server, prompts, references, max_tokens, deadline,
                           random.Random(rng.random()), report) for _ in range(concurrency)),
        )
        report.duration_s = round(time.monotonic() - started, 1)
        report.retried = int(sum(r._value.get() for r in retries) - retried_before)
        report.leaks = await _leaks(server)
        report.leaked = sum(report.leaks.values())
    finally:
        await server.stop()
    return report


def main(config: ClusterConfig, duration_s: float, concurrency: int, kill_every_s: float,
         json_path: Path | None, seed: int, progress: Callable[[str], None],
         kill_store_every_s: float = 20.0, restart_redis_every_s: float = 25.0) -> ChaosReport:
    report = asyncio.run(run_chaos(config, duration_s, concurrency, kill_every_s, seed=seed,
                                   progress=progress, kill_store_every_s=kill_store_every_s,
                                   restart_redis_every_s=restart_redis_every_s))
    data = msgspec.to_builtins(report)
    print(json.dumps({k: data[k] for k in ("sent", "completed", "retried", "failed_clean", "lost",
                                           "wrong", "leaked")}))
    print(f"faults: {report.faults}; workers killed: {', '.join(report.kills) or 'none'}; "
          f"failed by status: {report.failed_by_status}; leaks: {report.leaks}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2) + "\n")
    return report
