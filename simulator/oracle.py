"""The oracle bound of a trace: what no placement policy can beat on this fleet's hardware.

Every request finds every block any earlier request had (one infinite cache shared by every
instance, reached for free), prefills only the rest, never queues, and gets its first token one
batch-of-one decode step later. Its prefill takes the priced time times the request's own error
factor (the draws the simulations use). Its TTFT is capped at the SLO bound, the charge a
rejected request gets in the policies' figures, so that per request, and hence in the mean and
every percentile, the oracle is at or below any policy (a policy can only beat it for a request
that reuses blocks of a *later* arrival computed while it waited, which the bound does not
credit).

Goodput has no queueing bound of its own, so the oracle's is a fluid one: the highest rate scale
at which the cheapest 90% of the requests that can meet the TTFT SLO at all fit in the whole
fleet's time (every instance, prefill and decode, prefilling without pause over the trace's
span plus one SLO). No policy reaches it; it says how far from the hardware's limit each is.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from conductor.cost_model import CostProfile
from simulator.fleet import FleetConfig
from simulator.metrics import TtftStats
from simulator.prediction_error import error_factors
from simulator.sim import Workload

GOODPUT_ATTAINMENT = 0.9


class OracleResult(msgspec.Struct):
    """Shaped like a policy's result where it can be."""

    ttft_ms: TtftStats
    goodput_rate_scale: float
    num_requests: int
    hit_ratio: float
    """The trace's ceiling: the share of prompt blocks an earlier request had."""
    prefill_compute_s: float
    """Prefill time of the uncached suffixes only (s)."""
    slo_attainment_ttft: float
    """Share of requests whose bound TTFT meets the SLO (the rest cannot, on any fleet)."""


def oracle_ttft_ms(workload: Workload, fleet: FleetConfig, profile: CostProfile) -> tuple[np.ndarray, np.ndarray]:
    """(uncapped TTFT, prefill ms) per request under the oracle."""
    prefill_factor, _ = error_factors(len(workload), fleet.prediction_error, fleet.error_seed)
    bs = workload.block_size_tokens
    seen: set[bytes] = set()
    ttft = np.zeros(len(workload))
    prefill = np.zeros(len(workload))
    for i, keys in enumerate(workload.keys):
        num_cached = 0
        for key in keys:
            if key not in seen:
                break
            num_cached += 1
        seen.update(keys)
        num_prompt = workload.num_prompt_tokens[i]
        cached_tokens = min(num_cached * bs, num_prompt)
        prefill[i] = profile.prefill.t_prefill_ms(num_prompt - cached_tokens, cached_tokens) * prefill_factor[i]
        ttft[i] = prefill[i] + profile.decode.t_step_ms(1, num_prompt)
    return ttft, prefill


def oracle_bound(workload: Workload, fleet: FleetConfig, profile: CostProfile) -> OracleResult:
    raw_ttft, prefill_ms = oracle_ttft_ms(workload, fleet, profile)
    ttft = np.minimum(raw_ttft, fleet.ttft_slo_ms)
    p50, p90, p99 = np.percentile(ttft, [50, 90, 99])
    meets = raw_ttft <= fleet.ttft_slo_ms
    n = len(workload)
    needed = math.ceil(GOODPUT_ATTAINMENT * n)
    if int(meets.sum()) < needed:
        goodput = 0.0
    else:
        work_ms = float(np.sort(prefill_ms[meets])[:needed].sum())
        num_instances = fleet.num_prefill_instances + fleet.num_decode_instances
        span_ms = max(workload.arrival_ms) - min(workload.arrival_ms)
        spare_ms = work_ms - num_instances * fleet.ttft_slo_ms
        goodput = math.inf if spare_ms <= 0 else num_instances * span_ms / spare_ms
    return OracleResult(
        TtftStats(float(ttft.mean()), float(p50), float(p90), float(p99)), goodput, n,
        workload.ceiling_hit_ratio, float(prefill_ms.sum() / 1000.0), float(meets.mean()))
