"""``baton bench peers``: Baton against what a user would pick instead, on the same cores.

Starts the stacks of ``bench.peers_stacks`` one after another on this machine (SMG
``cache_aware`` and ``round_robin`` over two co-located vLLM servers, ``baton serve --prefill
1 --decode 1``, ``baton serve --prefill 0 --decode 2``), runs the same seeded workloads of
``bench.peers_workloads`` against each over the OpenAI API, and repeats: run r starts the stacks
in an order rotated by r (interleaved, so drift on a shared box hits every stack alike), each
stack fresh (cold caches) in every run. Decides on medians over runs, with min and max shown;
the ratios are Baton's medians over the better SMG policy's (by median TTFT mean) per workload.

Before the race each SMG stack is tuned (``tune``, on unless ``PeersOptions.tune`` is off): it
runs once per setting of ``bench.peers_stacks.tuning_variants`` (its router's policy settings
times vLLM's ``--max-num-batched-tokens``) on a tuning set, the same workloads drawn from
another seed (``seed + TUNE_SEED_OFFSET``), and races with the setting whose TTFT mean was the
least (the geometric mean over the workloads). Baton's stacks race as ``baton serve`` ships.

Writes ``peers.json`` (every run's report, the medians, the ratios), ``peers.md`` (the table),
``peers.png`` (when matplotlib is installed) and ``records.jsonl`` (every request, with Baton's
placement and reason) to ``out_dir``. Not run in CI: it needs several minutes of both cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from bench import peers_cpu
from bench.peers_client import run_workload, send_one, summarise
from bench.peers_stacks import (
    ABLATION_STACKS,
    DEFAULT_STACKS,
    PeersError,
    Stack,
    StackSpec,
    tuning_variants,
)
from bench.peers_workloads import (
    AgentFleetOptions,
    PeerRequest,
    PrivatePrefixOptions,
    TraceSliceOptions,
    Workload,
    agent_fleet_workload,
    ceiling_hit_ratio,
    mooncake_slice_workload,
    private_prefix_workload,
)
from bench.stall_probe import STALL_MS, HostStallProbe, sched_autogroup
from engine.config import CPU_KV_BLOCK_TOKENS

WORKLOADS = ("private_prefix", "agent_fleet", "mooncake_slice")
"""Every workload ``build_workloads`` knows."""
DEFAULT_WORKLOADS = ("private_prefix", "agent_fleet")
"""What a run races unless told: the trace slice adds ~40 s per stack and run (~8 min to the
default three runs of four stacks), so it is asked for by name."""

DECIDING_METRICS = (
    "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms",
    "request_throughput", "output_throughput", "total_token_throughput", "duration",
    "hit_ratio", "hit_ratio_vs_ceiling", "completed", "failed",
)
RATIO_METRICS = ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "mean_e2el_ms",
                 "output_throughput", "hit_ratio")


class PeersOptions(msgspec.Struct, frozen=True):
    runs: int = 3
    stacks: tuple[str, ...] = tuple(s.name for s in DEFAULT_STACKS)
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    private: PrivatePrefixOptions = PrivatePrefixOptions()
    fleet: AgentFleetOptions = AgentFleetOptions()
    trace: TraceSliceOptions = TraceSliceOptions()
    model: str = "smollm2"
    block_tokens: int = CPU_KV_BLOCK_TOKENS
    """The engines' KV block, for the ceiling: Baton's CPU engines' and, with the same engine
    arguments, SMG's servers' (``EngineConfig.kv_block_tokens``; vLLM-CPU's own is 128). A
    ``-block128`` ablation stack's hits are held to this finer ceiling too."""
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    base_port: int = 8100
    vllm_omp_bind: str = "auto"
    """SMG's vLLM servers' VLLM_CPU_OMP_THREADS_BIND: 'auto' (one core each, as Baton) or a
    value for all (e.g. 'nobind')."""
    tune: bool = True
    """Tune each SMG stack on the tuning set before the race (module docstring)."""
    tuned_from: str | None = None
    """A previous run's ``peers.json``: each SMG stack races with the setting its tuning chose
    there, and this run does not tune (``reuse_tuning``)."""
    seed_per_run: bool = False
    """Run k draws every workload from the seed plus k (all stacks of a run get the same
    draw): the medians are over workload draws, not only over one draw's timing. In a closed
    loop the think times decide how many agents' steps arrive together, and one seed's bursts
    decided the fleet's figure (``docs/benchmarks.md``)."""


def run_options(options: PeersOptions, run: int) -> PeersOptions:
    """The options run ``run`` draws its workloads from (``PeersOptions.seed_per_run``)."""
    return reseeded(options, run) if options.seed_per_run else options


def reseeded(options: PeersOptions, offset: int) -> PeersOptions:
    """``options`` with every workload's seed moved by ``offset``."""
    if not offset:
        return options

    def reseed(o):
        return msgspec.structs.replace(o, seed=o.seed + offset)

    return msgspec.structs.replace(options, private=reseed(options.private),
                                   fleet=reseed(options.fleet), trace=reseed(options.trace))


TUNE_SEED_OFFSET = 1000
"""The tuning set's seed is the race's plus this: the same kind of traffic, other prompts."""


def tuning_options(options: PeersOptions) -> PeersOptions:
    """The race's options with every workload drawn from the tuning seed."""
    return reseeded(options, TUNE_SEED_OFFSET)


def tuning_score(reports: Sequence[dict[str, Any]]) -> float:
    """One setting's score on the tuning set: the geometric mean over workloads of its TTFT
    mean (less is better); infinite when a workload had failures or no TTFT."""
    values = [r.get("mean_ttft_ms") for r in reports]
    if (not values or any(v is None or v <= 0 for v in values)
            or any(r.get("failed") for r in reports)):
        return float("inf")
    return float(np.exp(np.mean(np.log(values))))


def best_variant(scores: dict[str, float]) -> str:
    """The setting with the least score (the first listed among equals)."""
    return min(scores, key=scores.__getitem__)


def build_workloads(options: PeersOptions) -> dict[str, Workload]:
    makers = {"private_prefix": lambda: private_prefix_workload(options.private),
              "agent_fleet": lambda: agent_fleet_workload(options.fleet),
              "mooncake_slice": lambda: mooncake_slice_workload(options.trace)}
    assert set(makers) == set(WORKLOADS)
    unknown = set(options.workloads) - set(makers)
    if unknown:
        raise PeersError(f"unknown workload(s) {sorted(unknown)}; choose from {', '.join(makers)}")
    return {name: makers[name]() for name in options.workloads}


def stack_specs(names: Sequence[str]) -> list[StackSpec]:
    by_name = {s.name: s for s in (*DEFAULT_STACKS, *ABLATION_STACKS)}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise PeersError(f"unknown stack(s) {unknown}; choose from {', '.join(by_name)}")
    return [by_name[n] for n in names]


def run_order(names: Sequence[str], run: int) -> list[str]:
    """Run ``run``'s stack order: the list rotated by ``run``."""
    k = run % len(names)
    return list(names[k:]) + list(names[:k])


def median_table(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per metric: the median over runs, and min and max (the spread)."""
    out: dict[str, dict[str, float | None]] = {}
    for key in DECIDING_METRICS:
        values = [r[key] for r in reports if r.get(key) is not None]
        out[key] = ({"median": float(np.median(values)), "min": float(min(values)),
                     "max": float(max(values))} if values else
                    {"median": None, "min": None, "max": None})
    return out


def ratios_vs_best_smg(medians: dict[str, dict[str, dict]]) -> dict[str, Any]:
    """For one workload's ``{stack: median_table}``: the better SMG policy (least median TTFT
    mean) and every stack's ratio of medians against it (TTFT, TPOT, E2EL: < 1 is better;
    throughput and hit ratio: > 1 is better)."""
    smg = {n: m for n, m in medians.items() if n.startswith("smg-")
           and m["mean_ttft_ms"]["median"] is not None}
    if not smg:
        return {"best_smg": None, "ratios": {}}
    best = min(smg, key=lambda n: smg[n]["mean_ttft_ms"]["median"])
    ratios = {}
    for name, table in medians.items():
        ratios[name] = {}
        for key in RATIO_METRICS:
            ours, theirs = table[key]["median"], smg[best][key]["median"]
            ratios[name][key] = ours / theirs if ours is not None and theirs else None
    return {"best_smg": best, "ratios": ratios}


PAIRED_METRICS = ("mean_ttft_ms", "p90_ttft_ms", "output_throughput")
"""The figures ``paired_ratios`` gives run by run."""


def paired_ratios(runs: Sequence[dict[str, Any]], stack: str, best: str) -> dict[str, list[float]]:
    """``stack``'s figures against ``best``'s in the same run, run by run (the runs both
    finished, in run order): with ``--seed-per-run`` each pair shares one draw, so the spread of
    these ratios is the spread over draws, where medians taken apart can pair different runs."""
    by_run = {(r["stack"], r["run"]): r for r in runs}
    pairs = [(by_run[(stack, k)], by_run[(best, k)]) for k in sorted({r["run"] for r in runs})
             if (stack, k) in by_run and (best, k) in by_run]
    return {key: [round(ours[key] / theirs[key], 3) for ours, theirs in pairs
                  if ours.get(key) is not None and theirs.get(key)]
            for key in PAIRED_METRICS}


WARM_WORDS = 1500
"""Words (~tokens) of each engine's long warm-up prompt: a fresh engine's first long prefill is
slow (2.2 s where a warm one takes 0.9 s on vLLM-CPU, SmolLM2), and no stack's first measured
request should pay it. Baton's engines also warm themselves (``engine.warm_up``); SMG's vLLM
servers, as shipped, do not, so the harness does it for every stack alike."""


async def _warm(stack: Stack, timeout_s: float) -> None:
    """Per engine, one long prompt of random words (shared with nothing in the workloads) and
    one short request, so no stack's first measured request pays a cold engine's first steps.
    SMG's servers are warmed directly, so the router's tree learns nothing from it."""
    import random

    import httpx

    from bench.peers_workloads import words_text

    rng = random.Random(-1)
    async with httpx.AsyncClient() as client:
        for i, url in enumerate(stack.warm_urls()):
            for j, prompt in enumerate((f"Warm up {i}: {words_text(rng, WARM_WORDS)}",
                                        f"Warm up {i}: hello there.")):
                request = PeerRequest(f"warm-{i}-{j}", -1, 0, prompt, 4)
                await send_one(client, url + "/v1/completions", stack.model.name, request, timeout_s)


def run_peers(options: PeersOptions, out_dir: Path,
              echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run, every stack, every workload; writes the outputs; returns the report."""
    from transformers import AutoTokenizer

    from engine.models import prepare_model

    if options.runs < 1:
        raise PeersError("--runs must be at least 1")
    # SIGTERM (a `timeout` around the run) unwinds the stacks' context managers: no orphans.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    specs = stack_specs(options.stacks)
    model = prepare_model(options.model, progress=echo)
    tokenizer = AutoTokenizer.from_pretrained(str(model.path))
    draws = []  # per run: (workloads, ceilings); one draw unless seed_per_run
    for run in range(options.runs if options.seed_per_run else 1):
        workloads = build_workloads(run_options(options, run))
        ceilings = {name: ceiling_hit_ratio(w.requests(), lambda t: tokenizer(t)["input_ids"],
                                            options.block_tokens)
                    for name, w in workloads.items()}
        where = f"run {run + 1}, seed +{run}: " if options.seed_per_run else ""
        for name, ceiling in ceilings.items():
            echo(f"{where}{name}: {len(workloads[name].requests())} requests, "
                 f"{ceiling.prompt_tokens} prompt tokens, ceiling hit ratio {ceiling.hit_ratio:.3f}")
        draws.append((workloads, ceilings))
    out_dir.mkdir(parents=True, exist_ok=True)
    tuning: dict[str, Any] = {}
    if options.tuned_from and any(s.kind == "smg" for s in specs):
        specs, tuning = reuse_tuning(specs, Path(options.tuned_from))
        echo(f"SMG settings from the tuning of {options.tuned_from}: " + ", ".join(
            f"{s.name} races with {s.variant}" for s in specs if s.kind == "smg"))
    elif options.tune and any(s.kind == "smg" for s in specs):
        specs, tuning = tune(specs, options, model, tokenizer, out_dir, echo)
    records_path = out_dir / "records.jsonl"
    records_path.write_text("")
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    by_name = {s.name: s for s in specs}
    for run in range(options.runs):
        workloads, ceilings = draws[run if options.seed_per_run else 0]
        for name in run_order([s.name for s in specs], run):
            echo(f"run {run + 1}/{options.runs}: starting {name}")
            try:
                runs += _run_stack(by_name[name], run, model, workloads, ceilings, options,
                                   out_dir, records_path, echo)
            except PeersError as e:
                echo(f"  {name} skipped in run {run + 1}: {e}")
                failures.append({"run": run, "stack": name, "error": str(e)})
    report = aggregate(runs, options, [c for _, c in draws])
    report["stack_failures"] = failures
    report["tuning"] = tuning
    write_outputs(report, out_dir, echo)
    return report


def tune(specs: Sequence[StackSpec], options: PeersOptions, model, tokenizer, out_dir: Path,
         echo: Callable[[str], None]) -> tuple[list[StackSpec], dict[str, Any]]:
    """Each SMG stack run once per setting on the tuning set; returns the stacks with their best
    settings and, per stack, every setting's score and figures and the one chosen."""
    tuning = tuning_options(options)
    workloads = build_workloads(tuning)
    ceilings = {name: ceiling_hit_ratio(w.requests(), lambda t: tokenizer(t)["input_ids"],
                                        options.block_tokens)
                for name, w in workloads.items()}
    records_path = out_dir / "tuning-records.jsonl"
    records_path.write_text("")
    tuned: list[StackSpec] = []
    report: dict[str, Any] = {"seed_offset": TUNE_SEED_OFFSET}
    for spec in specs:
        variants = tuning_variants(spec)
        if len(variants) == 1:
            tuned.append(spec)
            continue
        scores: dict[str, float] = {}
        figures: dict[str, Any] = {}
        for variant in variants:
            echo(f"tuning {spec.name}: {variant.variant}")
            try:
                reports = _run_stack(variant, -1, model, workloads, ceilings, options, out_dir,
                                     records_path, echo)
            except PeersError as e:
                echo(f"  {spec.name} ({variant.variant}) did not run: {e}")
                reports = []
            scores[variant.variant] = tuning_score(reports)
            figures[variant.variant] = {r["workload"]: {k: r.get(k) for k in (
                "mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "output_throughput", "failed")}
                for r in reports}
        chosen = best_variant(scores)
        echo(f"tuning {spec.name}: races with {chosen} (TTFT mean score "
             + ", ".join(f"{v}: {sc:.0f}" for v, sc in scores.items()) + ")")
        tuned.append(next(v for v in variants if v.variant == chosen))
        report[spec.name] = {"chosen": chosen, "scores": scores, "figures": figures}
    return tuned, report


def reuse_tuning(specs: Sequence[StackSpec], path: Path) -> tuple[list[StackSpec], dict[str, Any]]:
    """The stacks with the settings a previous run's tuning chose (its ``peers.json`` at
    ``path``), and that tuning's report marked ``reused_from``. Raises ``PeersError`` when the
    file is not a tuned run's report or lacks an SMG stack being raced."""
    try:
        tuning = json.loads(path.read_text())["tuning"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PeersError(f"--tuned-from {path}: not the peers.json of a tuned run ({exc})") from exc
    tuned: list[StackSpec] = []
    for spec in specs:
        variants = tuning_variants(spec)
        if len(variants) == 1:
            tuned.append(spec)
            continue
        chosen = (tuning.get(spec.name) or {}).get("chosen") if isinstance(tuning, dict) else None
        match = [v for v in variants if v.variant == chosen]
        if not match:
            raise PeersError(f"--tuned-from {path}: no tuning of {spec.name} there (tune it: "
                             "run without --tuned-from)")
        tuned.append(match[0])
    return tuned, {**tuning, "reused_from": str(path)}


def _run_stack(spec: StackSpec, run: int, model, workloads: dict[str, Workload], ceilings,
               options: PeersOptions, out_dir: Path, records_path: Path,
               echo: Callable[[str], None]) -> list[dict[str, Any]]:
    """Start one stack fresh, warm it, run every workload on it, stop it."""
    reports = []
    with Stack(spec, model, out_dir / "logs", options.start_timeout_s, options.base_port,
               options.vllm_omp_bind) as stack:
        echo(f"  {spec.name} answering after {stack.start_s:.1f} s")
        asyncio.run(_warm(stack, options.request_timeout_s))
        for wname, workload in workloads.items():
            t0 = time.time()
            cpu_before = peers_cpu.snapshot(stack.pids())
            threads_before = peers_cpu.engine_threads(stack.pids())
            with HostStallProbe() as probe:
                records, duration_s = asyncio.run(run_workload(
                    stack.base_url, model.name, workload, options.request_timeout_s))
            cpu_s = peers_cpu.by_role(cpu_before, peers_cpu.snapshot(stack.pids()))
            model_s = peers_cpu.model_thread_seconds(threads_before,
                                                     peers_cpu.engine_threads(stack.pids()))
            report = summarise(records, duration_s, ceilings[wname].hit_ratio)
            report["host_stall"] = probe.result
            report["cpu_s_by_role"] = cpu_s
            report["cpu_share_by_role"] = peers_cpu.shares(cpu_s, duration_s, os.cpu_count() or 1)
            report["cpu_s_model_threads"] = model_s
            if spec.kind == "baton":
                report["cost_model_error_pct"] = cost_model_error(stack.base_url)
            reports.append({"run": run, "stack": spec.name, "workload": wname,
                            "started_unix": t0, "stack_start_s": stack.start_s, **report})
            with records_path.open("a") as f:
                for r in records:
                    f.write(json.dumps({"run": run, "stack": spec.name, "workload": wname,
                                        **msgspec.structs.asdict(r)}) + "\n")
            echo(f"  {wname}: TTFT mean {report['mean_ttft_ms']:.0f} ms p90 "
                 f"{report['p90_ttft_ms']:.0f} ms, TPOT {report['mean_tpot_ms']:.0f} ms, "
                 f"hit {report['hit_ratio']:.3f}, {report['completed']} ok, "
                 f"{report['failed']} failed {report['first_error'][:120]}")
            echo("    CPU s by role: " + ", ".join(f"{role} {sec:.1f}" for role, sec in cpu_s.items()
                                                  if sec > 0))
            if probe.result:
                echo(f"    host stalls (a sleeping probe process woke late): worst "
                     f"{probe.result['late_ms_max']:.0f} ms, {probe.result['stalls']} of "
                     f"{STALL_MS:.0f} ms or more, {probe.result['stalled_s']:.2f} s in all")
            if report.get("cost_model_error_pct"):
                errors = report["cost_model_error_pct"]
                echo("    cost model, held-out error: " + "; ".join(
                    f"{what} median {errors[model].get('median', float('nan')):.1f}%, p90 "
                    f"{errors[model].get('p90', float('nan')):.1f}%"
                    for model, what in (("prefill", "prefill"), ("decode", "decode step"),
                                        ("decode_per_request", "decode per request"),
                                        ("mixed_step", "mixed step"),
                                        ("decode_per_request_all_steps",
                                         "decode per request, all steps"),
                                        ("handoff", "hand-off")) if model in errors))
    return reports


def cost_model_error(base_url: str) -> dict[str, dict[str, float]]:
    """Baton's live cost-model error as its front exposes it (``baton_cost_model_error_pct``
    on ``/metrics``): model -> {median, p90}; empty when not measured or not reachable."""
    try:
        return parse_cost_model_error(httpx.get(base_url + "/metrics", timeout=10).text)
    except httpx.HTTPError:
        return {}


def parse_cost_model_error(text: str) -> dict[str, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    errors: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "baton_cost_model_error_pct":
            for sample in family.samples:
                errors.setdefault(sample.labels["model"], {})[sample.labels["stat"]] = sample.value
    return errors


def aggregate(runs: Sequence[dict[str, Any]], options: PeersOptions,
              draws: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report: every run, and per workload the medians over runs. ``draws``: the workloads'
    ceilings (``Ceiling`` by workload) of each draw, one per run with ``seed_per_run``; the
    summary's ceiling is their median (each run's hit ratio is held to its own draw's)."""
    summary: dict[str, Any] = {}
    for wname in options.workloads:
        medians = {s: median_table([r for r in runs if r["stack"] == s and r["workload"] == wname])
                   for s in options.stacks}
        fanouts = {s: [r["fanout"] for r in runs if r["stack"] == s and r["workload"] == wname
                       and r.get("fanout")] for s in options.stacks}
        summary[wname] = {
            "ceiling_hit_ratio": float(np.median([c[wname].hit_ratio for c in draws])),
            "ceiling_prompt_tokens": int(np.median([c[wname].prompt_tokens for c in draws])),
            "medians": medians,
            "fanout_mean_ttft_ms": {s: float(np.median([f["mean_ttft_ms"] for f in v]))
                                    for s, v in fanouts.items() if v},
            "cpu_s_by_role": {s: median_cpu([r for r in runs if r["stack"] == s
                                             and r["workload"] == wname])
                              for s in options.stacks},
            "cpu_s_model_threads": {s: median_model_threads(
                [r for r in runs if r["stack"] == s and r["workload"] == wname])
                for s in options.stacks},
            "host_stall": {s: median_stall([r for r in runs if r["stack"] == s
                                            and r["workload"] == wname])
                           for s in options.stacks},
            "by_step": {s: median_steps([r for r in runs if r["stack"] == s
                                         and r["workload"] == wname])
                        for s in options.stacks},
            **ratios_vs_best_smg(medians),
        }
        best = summary[wname]["best_smg"]
        summary[wname]["paired_ratios"] = {
            s: paired_ratios([r for r in runs if r["workload"] == wname], s, best)
            for s in options.stacks if best is not None and not s.startswith("smg-")}
    return {"options": msgspec.to_builtins(options), "sched_autogroup": sched_autogroup(),
            "runs": list(runs), "summary": summary}


def median_steps(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per step (``peers_client.step_stats``), the median over runs of each figure (None where
    no run has it); steps in the order the runs list them."""
    labels = list(dict.fromkeys(label for r in reports for label in r.get("by_step") or {}))
    out: dict[str, dict[str, float | None]] = {}
    for label in labels:
        stats = [r["by_step"][label] for r in reports if label in (r.get("by_step") or {})]
        out[label] = {key: (float(np.median(values)) if (values := [
            s[key] for s in stats if s.get(key) is not None]) else None)
            for key in ("mean_ttft_ms", "arrival_spread_ms", "mean_queue_ms")}
    return out


def median_stall(reports: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Median over runs of the host-stall probe's worst lateness (ms) and stalled time (s);
    empty when no run has the probe's answer."""
    probes = [r["host_stall"] for r in reports if r.get("host_stall")]
    if not probes:
        return {}
    return {key: float(np.median([p[key] for p in probes])) for key in ("late_ms_max", "stalled_s")}


def median_cpu(reports: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Median CPU seconds per role over runs (roles no run reported are left out)."""
    per_role: dict[str, list[float]] = {}
    for r in reports:
        for role, seconds in (r.get("cpu_s_by_role") or {}).items():
            per_role.setdefault(role, []).append(seconds)
    return {role: round(float(np.median(v)), 2) for role, v in per_role.items()}


def median_model_threads(reports: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Median over runs of the model threads' CPU seconds and of everything else the stack's
    processes took, as ``{"model": s, "rest": s}``; None when no run measured them."""
    pairs = [(r["cpu_s_model_threads"], sum((r.get("cpu_s_by_role") or {}).values()))
             for r in reports if r.get("cpu_s_model_threads") is not None]
    if not pairs:
        return None
    return {"model": round(float(np.median([m for m, _ in pairs])), 2),
            "rest": round(float(np.median([max(0.0, total - m) for m, total in pairs])), 2)}


def _fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _cell(medians: dict[str, dict], runs: int, key: str, digits: int = 0) -> str:
    v = medians[key]
    if runs > 1 and v["median"] is not None:
        return f"{_fmt(v['median'], digits)} [{_fmt(v['min'], digits)}-{_fmt(v['max'], digits)}]"
    return _fmt(v["median"], digits)


def markdown(report: dict[str, Any]) -> str:
    lines = []
    runs = report["options"]["runs"]
    for wname, s in report["summary"].items():
        spread = ", [min-max]" if runs > 1 else ""
        if report["options"].get("seed_per_run") and runs > 1:
            spread += f", run k drawn from seed {report['options']['fleet']['seed']} + k"
            ceiling = f"median ceiling hit ratio {s['ceiling_hit_ratio']:.3f}"
        else:
            ceiling = f"ceiling hit ratio {s['ceiling_hit_ratio']:.3f}"
        lines += [(f"### {wname} ({ceiling}; medians of {runs} run(s){spread}; ratios vs "
                   f"{s['best_smg']})"), "",
                  ("| stack | TTFT mean ms | TTFT p90 ms | TPOT mean ms | E2EL mean ms "
                   "| output tok/s | hit ratio (vs ceiling) | fan-out TTFT mean ms | TTFT mean x "
                   "| TTFT p90 x | throughput x |"),
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for stack, m in s["medians"].items():
            cell = partial(_cell, m, runs)
            r = s["ratios"].get(stack, {})
            lines.append(" | ".join([
                f"| {stack}", cell("mean_ttft_ms"), cell("p90_ttft_ms"), cell("mean_tpot_ms"),
                cell("mean_e2el_ms"), cell("output_throughput", 1),
                f"{_fmt(m['hit_ratio']['median'], 3)} ({_fmt(m['hit_ratio_vs_ceiling']['median'], 2)})",
                _fmt(s["fanout_mean_ttft_ms"].get(stack)),
                _fmt(r.get("mean_ttft_ms"), 2), _fmt(r.get("p90_ttft_ms"), 2),
                _fmt(r.get("output_throughput"), 2)]) + " |")
        lines.append("")
        for stack, paired in (s.get("paired_ratios") or {}).items():
            if any(paired.values()):
                lines += [f"{stack} against {s['best_smg']} run by run (each run's pair): TTFT mean "
                          + ", ".join(f"{v:.2f}" for v in paired["mean_ttft_ms"]) + "x; p90 "
                          + ", ".join(f"{v:.2f}" for v in paired["p90_ttft_ms"]) + "x; throughput "
                          + ", ".join(f"{v:.2f}" for v in paired["output_throughput"]) + "x.", ""]
        lines += step_table(s.get("by_step") or {})
        cpu = s.get("cpu_s_by_role") or {}
        model = s.get("cpu_s_model_threads") or {}
        if any(cpu.values()):
            lines += ["CPU seconds by role (median over runs); model threads: each engine "
                      "process's busiest thread (the forward pass), the rest: everything else "
                      "the stack's processes took:", "",
                      "| stack | " + " | ".join(peers_cpu.ROLES) + " | model threads | the rest |",
                      "| --- |" + " ---: |" * (len(peers_cpu.ROLES) + 2)]
            lines += [f"| {stack} | " + " | ".join(_fmt(by.get(role), 1) for role in peers_cpu.ROLES)
                      + f" | {_fmt((model.get(stack) or {}).get('model'), 1)}"
                      + f" | {_fmt((model.get(stack) or {}).get('rest'), 1)} |"
                      for stack, by in cpu.items()]
            lines.append("")
        stalls = {stack: m for stack, m in (s.get("host_stall") or {}).items() if m}
        if stalls:
            lines += [f"Host stalls while each stack served (a sleeping probe process, "
                      f"`bench.stall_probe`; median over runs): its latest wake-up, and the "
                      f"time lost in wake-ups {STALL_MS:.0f} ms or more late:", "",
                      "| stack | latest wake-up ms | stalled s |", "| --- | ---: | ---: |"]
            lines += [f"| {stack} | {_fmt(m['late_ms_max'])} | {_fmt(m['stalled_s'], 2)} |"
                      for stack, m in stalls.items()]
            lines.append("")
    tuned = {k: v for k, v in (report.get("tuning") or {}).items()
             if k not in ("seed_offset", "reused_from")}
    if tuned:
        reused = report["tuning"].get("reused_from")
        offset = report["tuning"]["seed_offset"]
        where = (f"by an earlier run ({reused}; its tuning set: its workloads at its seed + "
                 f"{offset}), not in this one" if reused else
                 f"before the race on the tuning set (the same workloads, seed + {offset})")
        lines += [f"SMG tuned {where}, one run per setting; score = geometric mean over "
                  "workloads of the TTFT mean, ms:", "",
                  "| stack | setting | score | raced |", "| --- | --- | ---: | --- |"]
        for stack, t in tuned.items():
            lines += [f"| {stack} | {variant} | {_fmt(score)} | "
                      f"{'yes' if variant == t['chosen'] else ''} |"
                      for variant, score in t["scores"].items()]
        lines.append("")
    return "\n".join(lines)


def step_table(by_step: dict[str, dict[str, dict[str, float | None]]]) -> list[str]:
    """The markdown lines of the per-step table (none when no stack has steps)."""
    labels = list(dict.fromkeys(label for steps in by_step.values() for label in steps))
    if not labels:
        return []
    lines = ["TTFT mean by step, ms (median over runs), with the spread of the agents' sends "
             "in s and, where the stack prices it, the mean queue its placement priced:", "",
             "| stack | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
    for stack, steps in by_step.items():
        cells = []
        for label in labels:
            m = steps.get(label)
            if m is None or m["mean_ttft_ms"] is None:
                cells.append("n/a")
                continue
            queue = "" if m["mean_queue_ms"] is None else f", queue {_fmt(m['mean_queue_ms'])}"
            cells.append(f"{_fmt(m['mean_ttft_ms'])} (sent over {_fmt(m['arrival_spread_ms'] / 1000, 1)} s"
                         f"{queue})")
        lines.append(f"| {stack} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot(report: dict[str, Any], path: Path) -> bool:
    """TTFT mean and p90 per stack and workload (bars: medians; whiskers: min-max). False when
    matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summary = report["summary"]
    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4), squeeze=False)
    for ax, (wname, s) in zip(axes[0], summary.items()):
        stacks = list(s["medians"])
        for k, key in enumerate(("mean_ttft_ms", "p90_ttft_ms")):
            med = [s["medians"][st][key]["median"] or 0 for st in stacks]
            lo = [m - (s["medians"][st][key]["min"] or 0) for m, st in zip(med, stacks)]
            hi = [(s["medians"][st][key]["max"] or 0) - m for m, st in zip(med, stacks)]
            ax.bar([i + 0.4 * k for i in range(len(stacks))], med, 0.4, yerr=[lo, hi],
                   label=key.replace("_ms", " (ms)"), capsize=3)
        ax.set_xticks([i + 0.2 for i in range(len(stacks))], stacks, rotation=20)
        ax.set_title(wname)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_outputs(report: dict[str, Any], out_dir: Path, echo: Callable[[str], None]) -> None:
    (out_dir / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    (out_dir / "peers.md").write_text(table + "\n")
    echo(table)
    for wname, s in report["summary"].items():
        for stack in (n for n in s["ratios"] if n.startswith("baton-")):
            r = s["ratios"][stack]
            echo(f"{wname}: {stack} vs {s['best_smg']}: TTFT mean x{_fmt(r['mean_ttft_ms'], 2)}, "
                 f"p90 x{_fmt(r['p90_ttft_ms'], 2)}, TPOT x{_fmt(r['mean_tpot_ms'], 2)}, "
                 f"throughput x{_fmt(r['output_throughput'], 2)}, hit x{_fmt(r['hit_ratio'], 2)}")
    if plot(report, out_dir / "peers.png"):
        echo(f"wrote {out_dir}/peers.json, peers.md, peers.png, records.jsonl")
    else:
        echo(f"wrote {out_dir}/peers.json, peers.md, records.jsonl (no plot: matplotlib is not "
             "installed)")
