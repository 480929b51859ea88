"""The human-readable half of a replay: a markdown table and two PNG plots (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from simulator.replay import PolicyRun, ReplayOutcome


def _title(meta: dict) -> str:
    return (f"SIMULATED: {meta['trace_name']} on {meta['fleet']['num_prefill_instances']}P+"
            f"{meta['fleet']['num_decode_instances']}D, profile {meta['profile_name']}")


def _scale(value: float | None) -> str:
    return "-" if value is None else ("inf" if value == float("inf") else f"{value:.2f}")


def _knobs(knobs: dict) -> str:
    short = {"mooncake_kvcache_balancing_threshold": "threshold", "dynamo_overlap_score_weight": "weight",
             "dynamo_temperature": "temp", "sglang_cache_threshold": "cache", "sglang_balance_abs_threshold": "abs",
             "sglang_balance_rel_threshold": "rel", "baton_replication_margin_frac": "margin",
             "short_prefill_tokens": "short", "baton_colocation": "colocation"}
    return ", ".join(f"{short.get(k, k)} {v if isinstance(v, str) else format(v, 'g')}"
                     for k, v in knobs.items()) or "-"


def _error(meta: dict) -> str:
    """Which prediction error the figures were drawn with (``DrawnError.describe``)."""
    drawn = meta.get("prediction_error")
    if drawn is None:
        return f"prediction error {meta['fleet']['prediction_error']:.0%}"
    return drawn["drawn_with"]


def markdown_table(outcome: ReplayOutcome, meta: dict) -> str:
    fleet = meta["fleet"]
    runs, oracle = outcome.runs, outcome.oracle
    sliced = (f"tuned on the first {outcome.num_tune_requests} requests, raced on the other "
              f"{outcome.num_race_requests}" if outcome.num_tune_requests
              else f"raced on all {outcome.num_race_requests} requests, untuned")
    lines = [
        f"# {_title(meta)}",
        "",
        f"{sliced}. Rate scale {meta['rate_scale']:g}; trace hit ceiling {meta['ceiling_hit_ratio']:.3f}; "
        f"SLOs: TTFT <= {fleet['ttft_slo_ms']:g} ms, worst inter-token gap <= {fleet['tbt_slo_ms']:g} ms; "
        f"admission {'on' if fleet['admission'] else 'off'}; {_error(meta)}; coalescing for "
        f"{', '.join(fleet['coalesce_policies']) or 'none'}. "
        "TTFT over all requests, a rejected or unservable one at the SLO bound. Goodput: highest rate "
        "scale with >= 90% of requests meeting both SLOs, bracketed to 2%.",
        "",
        "| policy | tuned | hit ratio | TTFT mean | p50 | p90 | p99 (ms) | TBT p99 (ms) | both SLOs | "
        "rejected | prefill GPU-s | goodput (x rate) | bracket | TTFT / oracle | goodput / oracle |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for policy, run in runs.items():
        r = run.result
        bracket = "-" if r.goodput_ci is None else f"{_scale(r.goodput_ci[0])}-{_scale(r.goodput_ci[1])}"
        vs_goodput = ("-" if r.goodput_rate_scale is None or oracle.goodput_rate_scale in (0, float("inf"))
                      else f"{r.goodput_rate_scale / oracle.goodput_rate_scale:.2f}")
        lines.append(
            f"| {policy} | {_knobs(run.tuned)} | {r.hit_ratio:.3f} | {r.ttft_ms.mean:,.0f} | "
            f"{r.ttft_ms.p50:,.0f} | {r.ttft_ms.p90:,.0f} | {r.ttft_ms.p99:,.0f} | {r.tbt_p99_ms:.1f} | "
            f"{r.slo_attainment.both:.3f} | {r.num_rejected} | {r.prefill_compute_s:,.0f} | "
            f"{_scale(r.goodput_rate_scale)} | {bracket} | {r.ttft_ms.mean / oracle.ttft_ms.mean:.2f} | "
            f"{vs_goodput} |"
        )
    o = oracle
    lines.append(
        f"| oracle | - | {o.hit_ratio:.3f} | {o.ttft_ms.mean:,.0f} | {o.ttft_ms.p50:,.0f} | "
        f"{o.ttft_ms.p90:,.0f} | {o.ttft_ms.p99:,.0f} | - | {o.slo_attainment_ttft:.3f} (TTFT) | - | "
        f"{o.prefill_compute_s:,.0f} | {_scale(o.goodput_rate_scale)} (fluid) | - | 1.00 | 1.00 |")
    lines += ["", f"Profile: {meta['profile']['model']}; {meta['profile']['device']}.", ""]
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_ttft_cdf(path: Path, runs: dict[str, PolicyRun], meta: dict) -> Path | None:
    """TTFT CDF per policy (served requests; log time axis). None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, run in runs.items():
        ttft_s = np.sort(np.asarray(run.ttft_ms)) / 1000.0
        if len(ttft_s):
            ax.plot(ttft_s, np.arange(1, len(ttft_s) + 1) / run.result.num_requests, label=policy)
    ax.axvline(meta["fleet"]["ttft_slo_ms"] / 1000.0, color="grey", linestyle="--", label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of all requests (rejected at the SLO bound)")
    ax.set_title(f"{_title(meta)}, rate x{meta['rate_scale']:g}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_goodput(path: Path, runs: dict[str, PolicyRun], meta: dict) -> Path | None:
    """Share meeting both SLOs against arrival-rate scale, per policy (the sweep's points)."""
    plt = _pyplot()
    if plt is None or not any(run.sweep for run in runs.values()):
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, run in runs.items():
        points = sorted((p.rate_scale, p.attainment_both) for p in run.sweep)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=f"{policy} (goodput x{run.result.goodput_rate_scale:.2f})")
    ax.axhline(0.9, color="grey", linestyle="--", label="90%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("arrival-rate scale (x trace rate)")
    ax.set_ylabel("share of requests meeting TTFT and TBT SLOs")
    ax.set_title(_title(meta), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
