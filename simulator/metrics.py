"""What one simulation measured, under the names ``results.json`` uses."""

from __future__ import annotations

import msgspec
import numpy as np

from simulator.sim import Simulation


class TtftStats(msgspec.Struct):
    """Time to first token over *all* requests (ms): arrival to the first token the decode
    instance emits (coalescing hold + queue + prefix transfer + prefill + KV hand-off + admission
    + one step); a request rejected by admission or too large for any device is charged the
    TTFT SLO bound (it never gets a first token, and leaving it out would flatter the policy
    that rejects most)."""

    mean: float
    p50: float
    p90: float
    p99: float


class SloAttainment(msgspec.Struct):
    """Share of *all* requests meeting each SLO; a rejected request meets none."""

    ttft: float
    tbt: float
    both: float


class PolicyResult(msgspec.Struct):
    """One policy's figures at one arrival-rate scale."""

    policy: str
    profile: str
    rate_scale: float
    num_requests: int
    num_served: int
    num_rejected: int
    """Rejected by the policy's admission (``Overloaded``)."""
    num_unservable: int
    """Larger than one instance's KV cache: no placement could serve them."""
    hit_ratio: float
    """Prompt blocks reused (device, host, disk or pulled) over prompt blocks of the served requests."""
    hit_ceiling_fraction: float
    """``hit_ratio`` over the trace's infinite-cache ceiling."""
    ttft_ms: TtftStats
    tbt_p99_ms: float
    """p99 over every inter-token gap of every request (ms)."""
    slo_attainment: SloAttainment
    prefill_compute_s: float
    """GPU time spent computing prefills (s): the sum of prefill times, transfers excluded."""
    prefill_tokens_computed: int
    num_colocated: int
    """Requests prefilled on their decode instance (conditional disaggregation)."""
    num_pulled_blocks: int
    """Prefix blocks pulled from another instance or node."""
    num_coalesced: int = 0
    """Requests held until an in-flight prefill of their prefix ended, then placed."""
    goodput_rate_scale: float | None = None
    """Highest rate scale with >= 90% of requests meeting both SLOs (None: not swept)."""
    goodput_ci: tuple[float, float | None] | None = None
    """The bracket the search ended with: ``goodput_rate_scale`` passed, the upper end failed
    (None: nothing tried failed)."""


def weighted_percentile(values: list[float], weights: list[int], q: float) -> float:
    """The smallest value with at least ``q`` percent of the total weight at or below it."""
    if not values:
        return 0.0
    order = np.argsort(values, kind="stable")
    sorted_values = np.asarray(values)[order]
    cumulative = np.cumsum(np.asarray(weights)[order])
    return float(sorted_values[np.searchsorted(cumulative, q / 100.0 * cumulative[-1])])


def summarize(sim: Simulation) -> PolicyResult:
    fleet, workload = sim.fleet, sim.workload
    served = sim.served & sim.finished
    assert np.array_equal(served, sim.served), "a served request never finished"
    blocks = np.array([len(k) for k in workload.keys])
    served_blocks = int(blocks[served].sum())
    hit_ratio = float(sim.num_cached_blocks[served].sum() / served_blocks) if served_blocks else 0.0
    ttft = np.where(served, sim.ttft_ms, fleet.ttft_slo_ms)
    if len(ttft):
        p50, p90, p99 = np.percentile(ttft, [50, 90, 99])
        ttft_stats = TtftStats(float(ttft.mean()), float(p50), float(p90), float(p99))
    else:
        ttft_stats = TtftStats(0.0, 0.0, 0.0, 0.0)
    ttft_ok = served & (np.nan_to_num(sim.ttft_ms, nan=np.inf) <= fleet.ttft_slo_ms)
    tbt_ok = served & (sim.max_gap_ms <= fleet.tbt_slo_ms)
    n = len(workload)
    return PolicyResult(
        policy=sim.policy_name, profile=sim.profile_name, rate_scale=sim.rate_scale, num_requests=n,
        num_served=int(served.sum()), num_rejected=int(sim.rejected.sum()),
        num_unservable=int(sim.unservable.sum()), hit_ratio=hit_ratio,
        hit_ceiling_fraction=hit_ratio / workload.ceiling_hit_ratio if workload.ceiling_hit_ratio else 0.0,
        ttft_ms=ttft_stats, tbt_p99_ms=weighted_percentile(sim.tbt_values, sim.tbt_weights, 99),
        slo_attainment=SloAttainment(float(ttft_ok.sum() / n), float(tbt_ok.sum() / n),
                                     float((ttft_ok & tbt_ok).sum() / n)),
        prefill_compute_s=float(sim.prefill_ms.sum() / 1000.0),
        prefill_tokens_computed=int(sim.num_computed_tokens.sum()),
        num_colocated=int(sim.colocated.sum()), num_pulled_blocks=int(sim.num_pulled_blocks.sum()),
        num_coalesced=int(sim.coalesced.sum()),
    )
