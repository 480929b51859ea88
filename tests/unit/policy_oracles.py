"""The cost-aware policies' options computed the slow way, for the tests to hold the policies to.

Every ready prefill instance is priced with ``conductor.pricing.price``, the one definition of
the prefill price, in pool order; the policies' one-pass scan (``conductor.pricing.cheapest``)
must choose exactly what the least of these options is, to the last bit.
"""

from __future__ import annotations

from conductor.picking import ready
from conductor.policy_config import PolicyConfig
from conductor.pricing import PrefillPrice, best_source, price
from conductor.snapshot import ClusterSnapshot, InstanceView
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
