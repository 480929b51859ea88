"""The prefill price: what prefilling one request on one instance costs, in milliseconds.

``T = transfer + queue + prefill`` (Mooncake's TTFT terms; the models are ``conductor.cost_model``).
``price`` is the one definition of the terms and ``predicted_ttft_ms`` the one definition of their
sum. The rest of this module implements that definition faster and must agree with it to the bit:

- ``Pricer`` is ``price`` for one decision, memoising the queue-free terms (the instances of one
  node that reach a store hit share one run, so they share every term but the queue);
- ``cheapest`` is the least ``price(...).total_ms`` over a whole pool in one C pass
  (``conductor._scan``: the sums in ``predicted_ttft_ms``'s order, IEEE doubles, first listed on
  ties). Instances are priced by class: no hit, or one class per distinct leading run
  (``GroupedHits``), so an agent fleet whose system prompt every instance holds costs a few
  priced runs and one pass, not a Python loop over the holders.
  ``tests/unit/policy_oracles.py`` prices every instance with ``price`` and the tests hold both
  to it.
"""

from __future__ import annotations

import math
from array import array
from typing import Callable, Sequence

import msgspec

from conductor import _scan
from conductor.policy_config import PolicyConfig
from conductor.snapshot import (
    NO_HIT,
    ClusterSnapshot,
    GroupedHits,
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


def grouped_hits(snapshot: ClusterSnapshot) -> GroupedHits:
    """The snapshot's prefix hits grouped by run (``GroupedHits``; the state's snapshots carry
    them so, a plain mapping is grouped here)."""
    hits = snapshot.prefix_hits
    if isinstance(hits, GroupedHits):
        return hits
    return GroupedHits.of(hits, snapshot.prefill, snapshot.decode, snapshot.pool_index)


def best_hit_source(snapshot: ClusterSnapshot, include_decode: bool) -> InstanceView | None:
    """``best_source`` over the ready instances with a hit, listed prefill pool first, then the
    decode pool when ``include_decode`` (None when no such instance has a hit): the first listed
    ready instance of the largest (run, device blocks). Visits the runs from the largest down,
    and in each the first listed holder (then, if it is not ready, the others in order)."""
    groups = grouped_hits(snapshot)
    runs = groups.runs
    if not runs:
        return None
    pools = [(snapshot.prefill, groups.prefill_run_of, 0)]
    if include_decode:
        pools.append((snapshot.decode, groups.decode_run_of, 1))
    if len(runs) == 1:  # the common case (one holder, or a trunk every instance holds)
        for views, _, pool in pools:
            p = groups.first_positions(pool)[0]
            if p >= 0:
                if views[p].ready:
                    return views[p]
                break  # not ready: the walk below finds the next holder in order
    keys = [(run.num_blocks, run.num_blocks_device) for run in runs]
    for key in sorted(set(keys), reverse=True):
        level = [r for r, k in enumerate(keys) if k == key]
        for views, run_of, pool in pools:
            first = groups.first_positions(pool)
            starts = [first[r] for r in level if first[r] >= 0]
            if not starts:
                continue
            start = min(starts)
            for p in range(start, len(views)):  # the first holder, unless it is not ready
                if views[p].ready and run_of[p] in level:
                    return views[p]
    return None


def _pull_terms(pricer: Pricer, hit: PrefixHit, best: InstanceView, on_node: object) -> tuple[float, ...]:
    """(same-node transfer, prefill, remote transfer, prefill) of ``hit`` pulling ``best``'s run;
    the same-node pair is unused (infinite) when no pool instance shares ``best``'s node."""
    same = pricer.terms(hit, best, True)[:2] if on_node is not None else (math.inf, math.inf)
    return (*same, *pricer.terms(hit, best, False)[:2])


NEVER_PULL, PULL_IF_FASTER, ALWAYS_PULL = 0, 1, 2
"""The scan's modes per class (``conductor/_scan.c``)."""


def cheapest(prefill: Sequence[InstanceView], pricer: Pricer, best: InstanceView | None,
             source_for_hit: Callable[[InstanceView], InstanceView | None],
             always_pull: bool) -> tuple[InstanceView | None, float, InstanceView | None, float]:
    """(view, T) of the least ``price(...).total_ms`` over ``prefill``, the ready instances of
    the snapshot's prefill pool (``picking.ready``), and the same among the options without a
    pull (None, inf when every option pulls); first listed on ties.

    An instance with a prefix hit may pull from ``source_for_hit(view)`` (None: it uses its own
    prefix; else ``best``), one without a hit may pull ``best``'s run (None: nothing to pull); a
    pull that may happen is taken when ``always_pull`` (Mooncake), else when strictly faster than
    the instance's own prefix. ``source_for_hit`` must depend on the view only through its hit:
    it is asked once per distinct run. The instances fall into classes (no hit, or one per run;
    ``GroupedHits``) whose terms but the queue are equal: each class is priced once through
    ``pricer``, and one C pass over the pool's arrays adds the queues and takes the least, in
    which an instance that is not ready costs infinitely much and never wins.
    """
    if not prefill:
        return None, math.inf, None, math.inf
    snapshot, config = pricer.snapshot, pricer.config
    pool = snapshot.prefill
    arrays = snapshot.prefill_arrays
    if arrays is None:  # a snapshot made without them (the tests'): built for this decision
        arrays = PoolArrays.of(pool)
    q = arrays.queued_prefill_ms
    if arrays.unpriced:  # queue_ms of those, elementwise
        tokens = arrays.queued_prefill_tokens
        unpriced = (q <= 0) & (tokens > 0)
        q = q.copy()
        q[unpriced] = config.prefill_cost.t_prefill_ms_many(tokens[unpriced], 0)
    groups = grouped_hits(snapshot)
    runs = groups.runs
    ready = None if prefill is pool else bytes([v.ready for v in pool])
    on_node = None
    if best is not None and best.node_id:
        code = arrays.node_code.get(best.node_id)
        on_node = arrays.on_node[code] if code is not None else None
    pull_mode = ALWAYS_PULL if always_pull else PULL_IF_FASTER
    # class 0: no hit (recompute everything, nothing to load); class 1 + r: run r
    terms = [0.0, pricer.terms(NO_HIT, None, False)[1]]
    terms += _pull_terms(pricer, NO_HIT, best, on_node) if best is not None else (0.0,) * 4
    modes = [pull_mode if best is not None else NEVER_PULL]
    for r, p in enumerate(groups.first_positions(0)):
        if p < 0:  # a run only decode instances hold
            terms += (0.0,) * 6
            modes.append(NEVER_PULL)
            continue
        hit, source = runs[r], source_for_hit(pool[p])
        terms += pricer.terms(hit, None, False)[:2]
        if source is None:
            terms += (0.0,) * 4
            modes.append(NEVER_PULL)
        else:
            assert source is best, "a hit pulls from the best source or not at all"
            terms += _pull_terms(pricer, hit, best, on_node)
            modes.append(pull_mode)
    i, best_t, j, local_t = _scan.cheapest(q, on_node, groups.prefill_run_of, ready,
                                           array("d", terms), bytes(modes))
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
