"""What ``baton bench replay`` tunes before the race: each policy's knobs, swept on a slice of
the trace held apart from the one the race runs on.

Every policy with knobs gets a grid around its authors' defaults (the default first, so a tie
keeps it): Mooncake's balancing threshold, Dynamo's overlap weight and temperature, SGLang's
cache and balance thresholds, and Baton's own two (its replication margin and where it prefills:
priced colocation, or the older short-prefill cut at its old values), no more points for Baton
than for Dynamo or SGLang. The best is the highest goodput on the
tuning slice, then the lowest mean TTFT at the trace's rate.
"""

from __future__ import annotations

import itertools
from typing import Any

from simulator.trace import TraceRequest

Knobs = dict[str, Any]

TUNING_GRIDS: dict[str, list[Knobs]] = {
    "mooncake": [{"mooncake_kvcache_balancing_threshold": t} for t in (2.0, 1.0, 1.25, 1.5, 3.0, 5.0, 10.0)],
    "dynamo_kv": [{"dynamo_overlap_score_weight": w, "dynamo_temperature": t}
                  for w, t in itertools.product((1.0, 0.5, 2.0, 4.0), (0.0, 0.1, 0.5))],
    "sglang_cache_aware": [
        {"sglang_cache_threshold": c, "sglang_balance_abs_threshold": a, "sglang_balance_rel_threshold": r}
        for c, (a, r) in itertools.product((0.3, 0.1, 0.5, 0.7), ((64, 1.5), (16, 1.25), (256, 2.0)))],
    "baton": [{"baton_replication_margin_frac": m, **colocation}
              for m, colocation in itertools.product((0.05, 0.0, 0.2), (
                  {"baton_colocation": "priced"},
                  *({"baton_colocation": "short", "short_prefill_tokens": s} for s in (256, 0, 1024))))],
}
"""Per policy, the knob settings tried (``PolicyConfig`` fields), the authors' default first.
Policies absent here (random, round_robin, least_loaded) have no knobs."""


def split_trace(requests: list[TraceRequest], tune_fraction: float) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """(tuning slice, race slice): the first ``tune_fraction`` of the requests by arrival and the
    rest, each re-timed to start at 0. Both start with cold caches."""
    assert 0 < tune_fraction < 1 and len(requests) >= 2
    cut = max(1, min(len(requests) - 1, round(len(requests) * tune_fraction)))

    def retimed(part: list[TraceRequest]) -> list[TraceRequest]:
        start = part[0].timestamp
        return [TraceRequest(r.timestamp - start, r.input_length, r.output_length, r.hash_ids) for r in part]

    return retimed(requests[:cut]), retimed(requests[cut:])
