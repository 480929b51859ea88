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

A decode instance prefills a prompt itself at ``colocated_price``: ``price`` with its own run, its
running batch's decode step added to the queue once per prefill chunk (the steps the prefill
shares with that batch). ``cheapest_colocated`` is the least of it over the decode pool, in one
C pass of the same kind (the batch's steps and the ties by load computed in it); the other way,
disaggregated, hands the prompt's KV to the decode instance (``handoff_ms``).
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
    LoadArrays,
    PoolArrays,
    PrefixHit,
    has_unpriced_queue,
    load,
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
    decode_batch_ms: float = 0.0
    """Of ``queue_ms``, the decode steps of the instance's running batch the prefill shares
    (``colocated_price``; 0 elsewhere)."""

    @property
    def total_ms(self) -> float:
        return predicted_ttft_ms(self.transfer_ms, self.queue_ms, self.prefill_ms)

    def describe(self) -> str:
        where = (f"pulled {self.num_pulled_blocks} blocks from {self.pulled_from}" if self.num_pulled_blocks
                 else f"local prefix {self.num_cached_blocks} blocks")
        batch = f" (decode batch {self.decode_batch_ms:.1f} of it)" if self.decode_batch_ms else ""
        return (f"{self.instance_id}: T=transfer {self.transfer_ms:.1f} + queue {self.queue_ms:.1f}{batch} + "
                f"prefill {self.prefill_ms:.1f} = {self.total_ms:.1f} ms ({where})")

    def placement(self, decode_instance: str, policy: str, reason: str,
                  handoff_ms: float = 0.0) -> Placement:
        """Prefill here, decode on ``decode_instance``, with these priced terms (and, when
        disaggregated, the priced KV hand-off); the longest prefix runs first on the prefill
        instance."""
        return Placement(
            self.instance_id, decode_instance, policy, reason,
            transfer_ms=self.transfer_ms, queue_ms=self.queue_ms, prefill_ms=self.prefill_ms,
            expected_cached_blocks=self.num_cached_blocks, pulled_from=self.pulled_from,
            priority=-self.num_cached_blocks, handoff_ms=handoff_ms,
            decode_batch_ms=self.decode_batch_ms,
        )


def queue_ms(view: InstanceView, config: PolicyConfig) -> float:
    """The queue term: the instance's priced queue, or, for a queue of tokens without a priced
    time, one prefill of that many tokens."""
    if not has_unpriced_queue(view):
        return view.queued_prefill_ms
    return config.prefill_cost.t_prefill_ms(view.num_queued_prefill_tokens, 0)


def queue_model(config: PolicyConfig) -> tuple[float, float, float, float]:
    """The prefill model's coefficients as the C scans take them: they price a pool's unpriced
    queues (``queue_ms``) themselves."""
    cost = config.prefill_cost
    return cost.intercept_ms, cost.per_token_ms, cost.per_token_sq_ms, cost.per_token_cached_ms


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
    ``pricer``, and one C pass over the pool's arrays adds the queues (``queue_ms``: it prices
    the unpriced ones under the config's prefill model, ``queue_model``) and takes the least, in
    which an instance that is not ready costs infinitely much and never wins.
    """
    if not prefill:
        return None, math.inf, None, math.inf
    snapshot, config = pricer.snapshot, pricer.config
    pool = snapshot.prefill
    arrays = snapshot.prefill_arrays
    if arrays is None:  # a snapshot made without them (the tests'): built for this decision
        arrays = PoolArrays.of(pool)
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
    i, best_t, j, local_t = _scan.cheapest(arrays.queued_prefill_ms, arrays.queued_prefill_tokens,
                                           queue_model(config), on_node, groups.prefill_run_of, ready,
                                           array("d", terms), bytes(modes))
    assert pool[i].ready, "a ready instance's T is finite, so one of them is the least"
    return pool[i], best_t, (pool[j] if j >= 0 else None), local_t


def num_prefill_chunks(request: PlacementRequest, config: PolicyConfig, num_cached_blocks: int) -> int:
    """The steps a prefill over ``num_cached_blocks`` takes beside a running batch: its uncached
    suffix in chunks of ``baton_prefill_chunk_tokens``, at least one (a full hit still computes
    the last token)."""
    cached_tokens = min(num_cached_blocks * config.block_size_tokens, request.num_prompt_tokens)
    return max(1, -(-(request.num_prompt_tokens - cached_tokens) // config.baton_prefill_chunk_tokens))


def decode_step_ms(view: InstanceView, config: PolicyConfig) -> float:
    """One decode step of ``view``'s running batch (ms)."""
    return config.decode_cost.t_step_ms(view.num_running_reqs,
                                        view.num_active_decode_blocks * config.block_size_tokens)


def colocated_price(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
                    view: InstanceView) -> PrefillPrice:
    """The prefill on decode instance ``view`` itself: ``price`` with its own run (no pull), and,
    when it runs sequences, its batch's decode step once per prefill chunk added to the queue
    (``decode_batch_ms``): each chunk's step also steps that batch. The sum is
    ``queue_ms(view) + chunks × decode_step_ms`` (the fast scan adds the same way)."""
    own = price(snapshot, request, config, view)
    batch_ms = 0.0
    if view.num_running_reqs > 0:
        batch_ms = num_prefill_chunks(request, config, own.num_cached_blocks) * decode_step_ms(view, config)
    return msgspec.structs.replace(own, queue_ms=own.queue_ms + batch_ms, decode_batch_ms=batch_ms)


def decode_stall_ms(view: InstanceView, config: PolicyConfig, chosen: PrefillPrice) -> float:
    """What a co-located prefill costs the sequences on ``view`` (running, or queued before it
    and decoding by the time it runs): each waits for its prefill's steps, weighed by
    ``baton_decode_stall_weight`` (0: not priced)."""
    if config.baton_decode_stall_weight <= 0.0:
        return 0.0
    return (config.baton_decode_stall_weight * float(load(view))) * chosen.prefill_ms


def colocated_cost(view: InstanceView, config: PolicyConfig, chosen: PrefillPrice) -> float:
    """What the co-located choice minimises: ``chosen``'s priced TTFT plus its ``decode_stall_ms``
    (the fast scan adds the same way)."""
    stall = decode_stall_ms(view, config, chosen)
    return chosen.total_ms + stall if stall else chosen.total_ms


def first_chunk_ms(request: PlacementRequest, config: PolicyConfig, num_cached_blocks: int) -> float:
    """The prefill of the prompt's first chunk past ``num_cached_blocks`` (ms)."""
    cached_tokens = min(num_cached_blocks * config.block_size_tokens, request.num_prompt_tokens)
    chunk_tokens = min(config.baton_prefill_chunk_tokens, request.num_prompt_tokens - cached_tokens)
    return config.prefill_cost.t_prefill_ms(chunk_tokens, cached_tokens)


def over_tbt_slo(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
                 view: InstanceView) -> bool:
    """Whether prefilling here breaks ``tbt_slo_ms`` for ``view``'s running batch: its step with
    the prompt's first chunk (``decode_step_ms + first_chunk_ms``) is predicted over it. Never
    without an SLO or a running batch."""
    slo = config.tbt_slo_ms
    if slo is None or view.num_running_reqs <= 0:
        return False
    num_cached = snapshot.hit(view.instance_id).num_blocks
    return decode_step_ms(view, config) + first_chunk_ms(request, config, num_cached) > slo


def handoff_ms(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
               prefill: InstanceView, decode: InstanceView) -> float:
    """The KV hand-off of a disaggregated prefill: the prompt's blocks past ``decode``'s own
    device run, over ``same_node`` when both instances share a non-empty ``node_id``, else
    ``remote_host``, plus ``handoff_overhead_ms`` (what a hand-off measurably costs beyond its
    bytes: calibrated live, 0 elsewhere)."""
    num_blocks = -(-request.num_prompt_tokens // config.block_size_tokens)
    num_moved = max(0, num_blocks - snapshot.hit(decode.instance_id).num_blocks_device)
    same_node = bool(prefill.node_id) and prefill.node_id == decode.node_id
    moved_ms = config.transfer.t_transfer_ms(num_moved * config.block_size_tokens * config.kv_bytes_per_token,
                                             "same_node" if same_node else "remote_host")
    return moved_ms + config.handoff_overhead_ms


def cheapest_colocated(pricer: Pricer, decode: Sequence[InstanceView], exclude_over_tbt: bool,
                       beat_ms: float = math.inf) -> tuple[PrefillPrice | None, float]:
    """(the least ``colocated_price`` over ``decode``, the ready instances of the snapshot's
    decode pool, ties to the least loaded (``picking.decode_by_load``'s key); its total). With
    ``exclude_over_tbt`` the instances ``over_tbt_slo`` are left out: (None, inf) when none is
    left. When no instance can cost ``beat_ms`` or less, (None, a lower bound over ``beat_ms``):
    the least total over the classes without queues or batches, which never exceed their own (a
    queue is a sum of predicted times, never negative), so the pool is not scanned for an option
    that loses.

    One C pass (``conductor._scan.cheapest_colocated``) like ``cheapest``: each class (no hit, or
    one run) is priced once here; the pass reads each instance's queue (``queue_ms``, as in
    ``cheapest``) and running batch from the pool's arrays (``LoadArrays``), adds ``chunks[class] × decode_step_ms`` to the queue where
    the instance runs sequences, and breaks ties by load in the same pass. The price is built
    from what the pass returns, equal to ``colocated_price``'s to the bit.
    """
    snapshot, request, config = pricer.snapshot, pricer.request, pricer.config
    pool = snapshot.decode
    arrays = snapshot.decode_arrays
    if arrays is None:  # a snapshot made without them: built here
        arrays = LoadArrays.of(pool)
    groups = grouped_hits(snapshot)
    # the scan's classes: the no-hit class, then one per run; only the runs some decode instance
    # holds are priced (the others are never indexed)
    present = [0] + [1 + r for r, p in enumerate(groups.first_positions(1)) if p >= 0]
    rows, num_cached = [0.0] * (4 * (len(groups.runs) + 1)), [0] * (len(groups.runs) + 1)
    floor_ms = math.inf
    for c in present:
        transfer_ms, prefill_ms, num_cached[c], _ = pricer.terms(groups.runs[c - 1] if c else NO_HIT, None, False)
        rows[4 * c], rows[4 * c + 1] = transfer_ms, prefill_ms
        floor_ms = min(floor_ms, predicted_ttft_ms(transfer_ms, 0.0, prefill_ms))
    if floor_ms > beat_ms:
        return None, floor_ms
    slo_ms = config.tbt_slo_ms if exclude_over_tbt else None
    for c in present:
        rows[4 * c + 2] = num_prefill_chunks(request, config, num_cached[c])
        if slo_ms is not None:
            rows[4 * c + 3] = first_chunk_ms(request, config, num_cached[c])
    terms = array("d", rows)
    ready = None if decode is pool else bytes([v.ready for v in pool])
    cost = config.decode_cost
    i, best_t, queued_ms, batch_ms = _scan.cheapest_colocated(
        arrays.queued_prefill_ms, arrays.queued_prefill_tokens, queue_model(config),
        groups.decode_run_of, ready, arrays.running, arrays.load,
        arrays.kv_usage_frac, arrays.active_blocks, terms,
        (cost.step_ms_base, cost.step_ms_per_seq, cost.step_ms_per_kv_token, config.block_size_tokens),
        slo_ms, config.baton_decode_stall_weight)
    if i < 0:
        return None, math.inf
    c = groups.decode_run_of[i] + 1
    chosen = PrefillPrice(pool[i].instance_id, terms[4 * c], queued_ms, terms[4 * c + 1], num_cached[c],
                          decode_batch_ms=batch_ms)
    return chosen, best_t


def with_prices(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
                placement: Placement) -> Placement:
    """``placement`` with the priced terms of its prefill instance filled in, for the policies
    that choose without pricing (so every decision can be explained in milliseconds)."""
    if placement.policy in ("mooncake", "baton"):
        return placement
    views = {v.instance_id: v for v in snapshot.prefill + snapshot.decode}
    chosen = price(snapshot, request, config, views[placement.prefill_instance])
    return chosen.placement(placement.decode_instance, placement.policy, placement.reason)
