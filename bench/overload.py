"""``baton bench overload``: a live cluster with admission on, driven past what it can serve.

Starts a whole local cluster (as ``baton serve`` does) with named SLOs (``ttft_slo_ms``,
``tbt_slo_ms``: the conductor rejects a request predicted to miss either, before any prefill),
then:

1. finds the **sustainable rate** by bisection: the highest open-loop (Poisson) arrival rate at
   which a probe of ``probe_s`` seconds sees no rejection and at least ``MIN_ATTAINMENT`` of the
   requests meet both SLOs;
2. drives the cluster at each ``factor`` times that rate (3x and 10x by default) for ``burst_s``
   seconds. What must hold: the admitted requests keep meeting their SLOs (at least
   ``MIN_ATTAINMENT``), every other request is RESOURCE_EXHAUSTED with the gateway's retry hint,
   no other status, no worker dies, memory stays bounded (``peak_rss_mb``: every process of the
   cluster, sampled);
3. measures **recovery** from the last burst: the seconds from its last arrival (while its
   admitted requests are still answering) until three probe requests in a row, sent one after
   the other, are admitted with a TTFT within ``RECOVERED_TTFT_FACTOR`` of the sustainable
   run's median.

The clients run in a process of their own (``ClientProcess``), as a fleet's clients do: in the
cluster's own process they shared the gateway's event loop and interpreter lock, so at 10x the
load generator's own work delayed the admitted requests' tokens inside the gateway, and their
measured TTFT with them. The two still share this machine's cores.

A request meets its SLOs when its TTFT (gateway receipt to first token) is within
``ttft_slo_ms`` and its mean inter-token time ((end-to-end - TTFT) / (tokens - 1)) within
``tbt_slo_ms``. Requests go over gRPC on one channel; each asks ``max_tokens`` tokens of a prompt
from an agent-like pool (shared system prefixes, own tails), greedy.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import grpc
import msgspec

from bench.stats import percentile
from cluster.config import ClusterConfig
from cluster.serve import BatonServer
from gateway.client import build_request
from protos.baton.v1 import inference_pb2_grpc as pb_grpc

MIN_ATTAINMENT = 0.9
RECOVERED_TTFT_FACTOR = 1.5
RECOVERY_LIMIT_S = 60.0


class Outcome(msgspec.Struct):
    status: str
    """OK, RESOURCE_EXHAUSTED (with a retry hint), or any other status name."""
    ttft_ms: float = 0.0
    tbt_ms: float = 0.0


class Run(msgspec.Struct):
    factor: float
    rate_rps: float
    duration_s: float
    sent: int
    admitted: int
    rejected: int
    """RESOURCE_EXHAUSTED with a retry hint."""
    other_errors: int
    other_statuses: dict[str, int]
    slo_attainment_admitted: float
    """Admitted requests that met both SLOs, as a fraction of the admitted."""
    ttft_attainment_admitted: float
    tbt_attainment_admitted: float
    p50_ttft_ms_admitted: float
    p99_ttft_ms_admitted: float
    p99_tbt_ms_admitted: float
    peak_rss_mb: float


class OverloadReport(msgspec.Struct):
    model: str
    ttft_slo_ms: float
    tbt_slo_ms: float
    max_tokens: int
    sustainable_rps: float
    probes: list[Run]
    """The bisection's probes, in order."""
    runs: list[Run]
    """The bursts at each factor."""
    recovery_s: float | None
    """None: not recovered within ``RECOVERY_LIMIT_S``."""
    workers_died: int
    ok: bool


def prompts(seed: int, count: int = 32) -> list[list[int]]:
    """Agent-like prompts: four shared 200-token prefixes, each prompt with its own tail."""
    rng = random.Random(seed)
    trunks = [[rng.randrange(100, 30_000) for _ in range(200)] for _ in range(4)]
    return [trunks[i % 4] + [rng.randrange(100, 30_000) for _ in range(rng.randrange(20, 120))]
            for i in range(count)]



async def _one(stub, prompt: list[int], max_tokens: int) -> Outcome:
    request = build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0)
    final = None
    try:
        async for response in stub.Generate(request, timeout=120):
            if response.HasField("final"):
                final = response.final
    except grpc.aio.AioRpcError as e:
        hint = dict(e.trailing_metadata() or ()).get("retry-after-ms")
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return Outcome("RESOURCE_EXHAUSTED" if hint is not None
                           else "RESOURCE_EXHAUSTED (no retry hint)")
        return Outcome(e.code().name if hint is None else f"{e.code().name} (retry hint)")
    if final is None:
        return Outcome("NO_FINAL")
    usage = final.usage
    tbt = ((usage.e2e_ms - usage.ttft_ms) / (usage.completion_tokens - 1)
           if usage.completion_tokens > 1 else 0.0)
    return Outcome("OK", usage.ttft_ms, tbt)


class _Rss:
    """The peak resident memory of this process and its descendants (the cluster), sampled."""

    def __init__(self, exclude_pids: frozenset[int] = frozenset()) -> None:
        import psutil

        self._root = psutil.Process()
        self._exclude = exclude_pids
        self.peak_mb = 0.0

    def sample(self) -> None:
        import psutil

        total = 0
        for process in [self._root, *self._root.children(recursive=True)]:
            if process.pid in self._exclude:  # the load generator is not the cluster
                continue
            try:
                total += process.memory_info().rss
            except psutil.Error:
                continue
        self.peak_mb = max(self.peak_mb, total / 2**20)


async def drive(stub, pool: list[list[int]], rate_rps: float, duration_s: float, max_tokens: int,
                rng: random.Random, ttft_slo_ms: float, tbt_slo_ms: float,
                factor: float = 1.0, after_arrivals=None, peak_rss_mb: float = 0.0) -> Run:
    """Open-loop Poisson arrivals at ``rate_rps`` for ``duration_s``; waits for every request.
    ``after_arrivals`` (a coroutine function) starts when the last request is sent, while the
    rest are still answering, and is awaited too (the recovery probe). ``peak_rss_mb``: what
    the cluster's sampler saw (``ClientProcess.drive`` fills it in)."""
    tasks: list[asyncio.Task] = []
    started = time.monotonic()
    next_at = started
    while True:
        next_at += rng.expovariate(rate_rps)
        if next_at - started >= duration_s:
            break
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks.append(asyncio.ensure_future(_one(stub, rng.choice(pool), max_tokens)))
    follow_up = asyncio.ensure_future(after_arrivals()) if after_arrivals is not None else None
    outcomes = await asyncio.gather(*tasks)
    if follow_up is not None:
        await follow_up
    admitted = [o for o in outcomes if o.status == "OK"]
    others: dict[str, int] = {}
    for o in outcomes:
        if o.status not in ("OK", "RESOURCE_EXHAUSTED"):
            others[o.status] = others.get(o.status, 0) + 1
    met = [o for o in admitted if o.ttft_ms <= ttft_slo_ms and o.tbt_ms <= tbt_slo_ms]
    ttfts = [o.ttft_ms for o in admitted]

    def share(count: int) -> float:
        return round(count / len(admitted), 3) if admitted else 0.0

    return Run(
        factor=factor, rate_rps=round(rate_rps, 3), duration_s=duration_s, sent=len(outcomes),
        admitted=len(admitted), rejected=sum(o.status == "RESOURCE_EXHAUSTED" for o in outcomes),
        other_errors=sum(others.values()), other_statuses=others,
        slo_attainment_admitted=share(len(met)),
        ttft_attainment_admitted=share(sum(o.ttft_ms <= ttft_slo_ms for o in admitted)),
        tbt_attainment_admitted=share(sum(o.tbt_ms <= tbt_slo_ms for o in admitted)),
        p50_ttft_ms_admitted=round(percentile(ttfts, 0.5), 1),
        p99_ttft_ms_admitted=round(percentile(ttfts, 0.99), 1),
        p99_tbt_ms_admitted=round(percentile([o.tbt_ms for o in admitted], 0.99), 1),
        peak_rss_mb=round(peak_rss_mb, 1),
    )


class DriveOrder(msgspec.Struct, frozen=True):
    """One ``drive`` for the client process: everything it needs, picklable."""

    target: str
    pool: list[list[int]]
    rate_rps: float
    duration_s: float
    max_tokens: int
    seed: float
    """Seeds the arrivals and prompt choices (drawn from the parent's RNG: the run replays)."""
    ttft_slo_ms: float
    tbt_slo_ms: float
    factor: float = 1.0
    recovery_normal_ttft_ms: float | None = None
    """Set: measure the recovery after the last arrival (``_recovery_s``) against this TTFT."""
    recovery_seed: int = 0


def _drive_in_process(order: DriveOrder) -> tuple[Run, float | None]:
    """The client process's side: its own event loop and gRPC channel."""

    async def go() -> tuple[Run, float | None]:
        recovered: list[float | None] = []
        async with grpc.aio.insecure_channel(order.target) as channel:
            stub = pb_grpc.InferenceStub(channel)

            async def recovery_probe() -> None:
                recovered.append(await _recovery_s(stub, order.pool, order.max_tokens,
                                                   order.recovery_normal_ttft_ms,
                                                   random.Random(order.recovery_seed)))

            run = await drive(stub, order.pool, order.rate_rps, order.duration_s,
                              order.max_tokens, random.Random(order.seed), order.ttft_slo_ms,
                              order.tbt_slo_ms, order.factor,
                              after_arrivals=(recovery_probe if order.recovery_normal_ttft_ms
                                              is not None else None))
        return run, (recovered[0] if recovered else None)

    return asyncio.run(go())


class ClientProcess:
    """The load generator in a process of its own (module docstring), reused for every drive;
    the cluster's peak RSS is sampled here, in the cluster's process, while it drives."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._executor = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self._pid: int | None = None

    async def drive(self, order: DriveOrder) -> tuple[Run, float | None]:
        loop = asyncio.get_running_loop()
        if self._pid is None:
            self._pid = await loop.run_in_executor(self._executor, os.getpid)
        rss = _Rss(frozenset({self._pid}))
        done = loop.run_in_executor(self._executor, _drive_in_process, order)
        while not done.done():
            rss.sample()
            await asyncio.wait({done}, timeout=1.0)
        rss.sample()
        run, recovery_s = await done
        return msgspec.structs.replace(run, peak_rss_mb=round(rss.peak_mb, 1)), recovery_s

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def sustains(run: Run) -> bool:
    return run.rejected == 0 and run.other_errors == 0 and run.admitted > 0 and (
        run.slo_attainment_admitted >= MIN_ATTAINMENT)


async def _recovery_s(stub, pool, max_tokens: int, normal_ttft_ms: float,
                      rng: random.Random) -> float | None:
    """Seconds until three probes in a row are admitted with a TTFT within
    ``RECOVERED_TTFT_FACTOR`` of normal (the time of the first of the three)."""
    started = time.monotonic()
    streak_started = None
    streak = 0
    while time.monotonic() - started < RECOVERY_LIMIT_S:
        probe_at = time.monotonic() - started
        outcome = await _one(stub, rng.choice(pool), max_tokens)
        if outcome.status == "OK" and outcome.ttft_ms <= RECOVERED_TTFT_FACTOR * normal_ttft_ms:
            streak_started = probe_at if streak == 0 else streak_started
            streak += 1
            if streak == 3:
                return round(streak_started, 2)
        else:
            streak = 0
        await asyncio.sleep(0.2)
    return None


async def _live_workers(server: BatonServer) -> int:
    cluster = server.cluster
    alive = 0
    for instance_id in cluster.prefill_ids + cluster.decode_ids:
        try:
            await asyncio.wait_for(cluster.actor(instance_id).stats.remote(), 10)
            alive += 1
        except Exception:  # noqa: BLE001 - a dead actor raises; it is what we count
            pass
    return alive


async def run_overload(config: ClusterConfig, factors: tuple[float, ...] = (3.0, 10.0),
                       probe_s: float = 15.0, burst_s: float = 30.0, max_tokens: int = 16,
                       start_rps: float = 1.0, bisect_steps: int = 4, seed: int = 0,
                       progress: Callable[[str], None] = lambda _m: None) -> OverloadReport:
    tuning = config.conductor.tuning
    ttft_slo_ms, tbt_slo_ms = tuning.ttft_slo_ms, tuning.tbt_slo_ms
    assert ttft_slo_ms is not None and tbt_slo_ms is not None, "admission needs both SLOs set"
    progress(f"SLOs: TTFT {ttft_slo_ms:g} ms, inter-token {tbt_slo_ms:g} ms (admission on); "
             f"{max_tokens} tokens a request")
    server = BatonServer(config, progress=progress)
    await server.start()
    rng = random.Random(seed)
    pool = prompts(seed)
    probes: list[Run] = []
    clients = ClientProcess(server.target)
    try:
        workers = len(server.cluster.prefill_ids) + len(server.cluster.decode_ids)

        def order(rate: float, duration_s: float, factor: float = 1.0,
                  recovery_normal_ttft_ms: float | None = None) -> DriveOrder:
            return DriveOrder(server.target, pool, rate, duration_s, max_tokens, rng.random(),
                              ttft_slo_ms, tbt_slo_ms, factor, recovery_normal_ttft_ms, seed)

        await clients.drive(order(1.0, 5.0))  # warm-up (and the client process's start)

        async def probe(rate: float) -> Run:
            run, _ = await clients.drive(order(rate, probe_s))
            probes.append(run)
            progress(f"probe {rate:.2f} req/s: {run.admitted} admitted, {run.rejected} "
                     f"rejected, SLO attainment {run.slo_attainment_admitted:.0%} -> "
                     f"{'sustained' if sustains(run) else 'not sustained'}")
            return run

        low, high = 0.0, start_rps
        while sustains(await probe(high)):
            low, high = high, high * 2
        for _ in range(bisect_steps):
            middle = (low + high) / 2
            low, high = (middle, high) if sustains(await probe(middle)) else (low, middle)
        if low == 0.0:
            raise RuntimeError(f"no rate down to {high:.2f} req/s meets the SLOs; raise them")
        sustainable = low
        normal = await probe(sustainable)
        progress(f"sustainable: {sustainable:.2f} req/s (TTFT p50 "
                 f"{normal.p50_ttft_ms_admitted:.0f} ms)")
        runs = []
        recovery = None
        for number, factor in enumerate(factors):
            last = number == len(factors) - 1
            run, recovered = await clients.drive(order(
                factor * sustainable, burst_s, factor,
                normal.p50_ttft_ms_admitted if last else None))
            runs.append(run)
            recovery = recovered if last else recovery
            progress(f"{factor:g}x ({run.rate_rps:.1f} req/s): {run.admitted} admitted "
                     f"({run.slo_attainment_admitted:.0%} within both SLOs: TTFT "
                     f"{run.ttft_attainment_admitted:.0%}, inter-token "
                     f"{run.tbt_attainment_admitted:.0%}; TTFT p99 "
                     f"{run.p99_ttft_ms_admitted:.0f} ms), {run.rejected} rejected with a "
                     f"retry hint, {run.other_errors} other errors; peak RSS "
                     f"{run.peak_rss_mb:,.0f} MB")
        progress(f"recovered in {recovery} s" if recovery is not None
                 else f"not recovered within {RECOVERY_LIMIT_S:.0f} s")
        died = workers - await _live_workers(server)
    finally:
        clients.close()
        await server.stop()
    ok = (died == 0 and recovery is not None and recovery <= 10.0 and all(
        r.other_errors == 0 and r.slo_attainment_admitted >= MIN_ATTAINMENT for r in runs))
    return OverloadReport(config.engine.model, ttft_slo_ms, tbt_slo_ms, max_tokens,
                          round(sustainable, 3), probes, runs, recovery, died, ok)


def main(config: ClusterConfig, json_path: Path | None, factors: tuple[float, ...],
         probe_s: float, burst_s: float, max_tokens: int, seed: int,
         progress: Callable[[str], None]) -> OverloadReport:
    report = asyncio.run(run_overload(config, factors, probe_s, burst_s, max_tokens, seed=seed,
                                      progress=progress))
    data = msgspec.to_builtins(report)
    print(json.dumps({"sustainable_rps": report.sustainable_rps, "recovery_s": report.recovery_s,
                      "ok": report.ok, "runs": [{k: r[k] for k in (
                          "factor", "admitted", "rejected", "other_errors",
                          "slo_attainment_admitted", "ttft_attainment_admitted",
                          "tbt_attainment_admitted", "p99_ttft_ms_admitted",
                          "p99_tbt_ms_admitted", "peak_rss_mb")}
                          for r in data["runs"]]}, indent=1))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2) + "\n")
    return report
