"""The cost-aware policies' options computed the slow way, for the tests to hold the policies to.

Every ready prefill instance is priced with ``conductor.pricing.price``, the one definition of
the prefill price, in pool order; the policies' one-pass scan (``conductor.pricing.cheapest``)
must choose exactly what the least of these options is, to the last bit. Baton's priced
colocation the same way: every ready decode instance priced with ``colocated_price``
(``baton_priced_choice``), which the decode-pool scan (``conductor.pricing.cheapest_colocated``)
must match.
"""

from __future__ import annotations

from conductor.picking import ready
from conductor.policy_config import PolicyConfig
from conductor.pricing import (
    PrefillPrice,
    best_source,
    colocated_cost,
    colocated_price,
    handoff_ms,
    over_tbt_slo,
    price,
)
from conductor.snapshot import ClusterSnapshot, InstanceView, load
from protos.wire import PlacementRequest


def mooncake_options(snapshot: ClusterSnapshot, request: PlacementRequest,
                     config: PolicyConfig) -> list[PrefillPrice]:
    """Algorithm 1's price for each ready prefill instance, in pool order.

    The best prefix is the longest leading run in the prefill pool. An instance pulls it when
    ``best_len / local_len > kvcache_balancing_threshold`` (a local run of 0 with a best run > 0
    always pulls), else it uses its local prefix.
    """
    prefill = ready(snapshot, "prefill")
    best = best_source(snapshot, prefill)
    best_len = snapshot.hit(best.instance_id).num_blocks
    threshold = config.mooncake_kvcache_balancing_threshold
    options = []
    for view in prefill:
        local_len = snapshot.hit(view.instance_id).num_blocks
        pull = best_len > local_len and (local_len == 0 or best_len / local_len > threshold)
        options.append(price(snapshot, request, config, view, best if pull else None))
    return options


def baton_options(snapshot: ClusterSnapshot, request: PlacementRequest,
                  config: PolicyConfig) -> list[PrefillPrice]:
    """Each ready prefill instance's best price, in pool order: its local prefix, or the longest
    run held by any ready instance (either pool) pulled to it, whichever is strictly faster."""
    prefill = ready(snapshot, "prefill")
    best = best_source(snapshot, prefill + tuple(v for v in snapshot.decode if v.ready))
    return [_baton_option(snapshot, request, config, view, best) for view in prefill]


def _baton_option(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
                  view: InstanceView, best: InstanceView | None) -> PrefillPrice:
    """``view``'s local price, or the pulled one when it is strictly faster."""
    local = price(snapshot, request, config, view)
    best_len = snapshot.hit(best.instance_id).num_blocks if best is not None else 0
    if best is not None and best_len > local.num_cached_blocks:
        pulled = price(snapshot, request, config, view, best)
        if pulled.total_ms < local.total_ms:
            return pulled
    return local


def reference_choice(name: str, snapshot: ClusterSnapshot, request: PlacementRequest,
                     config: PolicyConfig) -> PrefillPrice:
    """The cost-aware choice (``baton`` or ``mooncake``) computed the slow way: every ready
    prefill instance fully priced, the least in pool order, then Baton's replication margin (the
    fastest option without a pull wins when within the margin of the least)."""
    options = (baton_options if name == "baton" else mooncake_options)(snapshot, request, config)
    chosen = min(options, key=lambda o: o.total_ms)
    local = [o for o in options if not o.num_pulled_blocks]
    if name == "baton" and chosen.num_pulled_blocks and local:
        best_local = min(local, key=lambda o: o.total_ms)
        if best_local.total_ms <= chosen.total_ms * (1 + config.baton_replication_margin_frac):
            chosen = best_local
    return chosen


def colocated_options(snapshot: ClusterSnapshot, request: PlacementRequest,
                      config: PolicyConfig, exclude_over_tbt: bool) -> list[PrefillPrice]:
    """Each ready decode instance's ``colocated_price``, in ``decode_by_load`` order (the key
    sorted the slow way; pool order on equal keys), without those ``over_tbt_slo`` when
    ``exclude_over_tbt``."""
    views = sorted((v for v in snapshot.decode if v.ready),
                   key=lambda v: (load(v), v.kv_usage_frac, v.num_active_decode_blocks))
    return [colocated_price(snapshot, request, config, v) for v in views
            if not (exclude_over_tbt and over_tbt_slo(snapshot, request, config, v))]


def baton_priced_choice(snapshot: ClusterSnapshot, request: PlacementRequest,
                        config: PolicyConfig) -> tuple[PrefillPrice, str]:
    """Baton's priced choice the slow way: (the prefill option taken, the decode instance).

    The co-located options are every ready decode instance priced (``colocated_options``), the
    least first in load order. Without a prefill pool it wins. Else the disaggregated option is
    ``reference_choice`` with the hand-off to the least loaded decode instance added, and the
    co-located one wins unless the disaggregated total is strictly less."""
    has_pool = bool(snapshot.prefill)
    options = colocated_options(snapshot, request, config, exclude_over_tbt=has_pool)
    views = {v.instance_id: v for v in snapshot.decode}
    cost = {o.instance_id: colocated_cost(views[o.instance_id], config, o) for o in options}
    colocated = min(options, key=lambda o: cost[o.instance_id]) if options else None
    if not has_pool:
        return colocated, colocated.instance_id
    pooled = reference_choice("baton", snapshot, request, config)
    decode = min((v for v in snapshot.decode if v.ready),
                 key=lambda v: (load(v), v.kv_usage_frac, v.num_active_decode_blocks))
    prefill_view = next(v for v in snapshot.prefill if v.instance_id == pooled.instance_id)
    disaggregated_t = pooled.total_ms + handoff_ms(snapshot, request, config, prefill_view, decode)
    if colocated is not None and cost[colocated.instance_id] <= disaggregated_t:
        return colocated, colocated.instance_id
    return pooled, decode.instance_id
