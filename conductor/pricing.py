"""The prefill price: what prefilling one request on one instance costs, in milliseconds.

``T = transfer + queue + prefill`` (Mooncake's TTFT terms; the models are ``conductor.cost_model``).
``price`` is the one definition of the terms and ``predicted_ttft_ms`` the one definition of their
sum. The rest of this module implements that definition faster and must agree with it to the bit:

- ``Pricer`` is ``price`` for one decision, memoising the queue-free terms (the instances of one
  node that reach a store hit share one run, so they share every term but the queue);
- ``cheapest`` is the least ``price(...).total_ms`` over a whole pool in one C pass
  (``conductor._scan``: the sums in ``predicted_ttft_ms``'s order, IEEE doubles, first listed on
  ties). ``tests/unit/policy_oracles.py`` prices every instance with ``price`` and the tests hold
  both to it.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import msgspec

from conductor import _scan
from conductor.policy_config import PolicyConfig
from conductor.snapshot import (
    NO_HIT,
    ClusterSnapshot,
    InstanceView,
    PoolArrays,
    PrefixHit,
    has_unpriced_queue,
)
from protos.wire import Placement, PlacementRequest


def predicted_ttft_ms(transfer_ms: float, queue_ms: float, prefill_ms: float) -> float:
    """T, summed left to right: ``(transfer + queue) + prefill``. Float addition does not
    associate, so this order is part of the definition (``conductor._scan`` sums the same way)."""
    return transfer_ms + queue_ms + prefill_ms


class PrefillPrice(msgspec.Struct, frozen=True):
    """The priced TTFT terms of one prefill option (ms)."""

    instance_id: str
    transfer_ms: float
    queue_ms: float
    prefill_ms: float
    num_cached_blocks: int
    num_pulled_blocks: int = 0
    pulled_from: str = ""

    @property
    def total_ms(self) -> float:
        return predicted_ttft_ms(self.transfer_ms, self.queue_ms, self.prefill_ms)

    def describe(self) -> str:
        where = (f"pulled {self.num_pulled_blocks} blocks from {self.pulled_from}" if self.num_pulled_blocks
                 else f"local prefix {self.num_cached_blocks} blocks")
        return (f"{self.instance_id}: T=transfer {self.transfer_ms:.1f} + queue {self.queue_ms:.1f} + "
                f"prefill {self.prefill_ms:.1f} = {self.total_ms:.1f} ms ({where})")

    def placement(self, decode_instance: str, policy: str, reason: str) -> Placement:
        """Prefill here, decode on ``decode_instance``, with these priced terms; the longest
        prefix runs first on the prefill instance."""
        return Placement(
            self.instance_id, decode_instance, policy, reason,
            transfer_ms=self.transfer_ms, queue_ms=self.queue_ms, prefill_ms=self.prefill_ms,
            expected_cached_blocks=self.num_cached_blocks, pulled_from=self.pulled_from,
            priority=-self.num_cached_blocks,
        )


def queue_ms(view: InstanceView, config: PolicyConfig) -> float:
    """The queue term: the instance's priced queue, or, for a queue of tokens without a priced
    time, one prefill of that many tokens."""
    if not has_unpriced_queue(view):
        return view.queued_prefill_ms
    return config.prefill_cost.t_prefill_ms(view.num_queued_prefill_tokens, 0)


def price(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
          view: InstanceView, source: InstanceView | None = None) -> PrefillPrice:
    """TTFT terms for prefilling on ``view``, using its own leading run, or, with ``source``, the
    longer run ``source`` holds: the blocks past the local run are pulled from ``source``.

    Transfer: local host blocks load over ``same_node``; disk blocks anywhere over
    ``remote_disk``; pulled device/host blocks over ``same_node`` when both share a non-empty
    ``node_id``, else ``remote_host``. Device blocks on ``view`` itself cost nothing. Queue:
    ``queue_ms``. Prefill: the prompt past the cached (local + pulled) blocks.
    """
    return Pricer(snapshot, request, config).price(view, source)


def _terms(request: PlacementRequest, config: PolicyConfig, local: PrefixHit,
           remote: PrefixHit | None, same_node: bool) -> tuple[float, float, int, int]:
    """``price`` without the queue: (transfer ms, prefill ms, cached blocks, pulled blocks), which
    depend only on the two runs and whether the pull stays on the node."""
    # A term of zero blocks costs 0.0 and adding 0.0 to a non-negative sum changes no bit, so
    # only the terms that move something are computed (this runs several times per decision).
    bytes_per_block = config.block_size_tokens * config.kv_bytes_per_token
    t = config.transfer
    transfer_ms = 0.0
    if local.num_blocks_host:
        transfer_ms = t.t_transfer_ms(local.num_blocks_host * bytes_per_block, "same_node")
    if local.num_blocks_disk:
        transfer_ms += t.t_transfer_ms(local.num_blocks_disk * bytes_per_block, "remote_disk")
    num_cached_blocks, num_pulled = local.num_blocks, 0
    if remote is not None:
        device, host, disk = remote.tiers_in(num_cached_blocks, remote.num_blocks)
        pulled_ms = 0.0  # summed apart, then added: the grouping of the full formula
        if device + host:
            pulled_ms = t.t_transfer_ms((device + host) * bytes_per_block,
                                        "same_node" if same_node else "remote_host")
        if disk:
            pulled_ms += t.t_transfer_ms(disk * bytes_per_block, "remote_disk")
        transfer_ms += pulled_ms
        num_pulled = device + host + disk
        num_cached_blocks += num_pulled
    cached_tokens = min(num_cached_blocks * config.block_size_tokens, request.num_prompt_tokens)
    prefill_ms = config.prefill_cost.t_prefill_ms(request.num_prompt_tokens - cached_tokens, cached_tokens)
    return transfer_ms, prefill_ms, num_cached_blocks, num_pulled


class Pricer:
    """``price`` for one decision (one snapshot, request and config), memoising the queue-free
    terms by (local run, source, same node)."""

    def __init__(self, snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> None:
        self.snapshot, self.request, self.config = snapshot, request, config
        self._terms: dict[tuple, tuple[float, float, int, int]] = {}

    def terms(self, local: PrefixHit, source: InstanceView | None,
              same_node: bool) -> tuple[float, float, int, int]:
        """``_terms`` of ``local`` pulling past it from ``source`` (None: no pull)."""
        key = (local, source.instance_id if source is not None else None, same_node)
        terms = self._terms.get(key)
        if terms is None:
            remote = self.snapshot.hit(source.instance_id) if source is not None else None
            terms = self._terms[key] = _terms(self.request, self.config, local, remote, same_node)
        return terms

    def price(self, view: InstanceView, source: InstanceView | None = None) -> PrefillPrice:
        """``price(snapshot, request, config, view, source)``."""
        same_node = source is not None and bool(source.node_id) and source.node_id == view.node_id
        transfer_ms, prefill_ms, num_cached, num_pulled = self.terms(
            self.snapshot.hit(view.instance_id), source, same_node)
        return PrefillPrice(view.instance_id, transfer_ms, queue_ms(view, self.config), prefill_ms,
                            num_cached, num_pulled, source.instance_id if num_pulled else "")

    def total(self, view: InstanceView, source: InstanceView | None = None) -> tuple[float, int]:
        """(``total_ms``, ``num_pulled_blocks``) of ``self.price(view, source)``, without building
        the price (the scan needs only these, for every instance with a hit)."""
        same_node = source is not None and bool(source.node_id) and source.node_id == view.node_id
        transfer_ms, prefill_ms, _, num_pulled = self.terms(
            self.snapshot.hit(view.instance_id), source, same_node)
        return predicted_ttft_ms(transfer_ms, queue_ms(view, self.config), prefill_ms), num_pulled


def best_source(snapshot: ClusterSnapshot, views: Sequence[InstanceView]) -> InstanceView:
    """The instance with the longest leading run; ties to the most device blocks, then first listed."""
    return max(views, key=lambda v: (snapshot.hit(v.instance_id).num_blocks,
                                     snapshot.hit(v.instance_id).num_blocks_device))


def best_hit_source(snapshot: ClusterSnapshot, include_decode: bool) -> InstanceView | None:
    """``best_source`` over the ready instances with a hit, listed prefill pool first, then the
    decode pool when ``include_decode`` (None when no such instance has a hit). With the
    snapshot's ``pool_index`` it visits only the hits: the largest (run, device blocks), then
    the first listed, exactly as the scan of the pools picks."""
    hits = snapshot.prefix_hits
    index = snapshot.pool_index
    if index is None:
        if not any(hit.num_blocks for hit in hits.values()):
            return None
        views = tuple(v for v in snapshot.prefill if v.ready) + (
            tuple(v for v in snapshot.decode if v.ready) if include_decode else ())
        holders = [v for v in views if v.instance_id in hits and hits[v.instance_id].num_blocks]
        return best_source(snapshot, holders) if holders else None
    pools = (snapshot.prefill, snapshot.decode)
    best, best_key = None, None
    for instance_id, hit in hits.items():
        where = index.get(instance_id)
        if where is None or (where[0] and not include_decode):
            continue
        num_blocks = hit.num_blocks
        if not num_blocks:
            continue
        view = pools[where[0]][where[1]]
        key = (num_blocks, hit.num_blocks_device, -where[0], -where[1])
        if view.ready and (best_key is None or key > best_key):
            best, best_key = view, key
    return best


def cheapest(prefill: Sequence[InstanceView], pricer: Pricer, best: InstanceView | None,
             source_for_hit: Callable[[InstanceView], InstanceView | None],
             always_pull: bool) -> tuple[InstanceView | None, float, InstanceView | None, float]:
    """(view, T) of the least ``price(...).total_ms`` over ``prefill``, the ready instances of
    the snapshot's prefill pool (``picking.ready``), and the same among the options without a
    pull (None, inf when every option pulls); first listed on ties.

    An instance with a prefix hit is priced pulling from ``source_for_hit(view)`` (None: its own
    prefix); one without pulls ``best``'s run (None: nothing to pull) when ``always_pull``
    (Mooncake) or when that is strictly faster than recomputing. Those with a hit are priced here
    through ``pricer``; every other instance's T is its queue plus one of three constants
    (recompute, or pull over the same-node or the remote path), summed in one C pass over the
    pool's arrays, in which an instance that is not ready costs infinitely much and never wins.
    """
    if not prefill:
        return None, math.inf, None, math.inf
    snapshot, config = pricer.snapshot, pricer.config
    pool = snapshot.prefill
    arrays = snapshot.prefill_arrays
    if arrays is None:  # a snapshot made without them (the tests'): built for this decision
        arrays = PoolArrays.of(pool)
    q = arrays.queued_prefill_ms
    if arrays.unpriced:
        q = q.copy()
        for i in arrays.unpriced:
            q[i] = queue_ms(pool[i], config)
    recompute_ms = pricer.terms(NO_HIT, None, False)[1]
    if best is None:  # no pull: it costs infinitely much, so it is never strictly faster
        on_node, same, other, always_pull = None, (math.inf, math.inf), (math.inf, math.inf), False
    else:
        code = arrays.node_code.get(best.node_id) if best.node_id else None
        on_node = arrays.on_node[code] if code is not None else None
        same = pricer.terms(NO_HIT, best, bool(best.node_id))[:2]
        other = pricer.terms(NO_HIT, best, False)[:2]
    # (position, T, pulled) of the instances that are not ready, and of the ready ones with a hit
    overrides = [] if prefill is pool else [(i, math.inf, True) for i, v in enumerate(pool) if not v.ready]
    skip = {i for i, _, _ in overrides}
    for instance_id, hit in snapshot.prefix_hits.items():
        i = arrays.position.get(instance_id)
        if i is not None and hit.num_blocks and i not in skip:
            total_ms, num_pulled = pricer.total(pool[i], source_for_hit(pool[i]))
            overrides.append((i, total_ms, bool(num_pulled)))
    overrides.sort()
    i, best_t, j, local_t = _scan.cheapest(
        q, on_node, *same, *other, recompute_ms, always_pull,
        [o[0] for o in overrides], [o[1] for o in overrides], [o[2] for o in overrides])
    assert pool[i].ready, "a ready instance's T is finite, so one of them is the least"
    return pool[i], best_t, (pool[j] if j >= 0 else None), local_t


def with_prices(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
                placement: Placement) -> Placement:
    """``placement`` with the priced terms of its prefill instance filled in, for the policies
    that choose without pricing (so every decision can be explained in milliseconds)."""
    if placement.policy in ("mooncake", "baton"):
        return placement
    views = {v.instance_id: v for v in snapshot.prefill + snapshot.decode}
    chosen = price(snapshot, request, config, views[placement.prefill_instance])
    return chosen.placement(placement.decode_instance, placement.policy, placement.reason)
