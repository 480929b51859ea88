"""Baton's placement policy: Mooncake's Algorithm 1 priced in milliseconds with the pull threshold
derived rather than set, a replication margin, and conditional disaggregation.

``baton(snapshot, request, config) -> Placement`` is pure like every policy (``conductor.baselines``
states the contract); it prices with ``conductor.pricing`` and leaves rejection to
``conductor.admission``.
"""

from __future__ import annotations

from functools import partial

from conductor.picking import decode_by_load, decode_terms, ready
from conductor.policy_config import PolicyConfig
from conductor.pricing import Pricer, best_hit_source, cheapest, price
from conductor.snapshot import ClusterSnapshot, InstanceView
from protos.wire import Placement, PlacementRequest


def _pull_candidate(snapshot: ClusterSnapshot, best: InstanceView | None, best_len: int,
                    view: InstanceView) -> InstanceView | None:
    """``best`` when its run (``best_len`` blocks) is longer than ``view``'s own, so a pull is
    worth pricing, else None: ``cheapest`` then pulls for ``view`` only when strictly faster,
    which makes its choice ``_pull_source``'s."""
    if best is None or best_len <= snapshot.hit(view.instance_id).num_blocks:
        return None
    return best


def _pull_source(pricer: Pricer, best: InstanceView | None, best_len: int,
                 view: InstanceView) -> InstanceView | None:
    """Where ``view`` takes its prefix from: ``best`` (its run is ``best_len`` blocks) when that
    run is longer than ``view``'s own and pulling it is strictly faster, else None (its own).

    This is Algorithm 1's threshold derived: pull exactly when the transfer costs less than the
    prefill it saves (at equal queue). Queue-time differences between instances are weighed by
    the choice across instances that follows."""
    if best is None or best_len <= pricer.snapshot.hit(view.instance_id).num_blocks:
        return None
    return best if pricer.total(view, best)[0] < pricer.total(view)[0] else None


def baton(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Algorithm 1 priced in ms with an adaptive pull threshold, plus conditional disaggregation.

    Each ready prefill instance's option is its local prefix, or the longest run held by any
    ready instance (either pool) pulled to it, whichever is faster (``_pull_source``). Takes the
    least T over those options, except that the fastest option without a pull wins when it is
    within ``baton_replication_margin_frac`` of it: the chosen T never exceeds (1 + margin) × the
    least. The decode instance is chosen by load; when the prompt's uncached suffix on that
    decode instance (its own leading run) is shorter than ``short_prefill_tokens``, it prefills
    there too, saving the KV hand-off. With an empty prefill pool every request prefills on its
    decode instance (co-located serving).
    """
    prefill = ready(snapshot, "prefill") if snapshot.prefill else ()
    d = decode_by_load(snapshot)
    cached_on_decode = min(snapshot.hit(d.instance_id).num_blocks * config.block_size_tokens,
                           request.num_prompt_tokens)
    suffix_tokens = request.num_prompt_tokens - cached_on_decode
    if not prefill or suffix_tokens < config.short_prefill_tokens:
        chosen = price(snapshot, request, config, d)
        why = ("no prefill pool" if not prefill else
               f"uncached suffix {suffix_tokens} tokens < short_prefill_tokens {config.short_prefill_tokens}")
        reason = f"colocated: {why}; {chosen.describe()}; {decode_terms(d)}"
        return chosen.placement(d.instance_id, "baton", reason)
    best = best_hit_source(snapshot, include_decode=True)
    best_len = snapshot.hit(best.instance_id).num_blocks if best is not None else 0
    pricer = Pricer(snapshot, request, config)
    view, best_t, local_view, local_t = cheapest(
        prefill, pricer, best, partial(_pull_candidate, snapshot, best, best_len), always_pull=False)
    if local_view is not None and local_t <= best_t * (1 + config.baton_replication_margin_frac):
        view = local_view
    chosen = pricer.price(view, _pull_source(pricer, best, best_len, view))
    return chosen.placement(d.instance_id, "baton", f"{chosen.describe()}; {decode_terms(d)}")
