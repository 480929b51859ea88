"""The human-readable half of a replay: a markdown table and two PNG plots (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from simulator.replay import PolicyRun


def _title(meta: dict) -> str:
    return (f"SIMULATED: {meta['trace_name']} on {meta['fleet']['num_prefill_instances']}P+"
            f"{meta['fleet']['num_decode_instances']}D, profile {meta['profile_name']}")


def markdown_table(runs: dict[str, PolicyRun], meta: dict) -> str:
    fleet = meta["fleet"]
    lines = [
        f"# {_title(meta)}",
        "",
        f"Rate scale {meta['rate_scale']:g} ({meta['num_requests']} requests); trace hit ceiling "
        f"{meta['ceiling_hit_ratio']:.3f}; SLOs: TTFT <= {fleet['ttft_slo_ms']:g} ms, worst "
        f"inter-token gap <= {fleet['tbt_slo_ms']:g} ms; admission {'on' if fleet['admission'] else 'off'}. "
        f"Goodput: highest rate scale with >= 90% of requests meeting both SLOs.",
        "",
        "| policy | hit ratio | of ceiling | TTFT mean | p50 | p90 | p99 (ms) | TBT p99 (ms) | "
        "TTFT SLO | TBT SLO | both | rejected | prefill GPU-s | goodput (x rate) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for policy, run in runs.items():
        r = run.result
        goodput = "-" if r.goodput_rate_scale is None else f"{r.goodput_rate_scale:.2f}"
        lines.append(
            f"| {policy} | {r.hit_ratio:.3f} | {r.hit_ceiling_fraction:.2f} | {r.ttft_ms.mean:,.0f} | "
            f"{r.ttft_ms.p50:,.0f} | {r.ttft_ms.p90:,.0f} | {r.ttft_ms.p99:,.0f} | {r.tbt_p99_ms:.1f} | "
            f"{r.slo_attainment.ttft:.3f} | {r.slo_attainment.tbt:.3f} | {r.slo_attainment.both:.3f} | "
            f"{r.num_rejected} | {r.prefill_compute_s:,.0f} | {goodput} |"
        )
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
    ax.set_ylabel("share of all requests (rejected never arrive)")
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
