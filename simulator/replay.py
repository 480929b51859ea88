"""``baton bench replay``: every chosen policy on one trace and one fleet, its goodput found by
sweeping the arrival rate, and the results written as JSON, a markdown table and plots."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import msgspec

from conductor.cost_model import CostProfile
from conductor.policy import POLICIES
from protos.errors import BatonError
from simulator.fleet import FleetConfig
from simulator.metrics import PolicyResult, summarize
from simulator.sim import Simulation, Workload
from simulator.trace import load_trace

GOODPUT_ATTAINMENT = 0.9
"""Goodput is the highest rate scale at which at least this share of requests meets both SLOs."""


class UnknownPolicy(BatonError):
    """--policy names a policy that does not exist."""


def parse_policies(spec: str) -> list[str]:
    """``all`` or a comma-separated list of names from ``conductor.policy.POLICIES``."""
    if spec.strip() == "all":
        return list(POLICIES)
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        raise UnknownPolicy(f"unknown policy {', '.join(unknown) or repr(spec)}; choose 'all' or any of "
                            f"{', '.join(POLICIES)}")
    return names


class SweepPoint(msgspec.Struct):
    rate_scale: float
    attainment_both: float


def find_goodput(attainment_at: Callable[[float], float], start: float = 1.0, max_doublings: int = 6,
                 num_bisections: int = 3) -> tuple[float, list[SweepPoint]]:
    """The highest rate scale with ``attainment_at(scale) >= GOODPUT_ATTAINMENT``, and the points
    tried (in order). Doubles (or halves) from ``start`` until the answer is bracketed, at most
    ``max_doublings`` times, then bisects the bracket geometrically ``num_bisections`` times,
    so the answer is within 2^(1/2^num_bisections) (9% for 3) below the true one. 0.0 when even
    ``start / 2^max_doublings`` fails; the largest scale tried when none fails."""
    points: list[SweepPoint] = []

    def passes(scale: float) -> bool:
        value = attainment_at(scale)
        points.append(SweepPoint(scale, value))
        return value >= GOODPUT_ATTAINMENT

    if passes(start):
        lo = start
        for _ in range(max_doublings):
            if not passes(lo * 2):
                break
            lo *= 2
        else:
            return lo, points
        hi = lo * 2
    else:
        hi = start
        for _ in range(max_doublings):
            if passes(hi / 2):
                break
            hi /= 2
        else:
            return 0.0, points
        lo = hi / 2
    for _ in range(num_bisections):
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, points


class PolicyRun(msgspec.Struct):
    """Everything one policy's runs produced that the report needs."""

    result: PolicyResult
    ttft_ms: list[float]
    """Per served request at the main rate scale (for the CDF)."""
    sweep: list[SweepPoint]
    wall_s: float
    cpu_s: float
    """CPU time of this policy's simulations (its process's, so independent of other load)."""


_worker_workload: Workload | None = None
_worker_progress = None


def _init_worker(trace_path: str, progress_queue) -> None:
    global _worker_workload, _worker_progress
    _worker_workload = Workload(load_trace(Path(trace_path)), trace_path)
    _worker_progress = progress_queue


def run_policy(workload: Workload, fleet: FleetConfig, profile: CostProfile, profile_name: str,
               policy: str, rate_scale: float, sweep: bool,
               on_sim: Callable[[str], None] = lambda _: None) -> PolicyRun:
    """One policy: the main run at ``rate_scale``, then (with ``sweep``) its goodput."""
    started, started_cpu = time.perf_counter(), time.process_time()
    by_scale: dict[float, PolicyResult] = {}

    def simulate(scale: float) -> Simulation:
        sim = Simulation(workload, fleet, profile, policy, scale, profile_name).run()
        by_scale[scale] = summarize(sim)
        on_sim(policy)
        return sim

    main = simulate(rate_scale)
    result = by_scale[rate_scale]
    points: list[SweepPoint] = []
    if sweep:
        def attainment_at(scale: float) -> float:
            if scale not in by_scale:
                simulate(scale)
            return by_scale[scale].slo_attainment.both

        goodput, points = find_goodput(attainment_at)
        result.goodput_rate_scale = goodput
    ttft_ms = [float(t) for t in main.ttft_ms[main.served]]
    return PolicyRun(result, ttft_ms, points, time.perf_counter() - started,
                     time.process_time() - started_cpu)


def _run_in_worker(fleet: FleetConfig, profile: CostProfile, profile_name: str, policy: str,
                   rate_scale: float, sweep: bool) -> bytes:
    assert _worker_workload is not None
    run = run_policy(_worker_workload, fleet, profile, profile_name, policy, rate_scale, sweep,
                     on_sim=_worker_progress.put)
    return msgspec.msgpack.encode(run)


def estimated_sims(sweep: bool) -> int:
    """Simulations one policy usually takes (main run, ~3 doublings, 3 bisections)."""
    return 7 if sweep else 1


def replay(trace_path: Path, fleet: FleetConfig, profile: CostProfile, profile_name: str,
           policies: list[str], rate_scale: float = 1.0, sweep: bool = True, jobs: int = 1,
           on_sim: Callable[[str], None] = lambda _: None) -> dict[str, PolicyRun]:
    """Run every policy; ``jobs`` > 1 runs policies in that many processes. ``on_sim(policy)``
    is called after every simulation (for a progress bar)."""
    if jobs <= 1 or len(policies) == 1:
        workload = Workload(load_trace(trace_path), str(trace_path))
        return {p: run_policy(workload, fleet, profile, profile_name, p, rate_scale, sweep, on_sim)
                for p in policies}
    load_trace(trace_path)  # fail here, with the file's own message, not in a worker
    ctx = multiprocessing.get_context("fork")
    progress_queue = ctx.SimpleQueue()
    runs: dict[str, PolicyRun] = {}
    # The slowest policies first, so the last one to start is a short one.
    order = sorted(policies, key=lambda p: ("mooncake", "baton", "dynamo_kv").index(p)
                   if p in ("mooncake", "baton", "dynamo_kv") else 3)
    with ProcessPoolExecutor(min(jobs, len(policies)), mp_context=ctx, initializer=_init_worker,
                             initargs=(str(trace_path), progress_queue)) as pool:
        futures = {p: pool.submit(_run_in_worker, fleet, profile, profile_name, p, rate_scale, sweep)
                   for p in order}
        pending = set(futures)
        while pending:
            while not progress_queue.empty():
                on_sim(progress_queue.get())
            for p in [p for p in pending if futures[p].done()]:
                runs[p] = msgspec.msgpack.decode(futures[p].result(), type=PolicyRun)
                pending.discard(p)
            time.sleep(0.05)
        while not progress_queue.empty():
            on_sim(progress_queue.get())
    return {p: runs[p] for p in policies}


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def write_results(out_dir: Path, runs: dict[str, PolicyRun], meta: dict) -> list[Path]:
    """``results.json`` (keyed by policy), ``run.json`` (what was simulated), ``results.md`` and
    the plots; returns the files written."""
    from simulator.report import markdown_table, plot_goodput, plot_ttft_cdf

    out_dir.mkdir(parents=True, exist_ok=True)
    results = {p: msgspec.to_builtins(run.result) | {"goodput_sweep": msgspec.to_builtins(run.sweep)}
               for p, run in runs.items()}
    written = [out_dir / "results.json", out_dir / "run.json", out_dir / "results.md"]
    written[0].write_text(json.dumps(results, indent=2) + "\n")
    written[1].write_text(json.dumps(meta, indent=2, default=str) + "\n")
    written[2].write_text(markdown_table(runs, meta))
    for plot in (plot_ttft_cdf(out_dir / "ttft_cdf.png", runs, meta),
                 plot_goodput(out_dir / "goodput.png", runs, meta)):
        if plot is not None:
            written.append(plot)
    return written
