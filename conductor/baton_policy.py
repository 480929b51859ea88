"""Baton's placement policy: Mooncake's Algorithm 1 priced in milliseconds with the pull threshold
derived rather than set, a replication margin, and priced colocation.

``baton(snapshot, request, config) -> Placement`` is pure like every policy (``conductor.baselines``
states the contract); it prices with ``conductor.pricing`` and leaves rejection to
``conductor.admission``.
"""

from __future__ import annotations

import math
from functools import partial

from conductor.picking import decode_by_load, decode_terms, ready
from conductor.policy_config import PolicyConfig
from conductor.pricing import (
    Pricer,
    PrefillPrice,
    best_hit_source,
    cheapest,
    cheapest_colocated,
    colocated_cost,
    colocated_price,
    decode_stall_ms,
    decode_step_ms,
    handoff_ms,
    num_prefill_chunks,
    price,
)
from conductor.snapshot import ClusterSnapshot, InstanceView, load
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


def _pool_option(snapshot: ClusterSnapshot, pricer: Pricer,
                 prefill: tuple[InstanceView, ...]) -> PrefillPrice:
    """Algorithm 1 over the ready prefill pool: each instance's local prefix or the longest run
    held by any ready instance (either pool) pulled to it, whichever is faster; the least T,
    except that the fastest option without a pull wins when within
    ``baton_replication_margin_frac`` of it."""
    best = best_hit_source(snapshot, include_decode=True)
    best_len = snapshot.hit(best.instance_id).num_blocks if best is not None else 0
    view, best_t, local_view, local_t = cheapest(
        prefill, pricer, best, partial(_pull_candidate, snapshot, best, best_len), always_pull=False)
    if local_view is not None and local_t <= best_t * (1 + pricer.config.baton_replication_margin_frac):
        view = local_view
    return pricer.price(view, _pull_source(pricer, best, best_len, view))


def _colocated_terms(request: PlacementRequest, config: PolicyConfig, view: InstanceView,
                     chosen: PrefillPrice) -> str:
    """The co-located price explained, its decode-batch term spelled out when it has one."""
    text = chosen.describe()
    stall = decode_stall_ms(view, config, chosen)
    if stall:
        text += f"; decode stall {stall:.1f} ms ({load(view)} sequences x prefill, weighed)"
    if chosen.decode_batch_ms:
        chunks = num_prefill_chunks(request, config, chosen.num_cached_blocks)
        text += (f"; decode batch {chosen.decode_batch_ms:.1f} ms = {chunks} chunks x step "
                 f"{decode_step_ms(view, config):.1f} ms ({view.num_running_reqs} running)")
    return text


RUNNER_UP_MAX_INSTANCES = 8
"""Decode pools up to this size name the runner-up's price in a co-located placement's reason
(priced in Python once more per instance: a large pool's decision would pay for it)."""


def _runner_up(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
               decode: tuple[InstanceView, ...], chosen: str) -> str:
    """'; runner-up X: T=...' (the cheapest other ready decode instance's co-located price),
    so a reason shows what the choice beat and by how much; '' for a pool of one or of more
    than ``RUNNER_UP_MAX_INSTANCES``."""
    if not 2 <= len(decode) <= RUNNER_UP_MAX_INSTANCES:
        return ""
    others = [(v, colocated_price(snapshot, request, config, v)) for v in decode if v.instance_id != chosen]
    if not others:
        return ""
    view, price = min(others, key=lambda o: colocated_cost(o[0], config, o[1]))
    stall = decode_stall_ms(view, config, price)
    return f"; runner-up {price.describe()}" + (f" + decode stall {stall:.1f} ms" if stall else "")


def _short(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
           prefill: tuple[InstanceView, ...]) -> Placement:
    """The older rule (``baton_colocation`` 'short'): the decode instance by load, and the
    prefill on it when the uncached suffix there is shorter than ``short_prefill_tokens`` or
    there is no prefill pool; else Algorithm 1 over the prefill pool."""
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
    chosen = _pool_option(snapshot, Pricer(snapshot, request, config), prefill)
    return chosen.placement(d.instance_id, "baton", f"{chosen.describe()}; {decode_terms(d)}")


def baton(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Algorithm 1 priced in ms with an adaptive pull threshold, against prefilling on a decode
    instance (``baton_colocation`` 'priced'; 'short' is ``_short``'s older rule).

    Disaggregated, the prefill takes ``_pool_option`` and the decode instance is chosen by load;
    its total adds the KV hand-off to that decode instance (``handoff_ms``). Co-located, every
    ready decode instance is priced at ``colocated_price`` (its own prefix, its queue, the steps
    its running batch adds) and the least wins, ties to the least loaded; with ``tbt_slo_ms``,
    instances whose batch step with the prompt's first chunk would exceed it are left out. The
    least total wins, ties co-located (no hand-off); when no decode instance could win even
    without its queue and batch, the decode pool is not scanned and the reason gives that floor
    (``colocated >= ...``). With an empty prefill pool every request
    prefills on the decode instance of least ``colocated_price`` (no instance left out), so a
    warm agent stays where its prefix is unless the queue there makes moving cheaper.
    """
    prefill = ready(snapshot, "prefill") if snapshot.prefill else ()
    if config.baton_colocation_mode == "short":
        return _short(snapshot, request, config, prefill)
    pricer = Pricer(snapshot, request, config)
    decode = ready(snapshot, "decode")
    if not prefill:
        colocated, _ = cheapest_colocated(pricer, decode, exclude_over_tbt=False)
        view = _decode_view(snapshot, colocated.instance_id)
        reason = (f"colocated: no prefill pool; {_colocated_terms(request, config, view, colocated)}; "
                  f"{decode_terms(view)}"
                  f"{_runner_up(snapshot, request, config, decode, colocated.instance_id)}")
        return colocated.placement(view.instance_id, "baton", reason)
    pooled = _pool_option(snapshot, pricer, prefill)
    d = decode_by_load(snapshot)
    handoff = handoff_ms(snapshot, request, config, _prefill_view(snapshot, pooled.instance_id), d)
    disaggregated_t = pooled.total_ms + handoff
    overhead = (f" (measured overhead {config.handoff_overhead_ms:.1f} of it)"
                if config.handoff_overhead_ms else "")
    disaggregated = (f"{pooled.describe()} + hand-off {handoff:.1f} ms{overhead} to {d.instance_id} = "
                     f"{disaggregated_t:.1f} ms")
    colocated, colocated_t = cheapest_colocated(pricer, decode, exclude_over_tbt=True, beat_ms=disaggregated_t)
    if colocated is not None and colocated_t <= disaggregated_t:
        view = _decode_view(snapshot, colocated.instance_id)
        reason = (f"colocated: {colocated_t:.1f} ms <= disaggregated {disaggregated_t:.1f} ms; "
                  f"{_colocated_terms(request, config, view, colocated)}; disaggregated: {disaggregated}; "
                  f"{decode_terms(view)}")
        return colocated.placement(view.instance_id, "baton", reason)
    if colocated_t == math.inf:
        why = "disaggregated: no decode instance within tbt_slo_ms to prefill on"
    elif colocated is None:  # no decode instance could match it, even without queue or batch
        why = f"disaggregated: {disaggregated_t:.1f} ms < colocated >= {colocated_t:.1f} ms"
    else:
        why = f"disaggregated: {disaggregated_t:.1f} ms < colocated {colocated_t:.1f} ms"
    return pooled.placement(d.instance_id, "baton", f"{why}; {disaggregated}; {decode_terms(d)}",
                            handoff_ms=handoff)


def _view(snapshot: ClusterSnapshot, pool: int, instance_id: str) -> InstanceView:
    """The view of ``instance_id`` in the prefill (0) or decode (1) pool, through the maker's
    pool index when it has one."""
    views = snapshot.prefill if pool == 0 else snapshot.decode
    if snapshot.pool_index is not None:
        where = snapshot.pool_index.get(instance_id)
        if where is not None and where[0] == pool:
            return views[where[1]]
    return next(v for v in views if v.instance_id == instance_id)


def _prefill_view(snapshot: ClusterSnapshot, instance_id: str) -> InstanceView:
    return _view(snapshot, 0, instance_id)


def _decode_view(snapshot: ClusterSnapshot, instance_id: str) -> InstanceView:
    return _view(snapshot, 1, instance_id)
