"""``baton chaos``: sustained streaming load while workers, the store node and Redis fail.

Starts a whole local cluster (as ``baton serve`` does), computes each prompt's greedy answer once
on a plain vLLM engine in this process (the reference), then for ``duration_s`` keeps
``concurrency`` gRPC streams going over a pool of prompts that share prefixes, while three fault
schedules run side by side. Every draw (prompts, streams, fault times, victims) comes from one
``seed``; without one a fresh seed is drawn and printed, so a failing run replays.

- about every ``kill_every_s`` (a random draw between half and one and a half times it, the
  times drawn up front: ``fault_times``) a worker is killed without warning and a fresh one
  started in its place. The victim is aimed at streams in flight: a pool with two live
  instances or more is drawn, then, within it, an instance with requests running (a decode
  mid-stream) if there is one. A prefill victim is
  killed mid-transfer: its engine is told to die in the middle of its next KV save
  (``EngineWorker.crash_mid_save``: half the blocks copied into the slots it reserved, none
  committed, then SIGKILL), since a tiny-model prefill lasts milliseconds and is never found
  running by a look from outside; a quarter of the requests carry a prompt whose tail the
  store has never seen, so a save comes within moments. Such a kill counts as
  ``prefill_mid_transfer``; one whose save did not come within ``ARM_WINDOW_S`` is a plain
  kill (``prefill_worker``). When no pool can spare an instance (the replacements are still starting), the
  tick kills a KV store node instead, if its schedule is on, so a run of S seconds injects
  about S / ``kill_every_s`` faults; otherwise the tick is counted in ``skipped_ticks``;
- about every ``kill_store_every_s`` (drawn the same way) a KV store node is killed without
  warning; the cluster's watchdog starts a new one, and the engines recompute while it is gone
  and find the new one by themselves. With ``store_nodes=2`` (the default) the prefill workers
  store on ``node0`` and the decode workers on ``node1``, so every hand-off is a pull between
  the two over the transfer engine (TCP on loopback), and the victim, drawn of the two, is
  killed mid-pull: told to die in the middle of the next pull it takes part in
  (``KVStoreNode.crash_mid_pull``: as the reader, with the blocks read into reserved slots and
  none committed; as the source, with half of a reply's blocks sent). Such a kill counts as
  ``store_mid_pull``; one whose pull did not come within ``ARM_WINDOW_S`` is a plain kill
  (``store_node``);
- about every ``restart_redis_every_s`` (drawn the same way) Redis is stopped and started again,
  empty, on the same port a second later: the store node re-registers.

``0`` turns a schedule off. ``ChaosReport.faults`` counts what was injected, by kind, and
``hits`` says, for each fault, how many requests were in flight on its victim (the whole
cluster's for a store node and Redis). Every request ends in exactly one bucket:

- ``completed``: the answer equals the reference token for token;
- ``wrong``: an answer that differs (must be 0);
- ``failed_clean``: UNAVAILABLE or RESOURCE_EXHAUSTED with the gateway's retry hint
  (``retry-after-ms``), e.g. when a decode worker died mid-stream and no other could continue
  it (the message says how many tokens were delivered): what a client is told to retry;
- ``failed_other``: any other error (INTERNAL, UNKNOWN, a retryable status without a hint, ...):
  must be 0;
- ``lost``: neither an answer nor an error before the client's deadline (must be 0).

``corrupt_kv`` is the positive control of ``wrong``: the store node inverts the bytes of every
block committed during the run (``KVStoreNode.corrupt_on_commit``), so a decode instance that
loads a prompt's KV instead of computing it answers from garbage. The control passes when the
drill catches it (``wrong`` > 0); a control run that finds nothing wrong means ``wrong`` is blind.

``retried`` counts requests the router placed again because their prefill worker died before
answering, or moved to another decode instance because theirs died mid-stream (they then end in
one of the buckets above). ``leaked``, measured once the load has
stopped and the books had time to close: KV blocks still pinned in the store nodes serving then
(the last ones started), requests still booked in the conductor, and sequences still running or
waiting in the surviving engines (must be 0).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Awaitable, Callable

import msgspec
import ray

from bench.leaks import leaks
from cluster.config import ClusterConfig
from cluster.serve import BatonServer
from gateway import client, metrics

CLIENT_TIMEOUT_S = 120.0
"""A request with no answer and no error by then is counted as lost."""


ARM_WINDOW_S = 8.0
"""How long a prefill victim told to die mid-save may take to reach a save before it is killed
plainly."""
FRESH_SHARE = 0.25
"""Of the requests, the share that carries a prompt the store has never seen (while those last)."""

CORRUPT_EVERY_BLOCK = 1 << 40
"""A corruption budget no run exhausts."""
RETRYABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
"""The statuses a client is told to retry; ``failed_clean`` only with the gateway's hint."""


class FaultHit(msgspec.Struct):
    kind: str
    """prefill_mid_transfer, prefill_worker, decode_worker, store_mid_pull, store_node or
    redis."""
    victim: str
    at_s: float
    """Seconds into the load."""
    in_flight: int
    """Requests running or waiting on the victim when it was hit (for a store node and Redis:
    on every engine of the cluster)."""


class ChaosReport(msgspec.Struct):
    seed: int = 0
    sent: int = 0
    completed: int = 0
    retried: int = 0
    failed_clean: int = 0
    failed_other: int = 0
    lost: int = 0
    wrong: int = 0
    leaked: int = 0
    failed_by_status: dict[str, int] = {}
    kills: list[str] = []
    """The workers killed, in order."""
    faults: dict[str, int] = {}
    """Faults injected by kind: prefill_mid_transfer (a prefill worker that died in the middle
    of a KV save), prefill_worker (killed plainly), decode_worker, store_mid_pull (a store node
    that died in the middle of a pull), store_node (killed plainly), redis."""
    hits: list[FaultHit] = []
    """Each fault, in order, and the requests in flight on its victim."""
    skipped_ticks: int = 0
    """Worker-kill ticks that injected nothing (no pool could spare an instance and the store
    nodes' schedule is off)."""
    store_nodes: int = 1
    """Store nodes of the cluster (2: prefill and decode pull between them)."""
    corrupt_kv: bool = False
    """A positive-control run (module docstring)."""
    pool_size: int = 0
    """Prompts in the reused pool (the fresh ones, sent once each, come after them)."""
    leaks: dict[str, int] = {}
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """A drill passes with nothing lost, wrong, leaked or failed otherwise; a positive
        control passes when it caught the corruption (``wrong`` > 0) and lost nothing."""
        if self.corrupt_kv:
            return self.wrong > 0 and self.lost == 0
        return (self.lost, self.wrong, self.leaked, self.failed_other) == (0, 0, 0, 0)


def prompt_pool(num_prompts: int, seed: int, block_tokens: int = 128) -> list[list[int]]:
    """Prompts in groups that share a two-block prefix (so the KV store and the index matter),
    each with its own tail."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 30_000) for _ in range(2 * block_tokens)] for _ in range(3)]
    return [prefixes[i % len(prefixes)] + [rng.randrange(100, 30_000) for _ in range(rng.randrange(8, 200))]
            for i in range(num_prompts)]


def fresh_prompts(pool: list[list[int]], num_prompts: int, seed: int,
                  block_tokens: int = 128) -> list[list[int]]:
    """Prompts sent once each: a pool prompt's shared prefix, then two blocks and a few tokens
    the store has never seen, so their prefill saves at least two new blocks."""
    rng = random.Random(seed + 7)
    return [pool[i % len(pool)][:2 * block_tokens]
            + [rng.randrange(100, 30_000) for _ in range(2 * block_tokens + rng.randrange(1, 64))]
            for i in range(num_prompts)]


async def reference_answers(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
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
                       rng: random.Random, report: ChaosReport, fresh: list[int]) -> None:
    """Requests back to back until ``deadline``: a pool prompt, or (``FRESH_SHARE`` of the time)
    the next of the fresh prompts, whose indices ``fresh`` holds (shared by every loop)."""
    while time.monotonic() < deadline:
        if fresh and rng.random() < FRESH_SHARE:
            i = fresh.pop()
        else:
            i = rng.randrange(report.pool_size)
        report.sent += 1
        try:
            result = await asyncio.wait_for(
                client.generate(server.target, token_ids=prompts[i], max_tokens=max_tokens,
                                timeout_s=CLIENT_TIMEOUT_S),
                CLIENT_TIMEOUT_S + 10)
        except client.GenerateFailed as exc:
            if exc.status == "DEADLINE_EXCEEDED":
                report.lost += 1
                continue
            report.failed_by_status[exc.status] = report.failed_by_status.get(exc.status, 0) + 1
            if exc.status in RETRYABLE and exc.retry_after_ms is not None:
                report.failed_clean += 1
            else:
                report.failed_other += 1
            continue
        except asyncio.TimeoutError:
            report.lost += 1
            continue
        if result["token_ids"] == references[i]:
            report.completed += 1
        else:
            report.wrong += 1


async def _in_flight(cluster, instance_ids: list[str]) -> dict[str, int]:
    """Requests running or waiting in each instance's engine (0 for one that does not answer)."""
    async def one(instance_id: str) -> int:
        try:
            stats = await asyncio.wait_for(cluster.actor(instance_id).stats.remote(), 5)
        except Exception:  # noqa: BLE001 - a dying instance has nothing in flight we can count
            return 0
        return stats.num_running_reqs + stats.num_waiting_reqs

    counts = await asyncio.gather(*(one(i) for i in instance_ids))
    return dict(zip(instance_ids, counts))


async def _cluster_in_flight(cluster) -> int:
    """Requests running or waiting on every engine of the cluster that is up."""
    busy = await _in_flight(cluster, [i for i in cluster.prefill_ids + cluster.decode_ids
                                      if i in cluster.engine_start_s])
    return sum(busy.values())


def _hit(report: ChaosReport, kind: str, victim: str, started: float, in_flight: int) -> None:
    report.faults[kind] = report.faults.get(kind, 0) + 1
    report.hits.append(FaultHit(kind, victim, round(time.monotonic() - started, 1), in_flight))


def fault_times(rng: random.Random, every_s: float, duration_s: float) -> list[float]:
    """Seconds into the load at which a fault schedule injects: each the previous plus a draw
    between half and one and a half ``every_s``, up to ``duration_s`` (none for ``every_s``
    0). Drawn up front, so the time a fault takes to inject (a victim's wait for its save or
    pull, a store node's replacement) never pushes the later ones back: a late one comes at
    once, and a run of S seconds gets about S / ``every_s``."""
    times: list[float] = []
    at = 0.0
    while every_s > 0:
        at += every_s * rng.uniform(0.5, 1.5)
        if at >= duration_s:
            break
        times.append(at)
    return times


async def _chaos_loop(server: BatonServer, started: float, deadline: float, kill_every_s: float,
                      store_fallback: bool, rng: random.Random, report: ChaosReport,
                      progress: Callable[[str], None], store_faults: asyncio.Lock) -> None:
    """About every ``kill_every_s``, kill a worker aimed at streams in flight, never the last
    live one of its pool, and start its replacement in the background (an engine takes a while
    to come up); the store node when no pool can spare one and ``store_fallback``."""
    cluster = server.cluster
    replacing: list[asyncio.Future] = []
    for at in fault_times(rng, kill_every_s, deadline - started):
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        up = [[i for i in ids if i in cluster.engine_start_s] for ids in (cluster.prefill_ids,
                                                                          cluster.decode_ids)]
        pools = [ids for ids in up if len(ids) >= 2]
        if not pools:
            if store_fallback:
                progress("no pool can spare a worker: killing a KV store node instead")
                await _store_fault(cluster, started, rng, report, progress, store_faults)
            else:
                report.skipped_ticks += 1
            continue
        pool = rng.choice(pools)
        busy = await _in_flight(cluster, pool)
        aimed = [i for i in pool if busy[i] > 0]
        victim = rng.choice(aimed or pool)
        report.kills.append(victim)
        actor = cluster.actor(victim)
        if victim in cluster.prefill_ids and await _died_when_told(
                actor.crash_mid_save.remote, actor.ready.remote, victim,
                "in the middle of its next KV save", progress):
            _hit(report, "prefill_mid_transfer", victim, started, 1)
        else:
            progress(f"killing {victim} ({busy[victim]} requests in flight on it)")
            kind = "prefill_worker" if victim in cluster.prefill_ids else "decode_worker"
            _hit(report, kind, victim, started, busy[victim])
            ray.kill(actor, no_restart=True)
        replacing.append(asyncio.ensure_future(asyncio.to_thread(cluster.replace_worker, victim)))
    for new_id in await asyncio.gather(*replacing):
        progress(f"{new_id} replaced a killed worker")


async def _died_when_told(arm: Callable[[], object], ping: Callable[[], object], victim: str,
                          moment: str, progress: Callable[[str], None],
                          window_s: float = ARM_WINDOW_S) -> bool:
    """Tell ``victim`` to die at ``moment`` (``arm``: its drill hook's ``remote``) and wait up
    to ``window_s`` for it to have done so: a call of ``ping`` (a cheap method's ``remote``)
    raises ``RayActorError``."""
    progress(f"telling {victim} to die {moment}")
    try:
        await arm()
    except ray.exceptions.RayActorError:
        # the hook took effect before its own reply left: a store node's block server, with a
        # stream under way on its other thread, reaches the moment and dies at once
        progress(f"{victim} died {moment}, before the call that told it returned")
        return True
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(ping(), 5)
        except ray.exceptions.RayActorError:
            progress(f"{victim} died {moment}")
            return True
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(0.1)
    progress(f"{victim} did not die {moment} within {window_s:.0f} s (no such moment came)")
    return False


async def _store_fault(cluster, started: float, rng: random.Random, report: ChaosReport,
                       progress: Callable[[str], None], one_at_a_time: asyncio.Lock) -> None:
    """Kill a store node drawn at random (mid-pull where the cluster has two), record the hit,
    and return once the cluster's watchdog has started a new one. ``one_at_a_time``: held
    throughout, so the next store fault (the worker-kill loop falls back to them too) draws
    its victim only once this one is replaced."""
    async with one_at_a_time:
        node_id = rng.choice(cluster.store_node_ids)
        old = cluster.stores[node_id]
        busy = await _cluster_in_flight(cluster)
        if cluster.store_nodes > 1 and await _died_when_told(
                old.crash_mid_pull.remote, old.arena_info.remote, f"the KV store node {node_id}",
                "in the middle of its next pull", progress):
            _hit(report, "store_mid_pull", f"store:{node_id}", started, busy)
        else:
            progress(f"killing the KV store node {node_id} ({busy} requests in flight)")
            _hit(report, "store_node", f"store:{node_id}", started, busy)
            ray.kill(old, no_restart=True)
        await asyncio.to_thread(_await_new_store, cluster, node_id, old, report.corrupt_kv)


def _await_new_store(cluster, node_id: str, old, corrupt: bool = False,
                     timeout_s: float = 120.0) -> None:
    """Return once the cluster's watchdog has replaced ``node_id``'s dead store actor ``old``
    (the new one told to corrupt what it stores, in a positive control)."""
    deadline = time.monotonic() + timeout_s
    while cluster.stores.get(node_id) is old:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no new store node {node_id} {timeout_s:.0f} s after the old "
                               "one was killed")
        time.sleep(0.1)
    if corrupt:
        ray.get(cluster.stores[node_id].corrupt_on_commit.remote(CORRUPT_EVERY_BLOCK))


async def _restart_redis(cluster, started: float, report: ChaosReport,
                         progress: Callable[[str], None]) -> None:
    """Stop Redis and start it again, empty, and record the hit."""
    busy = await _cluster_in_flight(cluster)
    progress(f"injecting a fault: redis ({busy} requests in flight)")
    _hit(report, "redis", "redis", started, busy)
    await asyncio.to_thread(cluster.restart_redis)


async def _fault_loop(kind: str, inject: Callable[[], Awaitable[None]], every_s: float,
                      started: float, deadline: float, rng: random.Random,
                      progress: Callable[[str], None]) -> None:
    """Inject one fault of ``kind`` (``inject`` returns once it is over: the store node or
    Redis back) at the ``fault_times`` of ``every_s``; a late one comes at once."""
    for at in fault_times(rng, every_s, deadline - started):
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        injected = time.monotonic()
        await inject()
        progress(f"{kind} back after {time.monotonic() - injected:.1f} s")


def with_transfer(config: ClusterConfig) -> ClusterConfig:
    """``config`` with a transfer engine for two local store nodes, where none is configured:
    TCP on loopback, not the shared-memory shortcut, so a pull is bytes on a socket."""
    if config.kvstore.transfer is not None:
        return config
    from kvstore.config import TransferConfig

    kvstore = config.kvstore.model_copy(
        update={"transfer": TransferConfig(backend="tcp", same_node_shared_memory=False)})
    return config.model_copy(update={"kvstore": kvstore})


def fresh_seed() -> int:
    """A seed for a run that was given none (printed, so the run replays)."""
    return random.SystemRandom().randrange(2**31)


async def run_chaos(config: ClusterConfig, duration_s: float, concurrency: int = 4,
                    kill_every_s: float = 10.0, max_tokens: int = 16, num_prompts: int = 12,
                    seed: int | None = None, progress: Callable[[str], None] = lambda _m: None,
                    kill_store_every_s: float = 20.0, restart_redis_every_s: float = 25.0,
                    corrupt_kv: bool = False, store_nodes: int = 2) -> ChaosReport:
    if seed is None:
        seed = fresh_seed()
    progress(f"seed {seed} (replay this run with --seed {seed})")
    config = with_transfer(config) if store_nodes > 1 else config
    server = BatonServer(config, progress=progress, store_nodes=store_nodes)
    await server.start()
    report = ChaosReport(seed=seed, corrupt_kv=corrupt_kv, store_nodes=store_nodes)
    try:
        prompts = prompt_pool(num_prompts, seed)
        report.pool_size = len(prompts)
        num_fresh = int(duration_s * 4) if kill_every_s > 0 else 0  # ~1/4 of ~15 requests/s
        prompts += fresh_prompts(prompts, num_fresh, seed)
        fresh = list(range(len(prompts) - 1, report.pool_size - 1, -1))  # popped in order
        progress(f"computing {len(prompts)} reference answers on a plain engine")
        references = await reference_answers(server.cluster.model, prompts, max_tokens)
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
        report.faults = {"prefill_mid_transfer": 0, "prefill_worker": 0, "decode_worker": 0,
                         "store_mid_pull": 0, "store_node": 0, "redis": 0}
        if corrupt_kv:
            progress("positive control: the store nodes corrupt every block committed from now")
            await asyncio.gather(*(store.corrupt_on_commit.remote(CORRUPT_EVERY_BLOCK)
                                   for store in cluster.stores.values()))
        rng = random.Random(seed)
        store_faults = asyncio.Lock()
        store_rng = random.Random(seed + 2)  # the store schedule's times and victims
        await _all_or_none(
            _chaos_loop(server, started, deadline, kill_every_s, kill_store_every_s > 0,
                        random.Random(seed + 1), report, progress, store_faults),
            _fault_loop("store_node", lambda: _store_fault(cluster, started, store_rng, report,
                                                           progress, store_faults),
                        kill_store_every_s, started, deadline, store_rng, progress),
            _fault_loop("redis", lambda: _restart_redis(cluster, started, report, progress),
                        restart_redis_every_s, started, deadline, random.Random(seed + 3),
                        progress),
            *(_client_loop(server, prompts, references, max_tokens, deadline,
                           random.Random(rng.random()), report, fresh) for _ in range(concurrency)),
        )
        report.duration_s = round(time.monotonic() - started, 1)
        report.retried = int(sum(r._value.get() for r in retries) - retried_before)
        report.leaks = await leaks(server)
        report.leaked = sum(report.leaks.values())
    finally:
        await server.stop()
    return report


async def _all_or_none(*coroutines) -> None:
    """Run ``coroutines`` together; when one raises, cancel the others and wait for them before
    raising it. (``asyncio.gather`` leaves them running: the cluster stopped under them, and a
    client loop's next Ray call then started a new, bare Ray in the process.)"""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def main(config: ClusterConfig, duration_s: float, concurrency: int, kill_every_s: float,
         json_path: Path | None, seed: int | None, progress: Callable[[str], None],
         kill_store_every_s: float = 20.0, restart_redis_every_s: float = 25.0,
         corrupt_kv: bool = False, store_nodes: int = 2) -> ChaosReport:
    report = asyncio.run(run_chaos(config, duration_s, concurrency, kill_every_s, seed=seed,
                                   progress=progress, kill_store_every_s=kill_store_every_s,
                                   restart_redis_every_s=restart_redis_every_s,
                                   corrupt_kv=corrupt_kv, store_nodes=store_nodes))
    data = msgspec.to_builtins(report)
    print(json.dumps({k: data[k] for k in ("seed", "sent", "completed", "retried", "failed_clean",
                                           "failed_other", "lost", "wrong", "leaked")}))
    hit = [f"{h.kind}@{h.at_s:.0f}s:{h.in_flight}" for h in report.hits]
    print(f"faults: {report.faults}; hits (kind@time:requests in flight): {', '.join(hit) or 'none'}; "
          f"skipped ticks: {report.skipped_ticks}; failed by status: {report.failed_by_status}; "
          f"leaks: {report.leaks}")
    if corrupt_kv:
        caught = "caught it" if report.wrong else "did NOT catch it: the wrong count is blind"
        print(f"positive control (corrupted KV): {report.wrong} wrong answers; the drill {caught}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2) + "\n")
    return report
