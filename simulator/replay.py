"""``baton bench replay``: every chosen policy tuned on one slice of a trace and raced on the
rest, on one fleet; its goodput found by sweeping the arrival rate to 2%; the trace's oracle
bound; the results written as JSON, a markdown table and plots."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

import msgspec

from conductor.cost_model import CostProfile
from conductor.policy import POLICIES
from protos.errors import BatonError
from simulator.fleet import FleetConfig
from simulator.metrics import PolicyResult, summarize
from simulator.oracle import OracleResult, oracle_bound
from simulator.sim import Simulation, Workload
from simulator.trace import load_trace
from simulator.tuning import TUNING_GRIDS, split_trace

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


GOODPUT_TOLERANCE = 0.02
"""The goodput search bisects until its bracket's ends are within this ratio of each other."""


class GoodputSearch(msgspec.Struct):
    goodput: float
    """The highest scale tried that passed (0.0: none did)."""
    upper: float | None
    """The lowest scale tried above it that failed (None: none failed)."""
    points: list[SweepPoint]


def find_goodput(attainment_at: Callable[[float], float], start: float = 1.0, max_doublings: int = 6,
                 tolerance: float = GOODPUT_TOLERANCE) -> GoodputSearch:
    """The highest rate scale with ``attainment_at(scale) >= GOODPUT_ATTAINMENT``, the bracket,
    and the points tried (in order). Doubles (or halves) from ``start`` until the answer is
    bracketed, at most ``max_doublings`` times, then bisects geometrically until ``upper /
    goodput <= 1 + tolerance`` (6 bisections from a factor of 2 for 2%). Goodput 0.0 (upper the
    smallest scale tried) when even ``start / 2^max_doublings`` fails; upper None when no scale
    tried fails."""
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
            return GoodputSearch(lo, None, points)
        hi = lo * 2
    else:
        hi = start
        for _ in range(max_doublings):
            if passes(hi / 2):
                break
            hi /= 2
        else:
            return GoodputSearch(0.0, hi, points)
        lo = hi / 2
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return GoodputSearch(lo, hi, points)


class PolicyRun(msgspec.Struct):
    """Everything one policy's runs produced that the report needs."""

    result: PolicyResult
    ttft_ms: list[float]
    """Per request at the main rate scale, rejected ones at the SLO bound (for the CDF)."""
    sweep: list[SweepPoint]
    wall_s: float
    cpu_s: float
    """CPU time of this policy's simulations (its process's, so independent of other load)."""
    tuned: dict[str, Any] = msgspec.field(default_factory=dict)
    """The knob values it ran with (``PolicyConfig`` fields; empty: defaults, or no knobs)."""


def with_knobs(fleet: FleetConfig, knobs: dict[str, Any]) -> FleetConfig:
    return fleet.model_copy(update={"policy_overrides": {**fleet.policy_overrides, **knobs}})


def run_policy(workload: Workload, fleet: FleetConfig, profile: CostProfile, profile_name: str,
               policy: str, rate_scale: float, sweep: bool,
               on_sim: Callable[[str], None] = lambda _: None,
               knobs: dict[str, Any] | None = None) -> PolicyRun:
    """One policy with ``knobs``: the main run at ``rate_scale``, then (with ``sweep``) its goodput."""
    started, started_cpu = time.perf_counter(), time.process_time()
    fleet = with_knobs(fleet, knobs or {})
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

        search = find_goodput(attainment_at)
        points = search.points
        result.goodput_rate_scale = search.goodput
        result.goodput_ci = (search.goodput, search.upper)
    ttft_ms = [float(t) if served else fleet.ttft_slo_ms for t, served in zip(main.ttft_ms, main.served)]
    return PolicyRun(result, ttft_ms, points, time.perf_counter() - started,
                     time.process_time() - started_cpu, dict(knobs or {}))


class Task(msgspec.Struct, frozen=True):
    """One policy's goodput search on one slice of the trace with one set of knobs."""

    policy: str
    knobs: dict[str, Any]
    slice: str
    """'tune' or 'race'."""


class Candidate(msgspec.Struct):
    knobs: dict[str, Any]
    goodput_rate_scale: float
    ttft_mean_ms: float


class Tuning(msgspec.Struct):
    """One policy's sweep on the tuning slice and the knobs it won with."""

    candidates: list[Candidate]
    best: dict[str, Any]


class ReplayOutcome(msgspec.Struct):
    runs: dict[str, PolicyRun]
    """Per policy, its race (tuned knobs) on the race slice."""
    tuning: dict[str, Tuning]
    oracle: OracleResult
    """The race slice's oracle bound."""
    num_tune_requests: int
    """0: no tuning, the race ran on the whole trace."""
    num_race_requests: int


_workloads: dict[str, Workload] = {}
"""The trace's slices by name, set before the worker processes fork (they inherit it)."""
_worker_progress = None


def _run_task(task: Task, fleet: FleetConfig, profile: CostProfile, profile_name: str, rate_scale: float,
              sweep: bool, on_sim: Callable[[str], None]) -> PolicyRun:
    return run_policy(_workloads[task.slice], fleet, profile, profile_name, task.policy, rate_scale, sweep,
                      on_sim, task.knobs)


def _run_in_worker(task: Task, fleet: FleetConfig, profile: CostProfile, profile_name: str,
                   rate_scale: float, sweep: bool) -> bytes:
    run = _run_task(task, fleet, profile, profile_name, rate_scale, sweep, on_sim=_worker_progress.put)
    return msgspec.msgpack.encode(run)


def _run_tasks(tasks: list[Task], fleet: FleetConfig, profile: CostProfile, profile_name: str,
               rate_scale: float, sweep: bool, jobs: int, on_sim: Callable[[str], None]) -> list[PolicyRun]:
    global _worker_progress
    if jobs <= 1 or len(tasks) == 1:
        return [_run_task(t, fleet, profile, profile_name, rate_scale, sweep, on_sim) for t in tasks]
    ctx = multiprocessing.get_context("fork")
    _worker_progress = progress_queue = ctx.SimpleQueue()
    # The slowest first, so the last one to start is a short one.
    slow = ("mooncake", "baton", "dynamo_kv", "sglang_cache_aware")
    order = sorted(range(len(tasks)), key=lambda k: (tasks[k].slice != "race",
                                                     slow.index(tasks[k].policy) if tasks[k].policy in slow else 9))
    runs: dict[int, PolicyRun] = {}
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=ctx) as pool:
        futures = {k: pool.submit(_run_in_worker, tasks[k], fleet, profile, profile_name, rate_scale, sweep)
                   for k in order}
        pending = set(futures)
        while pending:
            while not progress_queue.empty():
                on_sim(progress_queue.get())
            for k in [k for k in pending if futures[k].done()]:
                runs[k] = msgspec.msgpack.decode(futures[k].result(), type=PolicyRun)
                pending.discard(k)
            time.sleep(0.05)
        while not progress_queue.empty():
            on_sim(progress_queue.get())
    return [runs[k] for k in range(len(tasks))]


def estimated_sims(policy: str, sweep: bool, tune: bool) -> int:
    """Simulations one policy usually takes (each search: the main run, ~3 doublings, 6
    bisections; one search per tuning candidate, then the race)."""
    per_search = 10 if sweep else 1
    return per_search * (1 + (len(TUNING_GRIDS.get(policy, ())) if tune and sweep else 0))


def replay(trace_path: Path, fleet: FleetConfig, profile: CostProfile, profile_name: str,
           policies: list[str], rate_scale: float = 1.0, sweep: bool = True, jobs: int = 1,
           on_sim: Callable[[str], None] = lambda _: None, tune: bool = True,
           tune_fraction: float = 0.25) -> ReplayOutcome:
    """Tune every chosen policy with knobs on the first ``tune_fraction`` of the trace (with
    ``tune`` and ``sweep``; ``simulator.tuning``), then race each with its best knobs on the
    rest (or on the whole trace without tuning). ``jobs`` > 1 runs searches in that many
    processes. ``on_sim(policy)`` is called after every simulation (for a progress bar)."""
    global _workloads
    requests = load_trace(trace_path)
    tune = tune and sweep and len(requests) >= 8 and any(p in TUNING_GRIDS for p in policies)
    if tune:
        tune_requests, race_requests = split_trace(requests, tune_fraction)
        _workloads = {"tune": Workload(tune_requests, f"{trace_path}[tune]"),
                      "race": Workload(race_requests, f"{trace_path}[race]")}
    else:
        _workloads = {"race": Workload(requests, str(trace_path))}
    tuning: dict[str, Tuning] = {}
    best: dict[str, dict[str, Any]] = {p: {} for p in policies}
    if tune:
        tasks = [Task(p, knobs, "tune") for p in policies for knobs in TUNING_GRIDS.get(p, ())]
        for task, run in zip(tasks, _run_tasks(tasks, fleet, profile, profile_name, rate_scale, sweep, jobs,
                                               on_sim)):
            tuning.setdefault(task.policy, Tuning([], {})).candidates.append(
                Candidate(task.knobs, run.result.goodput_rate_scale or 0.0, run.result.ttft_ms.mean))
        for p, t in tuning.items():
            # highest goodput, then lowest mean TTFT; max keeps the first (the default) on ties
            winner = max(t.candidates, key=lambda c: (c.goodput_rate_scale, -c.ttft_mean_ms))
            t.best = best[p] = winner.knobs
    tasks = [Task(p, best[p], "race") for p in policies]
    runs = dict(zip(policies, _run_tasks(tasks, fleet, profile, profile_name, rate_scale, sweep, jobs, on_sim)))
    race = _workloads["race"]
    oracle = oracle_bound(race, fleet, profile)  # independent of any policy's knobs
    return ReplayOutcome(runs, tuning, oracle, len(_workloads.get("tune", ())), len(race))


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def ratio(value: float | None, bound: float) -> float | None:
    if value is None or bound in (0, math.inf):
        return None
    return value / bound


def write_results(out_dir: Path, outcome: ReplayOutcome, meta: dict) -> list[Path]:
    """``results.json`` (keyed by policy, plus ``"oracle"``), ``run.json`` (what was simulated),
    ``results.md`` and the plots; returns the files written."""
    from simulator.report import markdown_table, plot_goodput, plot_ttft_cdf

    out_dir.mkdir(parents=True, exist_ok=True)
    oracle = outcome.oracle
    results: dict[str, Any] = {}
    for p, run in outcome.runs.items():
        entry = msgspec.to_builtins(run.result)
        entry["goodput_sweep"] = msgspec.to_builtins(run.sweep)
        entry["tuned"] = run.tuned
        entry["ttft_mean_vs_oracle"] = ratio(run.result.ttft_ms.mean, oracle.ttft_ms.mean)
        entry["goodput_vs_oracle"] = ratio(run.result.goodput_rate_scale, oracle.goodput_rate_scale)
        if p in outcome.tuning:
            entry["tuning"] = msgspec.to_builtins(outcome.tuning[p].candidates)
        results[p] = entry
    results["oracle"] = msgspec.to_builtins(oracle) | {
        "goodput_rate_scale": None if math.isinf(oracle.goodput_rate_scale) else oracle.goodput_rate_scale}
    written = [out_dir / "results.json", out_dir / "run.json", out_dir / "results.md"]
    written[0].write_text(json.dumps(results, indent=2) + "\n")
    written[1].write_text(json.dumps(meta, indent=2, default=str) + "\n")
    written[2].write_text(markdown_table(outcome, meta))
    for plot in (plot_ttft_cdf(out_dir / "ttft_cdf.png", outcome.runs, meta),
                 plot_goodput(out_dir / "goodput.png", outcome.runs, meta)):
        if plot is not None:
            written.append(plot)
    return written
