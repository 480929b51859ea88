"""The conductor's state and its decisions, without Ray or sockets: what the actor owns.

``ConductorState`` keeps the pools (membership, readiness, load reported by the workers), the
work the conductor itself sent and has not heard back about (prefills in flight per instance,
decodes running per instance), and the KV index. ``place`` turns that into a ``ClusterSnapshot``,
calls the policy (a pure function), prices the choice, applies admission, and books the work.
The actor (``conductor.conductor``) only feeds it: events, worker stats, completions.

The queue term Mooncake calls ``T_queue`` is the conductor's own book: the predicted time of the
prefills it placed on an instance and that have not completed, less the time the instance has
been working on them. It reacts to a burst at once, where polled worker stats would lag.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import repeat
from typing import Callable

import msgspec

from conductor import _scan
from conductor.calibration import CostCalibration, tbt_error_margin
from conductor.kv_index import KvIndex, RunGroups
from conductor.policy import (
    POLICIES,
    ROUTER_STATES,
    SERVES_WITHOUT_PREFILL_POOL,
    ClusterSnapshot,
    InstanceView,
    LoadArrays,
    Overloaded,
    PolicyConfig,
    PoolArrays,
    admit,
    with_prices,
)
from conductor.picking import decode_terms
from conductor.pricing import predicted_ttft_ms, price, queue_ms
from conductor.sessions import SessionTable
from conductor.snapshot import GroupedHits
from protos.wire import Placement, PlacementRequest

log = logging.getLogger(__name__)

MIN_OBSERVED_BYTES = 1 << 20
BANDWIDTH_EWMA = 0.3
"""Weight of the newest bandwidth observation in the priced same-node bandwidth."""
MAX_REFRESHES_PER_SNAPSHOT = 2
QUEUE_REFRESH_S = 0.005
"""How stale the decaying queue term of a busy instance may get before it is recomputed (s)."""
OVERRUN_REMAINING_FRAC = 0.1
"""An instance whose booked prefills have run past their predicted time still has work queued:
this share of it, until the engine reports them done. At zero it read as a queue of tokens
without a priced time, which the price re-prices as a whole new prefill of them: an instance
was priced busiest exactly when its prefill was about to finish (a 128 ms prefill 200 ms in
priced 128 ms of queue)."""


@dataclass
class _Prefill:
    request_id: str
    instance_id: str
    predicted_ms: float
    num_uncached_tokens: int
    block_keys: tuple[bytes, ...]
    expected_cached_blocks: int
    started_s: float
    num_prompt_tokens: int = 0
    segmented_salt: bool = False
    alone: bool = True
    """No other prefill was booked on its instance while it was in flight: its measured time is
    its own, so only then does it calibrate the prefill model (prefills that share steps each
    take the others' work too)."""
    batch_ms: float = 0.0
    """The decode batch's steps its chunks share, as priced (``Placement.decode_batch_ms``): on a
    CPU ~10% of a warm step's prefill (SmolLM2, 185 new tokens beside 3 decodes: 257 ms measured
    against 229 priced without it); the calibration takes it out of the measured time."""


@dataclass
class _Instance:
    role: str
    node_id: str
    saves_prompts: bool = False
    """Its engine saves the prompts it computes to its node's store
    (``Registration.saves_prompts``)."""
    ready: bool = False
    was_ready: bool = False
    draining: bool = False
    """Leaving the pool: finishes what it has, gets no new work (not ready in the snapshot)."""
    num_waiting_reqs: int = 0
    kv_usage_frac: float = 0.0
    prefills: dict[str, _Prefill] = field(default_factory=dict)
    """In placement order, so the first is the oldest."""
    decodes: dict[str, int] = field(default_factory=dict)
    """request id → KV blocks it will hold (prompt + max_tokens) while decoding here."""
    queued_ms: float = 0.0
    """Sum of ``predicted_ms`` over ``prefills``."""
    queued_tokens: int = 0
    queued_blocks: int = 0
    decode_blocks: int = 0
    view_at_s: float = 0.0
    last_done_s: float = 0.0
    """When the instance last finished a prefill: work before it was on other requests."""

    def add_prefill(self, prefill: _Prefill, block_size: int) -> None:
        if self.prefills:  # it shares steps with those in flight
            prefill.alone = False
            for other in self.prefills.values():
                other.alone = False
        self.prefills[prefill.request_id] = prefill
        self.queued_ms += prefill.predicted_ms
        self.queued_tokens += prefill.num_uncached_tokens
        self.queued_blocks += -(-prefill.num_uncached_tokens // block_size)

    def busy_since(self) -> float:
        """Since when it has worked on its booked prefills: the oldest one's placement, or its
        last completion if later (before that it was busy with requests gone from the book).
        Only for an instance with prefills booked."""
        oldest = next(iter(self.prefills.values()))
        return max(oldest.started_s, self.last_done_s)

    def pop_prefill(self, request_id: str, block_size: int) -> None:
        prefill = self.prefills.pop(request_id, None)
        if prefill is None:
            return
        if not self.prefills:  # no drift from repeated float subtraction
            self.queued_ms, self.queued_tokens, self.queued_blocks = 0.0, 0, 0
            return
        self.queued_ms -= prefill.predicted_ms
        self.queued_tokens -= prefill.num_uncached_tokens
        self.queued_blocks -= -(-prefill.num_uncached_tokens // block_size)


class CoalesceWait(msgspec.Struct, frozen=True):
    """Waiting for an in-flight prefill of the same blocks, priced against placing now (ms)."""

    owner: str
    """The in-flight prefill's request id."""
    instance_id: str
    """Where it runs."""
    wait_ms: float
    """Predicted time until its blocks are computed."""
    behind_ms: float
    """Predicted work that will still be queued there then (booked after it, other waiters)."""
    rest_ms: float
    """Predicted prefill of the rest of the prompt, its blocks cached."""
    now_ms: float
    """Predicted TTFT of the policy's choice now (inf: it would be rejected)."""
    now_instance: str
    """That choice's prefill instance ('' when rejected)."""
    run_keys: tuple[bytes, ...] = ()
    """The blocks of the request the owner computes: once its node's store holds them, another
    instance there can load them instead of queueing behind the owner (``pool_wait_ms``)."""
    cached_blocks: int = 0
    """The request's leading blocks cached once the owner is done (held before, and the run)."""
    duplicate_ms: float = 0.0
    """What placing now computes twice, weighed (``coalesce_duplicate_weight`` times its priced
    prefill now less ``rest_ms``): counted against placing now."""

    @property
    def total_ms(self) -> float:
        return self.wait_ms + self.behind_ms + self.rest_ms

    @property
    def wins(self) -> bool:
        """Waiting is predicted to reach the first token sooner than placing now (plus the
        weighed duplicate work placing now would add)."""
        return self.total_ms < self.now_ms + self.duplicate_ms

    def describe(self) -> str:
        verdict = "<" if self.wins else ">="
        duplicate = f" + duplicate {self.duplicate_ms:.1f}" if self.duplicate_ms else ""
        return (f"coalesce on {self.owner} at {self.instance_id}: wait {self.wait_ms:.1f} + queue "
                f"{self.behind_ms:.1f} + prefill {self.rest_ms:.1f} = {self.total_ms:.1f} ms "
                f"{verdict} now {self.now_ms:.1f}{duplicate} ms at "
                f"{self.now_instance or 'none (rejected)'}")


class PlacementCounters(msgspec.Struct):
    placed: int = 0
    rejected: int = 0
    coalesced: int = 0
    queued_behind: int = 0
    """Of ``coalesced``, the requests placed at once behind the prefill they coalesced on
    (``ConductorState.place_behind``)."""
    coalesce_declined: int = 0
    """Requests that could have waited for an in-flight prefill of their blocks and were placed
    at once, because waiting was priced slower (``ConductorState.coalesce_wait``)."""
    pool_waits: int = 0
    """Coalesced requests that then waited for the blocks to reach the owner's store, so that
    another instance could load them (``Conductor._wait_for_pool``)."""
    pooled: int = 0
    """Of those, the ones whose blocks reached the store within the wait."""
    colocated: int = 0
    pulled: int = 0
    index_corrections: int = 0
    by_prefill_instance: dict[str, int] = msgspec.field(default_factory=dict)


def _colocated(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
               placement: Placement) -> Placement:
    """``placement`` moved onto its decode instance, priced there: for a request that must be
    computed where it is decoded (``PlacementRequest.colocate``)."""
    view = next(v for v in snapshot.decode if v.instance_id == placement.decode_instance)
    chosen = price(snapshot, request, config, view)
    return chosen.placement(view.instance_id, placement.policy,
                            f"colocated: its prompt's log-probabilities are computed where it is "
                            f"decoded; {chosen.describe()}; the policy chose {placement.reason}")


class ConductorState:
    """Pools + in-flight books + KV index → placements. Single-threaded by contract."""

    def __init__(self, policy: str, config: PolicyConfig, index: KvIndex | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 calibration: CostCalibration | None = None) -> None:
        self._policy_name = policy
        self._policy = POLICIES[policy]
        self.config = config
        self.index = index if index is not None else KvIndex()
        self._clock = clock
        self._instances: dict[str, _Instance] = {}
        self._views: dict[str, InstanceView] = {}
        self._pools: dict[str, tuple[InstanceView, ...] | None] = {"prefill": None, "decode": None}
        self._prefills: dict[str, _Prefill] = {}
        self._decodes: dict[str, str] = {}
        self._pool_lists: dict[str, list[InstanceView]] = {}
        """Each pool's views in instance-id order (rebuilt when membership changes)."""
        self._busy: OrderedDict[str, None] = OrderedDict()
        """Instances with prefills in flight, least recently refreshed first."""
        self._arrays: dict[str, PoolArrays | LoadArrays | None] = {"prefill": None, "decode": None}
        """The prefill pool's queue terms (``PoolArrays``) and the decode pool's loads, queues
        and batches (``LoadArrays``) as arrays, patched with the views."""
        self._arrays_snapshot: dict[str, PoolArrays | LoadArrays | None] = {}
        self._unready: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        """Per role, the instances whose view is not ready (most of the time: none)."""
        self._ready_pools: dict[str, tuple[InstanceView, ...]] = {}
        self._pool_index: dict[str, tuple[int, int]] = {}
        """Instance id → (0 prefill / 1 decode, its index in that pool's list); replaced, never
        changed, once a snapshot holds it."""
        self._bit_where: tuple[array, array, tuple[memoryview, memoryview]] | None = None
        """Per index bit, its pool (0 prefill, 1 decode, -1 none) and position there, as two
        int64 arrays, and each pool's all-miss run array (``_grouped``); rebuilt after a
        membership change."""
        self._inflight_keys: dict[bytes, str] = {}
        """Block key → the in-flight prefill computing it (the first one placed)."""
        self._held_ms: dict[str, list[float]] = {}
        """Instance → predicted prefill time of each request waiting to coalesce there
        (``hold``): work that will join its queue when the prefill they wait for ends."""
        self.counters = PlacementCounters()
        make_router_state = ROUTER_STATES.get(policy)
        self.router_state = make_router_state(config) if make_router_state is not None else None
        """What the policy learns from its own choices (``ROUTER_STATES``), or None."""
        self._loads_seen: dict[str, tuple[int, float]] = {}
        self.calibration = calibration
        """Refits the prefill model from measured prefills (``prefill_done``'s ``prefill_ms``),
        or None: the configured model stays."""
        self.sessions = SessionTable(clock)
        """Live agent sessions: each one's last placement, prefix and pauses."""
        self._session_of: dict[str, str] = {}
        """Request id → the session it is a step of (requests that name one)."""
        self._handoff_transfer_ms: dict[str, float] = {}
        """Request id → the priced transfer of its KV hand-off (the priced hand-off less the
        overhead in force), for disaggregated placements that priced one."""

    # ------------------------------------------------------------------ membership and load

    def register(self, instance_id: str, role: str, node_id: str, model_id: str, kv_layout: str,
                 saves_prompts: bool = False) -> None:
        assert role in ("prefill", "decode"), role
        self._instances[instance_id] = _Instance(role, node_id, saves_prompts)
        self._membership_changed(instance_id)
        self.index.add_instance(instance_id, node_id, model_id, kv_layout)
        self._refresh_view(instance_id)

    def remove(self, instance_id: str) -> None:
        inst = self._instances.pop(instance_id, None)
        if inst is None:
            return
        for request_id in list(inst.prefills):
            self.prefill_done(request_id, None)
        for request_id in list(inst.decodes):
            self.finished(request_id)
        self._views.pop(instance_id, None)
        self._busy.pop(instance_id, None)
        self._membership_changed(instance_id)
        self.index.remove_instance(instance_id)
        if self.router_state is not None:
            self.router_state.remove_worker(instance_id)

    def _membership_changed(self, instance_id: str) -> None:
        """Both pools are rebuilt (lists, positions, arrays) at the next snapshot."""
        for role in ("prefill", "decode"):
            self._unready[role].discard(instance_id)
            self._pools[role] = None
        self._pool_lists.clear()
        self._pool_index = {}  # a new one: snapshots keep the old
        self._bit_where = None

    def set_ready(self, instance_id: str, ready: bool) -> None:
        inst = self._instances[instance_id]
        inst.was_ready |= ready
        if inst.ready != ready:
            inst.ready = ready
            if not ready:  # whatever its stream said can no longer be trusted
                self.index.clear_instance(instance_id)
            self._refresh_view(instance_id)

    def update_load(self, instance_id: str, num_waiting_reqs: int, kv_usage_frac: float) -> None:
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.num_waiting_reqs, inst.kv_usage_frac = num_waiting_reqs, kv_usage_frac
            self._refresh_view(instance_id)

    def set_draining(self, instance_id: str) -> None:
        """Place nothing more on ``instance_id``; what is booked there runs to its end."""
        self._instances[instance_id].draining = True
        self._refresh_view(instance_id)

    def in_flight_on(self, instance_id: str) -> tuple[int, int]:
        """(prefills, decodes) booked on ``instance_id`` and not yet reported done."""
        inst = self._instances.get(instance_id)
        return (len(inst.prefills), len(inst.decodes)) if inst is not None else (0, 0)

    def requests_on(self, instance_id: str) -> set[str]:
        """Requests with a prefill or a decode booked on ``instance_id`` (a colocated request
        has both and counts once)."""
        inst = self._instances.get(instance_id)
        return set(inst.prefills) | set(inst.decodes) if inst is not None else set()

    def observe_loads(self, instance_id: str, loaded_bytes: int, load_seconds: float) -> None:
        """Fold an instance's cumulative same-node load counters into the priced bandwidth.

        The transfer term then follows the bandwidth the connectors really get (an EWMA over
        polls that moved at least ``MIN_OBSERVED_BYTES``), so the pull-or-recompute threshold
        moves with it."""
        last = self._loads_seen.get(instance_id, (0, 0.0))
        self._loads_seen[instance_id] = (loaded_bytes, load_seconds)
        num_bytes, seconds = loaded_bytes - last[0], load_seconds - last[1]
        if num_bytes < MIN_OBSERVED_BYTES or seconds <= 0:
            return
        link = self.config.transfer.same_node
        measured = num_bytes / seconds
        updated = link.model_copy(update={
            "bytes_per_s": (1 - BANDWIDTH_EWMA) * link.bytes_per_s + BANDWIDTH_EWMA * measured})
        self.config = self.config.model_copy(
            update={"transfer": self.config.transfer.model_copy(update={"same_node": updated})})

    def is_instance_ready(self, instance_id: str) -> bool:
        inst = self._instances.get(instance_id)
        return inst is not None and inst.ready

    def was_ever_ready(self, instance_id: str) -> bool:
        inst = self._instances.get(instance_id)
        return inst is not None and inst.was_ready

    def is_ready(self) -> bool:
        """A decode instance is ready, and a prefill instance too unless the prefill pool is
        empty and the policy prefills on decode instances (``SERVES_WITHOUT_PREFILL_POOL``)."""
        roles = {i.role for i in self._instances.values() if i.ready}
        if "decode" not in roles:
            return False
        return "prefill" in roles or (
            self._policy_name in SERVES_WITHOUT_PREFILL_POOL
            and all(i.role != "prefill" for i in self._instances.values()))

    def instance_ids(self, role: str | None = None) -> list[str]:
        return sorted(i for i, inst in self._instances.items() if role in (None, inst.role))

    def role_of(self, instance_id: str) -> str | None:
        """'prefill' or 'decode'; None for an instance not (or no longer) registered."""
        inst = self._instances.get(instance_id)
        return inst.role if inst is not None else None

    def node_of(self, instance_id: str) -> str:
        """The store node of a registered instance ('' for one not or no longer registered)."""
        inst = self._instances.get(instance_id)
        return inst.node_id if inst is not None else ""

    # ------------------------------------------------------------------ snapshot

    @staticmethod
    def _queued_ms(inst: _Instance, now: float) -> float:
        """Predicted work queued, less what the instance has done on it (since ``busy_since``),
        never under ``OVERRUN_REMAINING_FRAC`` of it while it is booked."""
        if not inst.prefills:
            return 0.0
        left_ms = inst.queued_ms - (now - inst.busy_since()) * 1000.0
        return max(OVERRUN_REMAINING_FRAC * inst.queued_ms, left_ms)

    def _refresh_view(self, instance_id: str, now: float | None = None) -> None:
        inst = self._instances[instance_id]
        now = self._clock() if now is None else now
        inst.view_at_s = now
        if instance_id in self._busy:
            self._busy.move_to_end(instance_id)
        # positional, in InstanceView's field order: keyword parsing was a visible share of this
        self._views[instance_id] = view = InstanceView(
            instance_id,
            self._num_running(inst),  # num_running_reqs
            inst.num_waiting_reqs,
            inst.ready and not inst.draining,  # ready
            inst.queued_tokens,  # num_queued_prefill_tokens
            self._queued_ms(inst, now) if inst.prefills else 0.0,  # queued_prefill_ms
            inst.decode_blocks + inst.queued_blocks,  # num_active_decode_blocks
            inst.kv_usage_frac,
            self.index.num_device_blocks(instance_id),  # num_cached_blocks
            inst.node_id,
        )
        where = self._pool_index.get(instance_id)
        if where is not None:  # patch the pool in place; membership is unchanged
            position = where[1]
            self._pool_lists[inst.role][position] = view
            arrays = self._arrays[inst.role]
            if arrays is not None:
                arrays.patch(position, view)
        if view.ready:
            self._unready[inst.role].discard(instance_id)
        else:
            self._unready[inst.role].add(instance_id)
        self._pools[inst.role] = None

    @staticmethod
    def _num_running(inst: _Instance) -> int:
        """Requests booked on ``inst``: a co-located request has a prefill and a decode booked
        there and is one request (counted twice, it priced the decode batch one sequence too
        big for every prefill in flight)."""
        both = sum(1 for request_id in inst.prefills if request_id in inst.decodes) if inst.decodes else 0
        return len(inst.prefills) + len(inst.decodes) - both

    def snapshot(self, prefix_hits: dict | RunGroups | None = None, private: bool = False) -> ClusterSnapshot:
        """The pools now. A snapshot is the caller's to keep: later changes do not reach it.
        ``private`` (``place``, which hands it to a pure policy and drops it before changing
        anything) skips copying the arrays, which later patches would otherwise reach.
        ``prefix_hits`` from ``KvIndex.prefix_run_groups`` become ``GroupedHits``."""
        now = self._clock()
        stale_before = now - QUEUE_REFRESH_S
        # Busy instances' queue term decays with time: refresh the stalest two, so one decision
        # never pays for the whole fleet (the rest are at most a few decisions staler).
        for _ in range(min(len(self._busy), MAX_REFRESHES_PER_SNAPSHOT)):
            instance_id = next(iter(self._busy))
            if self._instances[instance_id].view_at_s >= stale_before:
                break
            self._refresh_view(instance_id, now)
        for pool_code, role in enumerate(("prefill", "decode")):
            if self._pools[role] is None:
                views = self._pool_lists.get(role)
                if views is None:  # membership changed: rebuild the pool in instance-id order
                    ids = self.instance_ids(role)
                    views = self._pool_lists[role] = [self._views[i] for i in ids]
                    self._pool_index.update({i: (pool_code, n) for n, i in enumerate(ids)})
                    self._arrays[role] = (PoolArrays.of(views) if role == "prefill"
                                          else LoadArrays.of(views))
                pool = self._pools[role] = tuple(views)
                self._ready_pools[role] = (tuple(v for v in pool if v.ready) if self._unready[role]
                                           else pool)
                self._arrays_snapshot[role] = None  # copied when a kept snapshot needs it
        arrays = {}
        for role in ("prefill", "decode"):
            if private:
                arrays[role] = self._arrays[role]
            else:  # the snapshot's own copy: later patches do not reach it
                if self._arrays_snapshot.get(role) is None:
                    self._arrays_snapshot[role] = self._arrays[role].copy()
                arrays[role] = self._arrays_snapshot[role]
        if isinstance(prefix_hits, RunGroups):
            prefix_hits = self._grouped(prefix_hits)
        # the pool index is replaced, never changed, once a snapshot holds it
        return ClusterSnapshot(self._pools["prefill"], self._pools["decode"], self.counters.placed,
                               prefix_hits if prefix_hits is not None else {}, arrays["prefill"],
                               self._ready_pools["prefill"], self._ready_pools["decode"],
                               arrays["decode"], self._pool_index, self.router_state)

    def _grouped(self, groups: RunGroups) -> GroupedHits:
        """The index's holders by run as ``GroupedHits`` over the current pools (one C pass,
        ``conductor._scan.pool_runs``: no Python work per holder)."""
        if self._bit_where is None:
            where = [(self.index.bit_of(i), code, n) for i, (code, n) in self._pool_index.items()]
            size = 1 + max((b for b, _, _ in where if b is not None), default=-1)
            pool_of, position_of = array("q", [-1]) * size, array("q", [0]) * size
            for bit, code, n in where:
                if bit is not None:
                    pool_of[bit], position_of[bit] = code, n
            no_runs = tuple(memoryview(array("q", [-1]) * len(self._pools[role])).toreadonly()
                            for role in ("prefill", "decode"))
            self._bit_where = (pool_of, position_of, no_runs)
        prefill, decode = self._pools["prefill"], self._pools["decode"]
        pool_of, position_of, no_runs = self._bit_where
        if not groups.runs:  # no holder: the pools' shared all-miss arrays (read-only)
            return GroupedHits((), no_runs[0], no_runs[1], prefill, decode, self._pool_index)
        runs = _scan.pool_runs(groups.bits, groups.run_of, pool_of, position_of, len(prefill), len(decode))
        return GroupedHits(groups.runs, memoryview(runs[0]).cast("q"), memoryview(runs[1]).cast("q"),
                           prefill, decode, self._pool_index)

    def _prefix_hits(self, keys: tuple[bytes, ...]) -> dict | RunGroups:
        """What the index holds of ``keys``: grouped by run from a ``KvIndex``, plain from an
        index that only answers ``prefix_hits`` (the simulator's)."""
        if not keys:
            return {}
        if isinstance(self.index, KvIndex):
            return self.index.prefix_run_groups(keys)
        return self.index.prefix_hits(keys)

    # ------------------------------------------------------------------ decisions

    def place(self, request: PlacementRequest) -> Placement:
        """Choose, price, admit and book one request; ``Overloaded`` or ``NoWorkerReady`` if not."""
        hits = self._prefix_hits(request.block_keys)
        if self.router_state is not None:
            self.router_state.maintain(self._clock())
        snapshot = self.snapshot(hits, private=True)
        try:
            placement = self._policy(snapshot, request, self.config)
            if request.colocate and placement.prefill_instance != placement.decode_instance:
                placement = _colocated(snapshot, request, self.config, placement)
            placement = with_prices(snapshot, request, self.config, placement)
            admit(snapshot, request, self.config, placement)
        except Overloaded:
            self.counters.rejected += 1
            raise
        if placement.prefill_instance == placement.decode_instance and not placement.pulled_from:
            hit = snapshot.hit(placement.prefill_instance)
            placement = msgspec.structs.replace(placement, device_blocks=hit.num_blocks_device)
        self._placed(request, placement)
        return placement

    def _placed(self, request: PlacementRequest, placement: Placement) -> None:
        """Book an admitted placement and note it where it is followed (session, router)."""
        self._book(request, placement)
        if request.session_id:
            self.sessions.step(request.session_id, request.block_keys, request.session_ttl_s,
                               request.expected_next_step_s)
            self.sessions.placed(request.session_id, placement.prefill_instance,
                                 placement.decode_instance)
            self._session_of[request.request_id] = request.session_id
        if self.router_state is not None:
            self.router_state.record(request.block_keys, placement.prefill_instance)
        log.debug("placed %s: prefill=%s decode=%s T=transfer %.1f + queue %.1f + prefill %.1f ms; %s",
                  request.request_id, placement.prefill_instance, placement.decode_instance,
                  placement.transfer_ms, placement.queue_ms, placement.prefill_ms, placement.reason)

    def _book(self, request: PlacementRequest, placement: Placement) -> None:
        if request.request_id in self._decodes or request.request_id in self._prefills:
            # placed again (a continuation, a retried prefill) before the end of its earlier
            # placement reached us: that one is over, close its books first
            self.finished(request.request_id)
        c = self.counters
        c.placed += 1
        c.by_prefill_instance[placement.prefill_instance] = c.by_prefill_instance.get(
            placement.prefill_instance, 0) + 1
        c.colocated += placement.prefill_instance == placement.decode_instance
        c.pulled += bool(placement.pulled_from)
        bs = self.config.block_size_tokens
        cached_tokens = min(placement.expected_cached_blocks * bs, request.num_prompt_tokens)
        prefill = _Prefill(
            request.request_id, placement.prefill_instance,
            placement.transfer_ms + placement.prefill_ms, request.num_prompt_tokens - cached_tokens,
            request.block_keys, placement.expected_cached_blocks, self._clock(),
            request.num_prompt_tokens, request.segmented_salt, batch_ms=placement.decode_batch_ms,
        )
        self._instances[placement.prefill_instance].add_prefill(prefill, bs)
        self._busy[placement.prefill_instance] = None
        self._prefills[request.request_id] = prefill
        # the first placed prefill of a key owns it; deque(maxlen=0) runs the map in C
        deque(map(self._inflight_keys.setdefault, request.block_keys[placement.expected_cached_blocks:],
                  repeat(request.request_id)), maxlen=0)
        decode = self._instances[placement.decode_instance]
        num_blocks = -(-(request.num_prompt_tokens + request.max_tokens) // bs)
        decode.decodes[request.request_id] = num_blocks
        decode.decode_blocks += num_blocks
        self._decodes[request.request_id] = placement.decode_instance
        if placement.handoff_ms and placement.prefill_instance != placement.decode_instance:
            self._handoff_transfer_ms[request.request_id] = max(
                0.0, placement.handoff_ms - self.config.handoff_overhead_ms)
        self._refresh_view(placement.prefill_instance)
        if placement.decode_instance != placement.prefill_instance:  # co-located: refreshed already
            self._refresh_view(placement.decode_instance)

    def coalesce_wait(self, request: PlacementRequest, min_blocks: int,
                      duplicate_weight: float = 0.0) -> CoalesceWait | None:
        """Waiting for the in-flight prefill computing at least ``min_blocks`` of this request's
        blocks right past what the index already holds, priced against placing now: None when
        there is no such prefill. Its ``wins`` says whether to wait.

        The wait is the owner's predicted time left on its instance's queue book (what is
        booked before it, and it, less what the instance has done since it started on them).
        After it, the request prefills there behind what is booked after the owner and what
        other waiters will add (``hold``), with the owner's blocks cached. Placing now is the
        policy's own priced choice on this snapshot, with nothing booked (an ``Overloaded``
        choice costs infinity: waiting is then the only way in), plus ``duplicate_weight``
        times the prefill it would compute beyond the rest (``CoalesceWait.duplicate_ms``)."""
        keys = request.block_keys
        if not keys or not self._inflight_keys:
            return None
        hits = self._prefix_hits(keys)
        runs = hits.runs if isinstance(hits, RunGroups) else hits.values()
        start = max((h.num_blocks for h in runs), default=0)
        owner = self._inflight_keys.get(keys[start]) if start < len(keys) else None
        if owner is None:
            return None
        run = 0
        for key in keys[start:]:
            if self._inflight_keys.get(key) != owner:
                break
            run += 1
        prefill = self._prefills.get(owner)
        inst = self._instances.get(prefill.instance_id) if prefill is not None else None
        if run < min_blocks or inst is None:
            return None
        now = self._clock()
        ahead_ms = 0.0
        for other in inst.prefills.values():
            ahead_ms += other.predicted_ms
            if other.request_id == owner:
                break
        wait_ms = max(0.0, ahead_ms - (now - inst.busy_since()) * 1000.0)
        held_ms = sum(self._held_ms.get(prefill.instance_id, ()))
        behind_ms = max(0.0, inst.queued_ms - ahead_ms) + held_ms
        cached_tokens = min((start + run) * self.config.block_size_tokens, request.num_prompt_tokens)
        rest_ms = self.config.prefill_cost.t_prefill_ms(request.num_prompt_tokens - cached_tokens,
                                                        cached_tokens)
        snapshot = self.snapshot(hits, private=True)
        try:
            now_placement = with_prices(snapshot, request, self.config,
                                        self._policy(snapshot, request, self.config))
            admit(snapshot, request, self.config, now_placement)
            now_ms = predicted_ttft_ms(now_placement.transfer_ms, now_placement.queue_ms,
                                       now_placement.prefill_ms)
            now_instance = now_placement.prefill_instance
            duplicate_ms = duplicate_weight * max(0.0, now_placement.prefill_ms - rest_ms)
        except Overloaded:
            now_ms, now_instance, duplicate_ms = float("inf"), "", 0.0
        return CoalesceWait(owner, prefill.instance_id, wait_ms, behind_ms, rest_ms, now_ms,
                            now_instance, tuple(keys[start:start + run]), start + run, duplicate_ms)

    def place_behind(self, request: PlacementRequest, wait: CoalesceWait,
                     elsewhere: bool = False) -> Placement | None:
        """Place ``request``, which coalesces on ``wait`` (``wait.wins``), at once on the
        owner's instance, queued right behind what is booked there: when that instance is a
        ready decode instance whose engine computes one prompt at a time
        (``PolicyConfig.prompts_at_once`` 1), its gate starts the request after the owner's
        prompt, with the owner's blocks computed. Priced as the wait was (the owner's wait, the
        queue behind it, the rest of the prompt) and booked like any placement. None where that
        does not hold (the caller waits in the conductor instead), where admission refuses it,
        or, with ``elsewhere`` (``ConductorConfig.coalesce_elsewhere``), where loading the
        owner's blocks on another instance once they reach the store is priced faster
        (``_elsewhere_ms``: the caller's wait then ends in ``pool_wait_ms``)."""
        inst = self._instances.get(wait.instance_id)
        owner = self._prefills.get(wait.owner)
        if (self.config.prompts_at_once != 1 or inst is None or inst.role != "decode"
                or not inst.ready or inst.draining or owner is None
                or owner.instance_id != wait.instance_id):
            return None
        snapshot = self.snapshot(self._prefix_hits(request.block_keys), private=True)
        view = next((v for v in snapshot.decode if v.instance_id == wait.instance_id), None)
        if view is None or (elsewhere and self._elsewhere_ms(snapshot, inst, wait) < wait.total_ms):
            return None
        placement = Placement(
            wait.instance_id, wait.instance_id, self._policy_name,
            f"queued behind {wait.owner}: {wait.describe()}; {decode_terms(view)}",
            queue_ms=wait.wait_ms + wait.behind_ms, prefill_ms=wait.rest_ms,
            expected_cached_blocks=wait.cached_blocks, priority=-wait.cached_blocks,
            device_blocks=wait.cached_blocks)
        try:
            admit(snapshot, request, self.config, placement)
        except Overloaded:
            return None
        self.counters.queued_behind += 1
        self._placed(request, placement)
        return placement

    def _elsewhere_ms(self, snapshot: ClusterSnapshot, inst: _Instance, wait: CoalesceWait) -> float:
        """The least predicted TTFT of waiting for ``wait``'s owner and then loading its blocks
        from the node's store on another ready decode instance of that node (its queue now,
        and not before the owner is done, then the load of what it lacks, then the rest of the
        prompt); inf when the owner's engine does not save its prompts or there is none."""
        if not inst.saves_prompts or not inst.node_id:
            return math.inf
        block_bytes = self.config.block_size_tokens * self.config.kv_bytes_per_token
        best = math.inf
        for view in snapshot.decode:
            if view.instance_id == wait.instance_id or not view.ready or view.node_id != inst.node_id:
                continue
            moved = max(0, wait.cached_blocks - snapshot.hit(view.instance_id).num_blocks)
            best = min(best, max(wait.wait_ms, queue_ms(view, self.config))
                       + self.config.transfer.t_transfer_ms(moved * block_bytes, "same_node")
                       + wait.rest_ms)
        return best

    def pool_wait_ms(self, wait: CoalesceWait) -> float:
        """After the owner of ``wait`` finished: how long the waiter may wait for the owner's
        blocks to reach its node's store, 0 when not worth it. Placing now puts every waiter on
        the owner's instance, the only one that holds the blocks yet, each behind the ones
        placed before it; once the store holds them, another ready instance on that node can
        load them instead. Worth waiting when the owner's engine saves its prompts, such an
        instance exists, the store does not hold the blocks yet, and the owner's instance has
        work queued: at most that queue, what placing on it now would wait anyway."""
        inst = self._instances.get(wait.instance_id)
        if (inst is None or not inst.saves_prompts or not inst.node_id or not wait.run_keys
                or not inst.prefills):
            return 0.0
        if not any(other is not inst and other.ready and not other.draining
                   and other.node_id == inst.node_id
                   for other in self._instances.values()):
            return 0.0
        if self.index.node_holds(inst.node_id, wait.run_keys):
            return 0.0
        return self._queued_ms(inst, self._clock())

    def pool_holds(self, wait: CoalesceWait) -> bool:
        """Whether the store of the owner's node holds the blocks ``wait`` waited for."""
        return self.index.node_holds(self.node_of(wait.instance_id), wait.run_keys)

    def hold(self, wait: CoalesceWait) -> None:
        """A request waits on ``wait``: later waits for its instance price its prefill behind."""
        self._held_ms.setdefault(wait.instance_id, []).append(wait.rest_ms)

    def release(self, wait: CoalesceWait) -> None:
        """The request ``hold`` counted stopped waiting (placed or given up)."""
        held = self._held_ms.get(wait.instance_id)
        if held is not None:
            held.remove(wait.rest_ms)
            if not held:
                del self._held_ms[wait.instance_id]

    def observe_warmup(self, samples) -> None:
        """An engine's warm-up prefills (``Registration.warmup_prefills``): the calibration's
        first fit while no profile or live refit has replaced the placeholders."""
        if self.calibration is not None and samples and self.calibration.warm_start(samples):
            self.config = self.config.model_copy(update={"prefill_cost": self.calibration.prefill})
            log.info("prefill cost model fitted on %d warm-up prefills: %s", len(samples),
                     self.calibration.prefill)

    def prefill_done(self, request_id: str, num_cached_tokens: int | None,
                     prefill_ms: float | None = None) -> None:
        """The prefill of ``request_id`` finished (``num_cached_tokens`` as the engine reported)
        or failed (None). Its blocks now sit in the instance's device cache; where the index
        promised more cached blocks than the engine found, the index was stale for that
        instance and loses those entries. ``prefill_ms``, the time the prefill took, feeds the
        calibration when there is one (a refit replaces the priced prefill model)."""
        prefill = self._prefills.pop(request_id, None)
        if prefill is None:
            return
        if (self.calibration is not None and prefill_ms is not None and num_cached_tokens is not None
                and prefill.num_prompt_tokens and prefill.alone):
            cached = min(num_cached_tokens, prefill.num_prompt_tokens)
            if self.calibration.observe_prefill(prefill.num_prompt_tokens - cached, cached, prefill_ms,
                                                prefill.batch_ms):
                self.config = self.config.model_copy(update={"prefill_cost": self.calibration.prefill})
        inst = self._instances.get(prefill.instance_id)
        if inst is not None:
            inst.pop_prefill(request_id, self.config.block_size_tokens)
            inst.last_done_s = self._clock()
            if not inst.prefills:
                self._busy.pop(prefill.instance_id, None)
        for key in prefill.block_keys[prefill.expected_cached_blocks:]:
            if self._inflight_keys.get(key) == request_id:
                del self._inflight_keys[key]
        if inst is None:
            return
        if num_cached_tokens is not None and not prefill.segmented_salt:
            bs = self.config.block_size_tokens
            found_blocks = num_cached_tokens // bs
            # vLLM always recomputes the last prompt token, so a full hit reads one block short.
            if found_blocks + 1 < prefill.expected_cached_blocks:
                self.counters.index_corrections += 1
                log.warning("index said %s holds %d blocks of %s; the engine found %d: dropping "
                            "the stale entries", prefill.instance_id, prefill.expected_cached_blocks,
                            request_id, found_blocks)
                self.index.forget_device_blocks(
                    prefill.instance_id, prefill.block_keys[found_blocks:prefill.expected_cached_blocks])
            self.index.note_device_blocks(prefill.instance_id, prefill.block_keys)
        self._refresh_view(prefill.instance_id)

    def observe_decode_steps(self, steps, instance_id: str = "", spans=(), mixed_steps=()) -> None:
        """An instance's timed decode-only steps (``InstanceStats.decode_steps``) feed the
        calibration when there is one, its mixed steps (``mixed_steps``) are judged, and its
        finished requests' spans of them (``decode_spans``) give the per-request errors; a
        refit replaces the priced decode-step model (admission's TBT and the co-located
        prefill's batch term use it), as ``prefill_done`` does for prefill."""
        if self.calibration is None:
            return
        for step in steps:
            if self.calibration.observe_decode_step(step.num_seqs, step.context_tokens, step.step_ms,
                                                    instance_id, step.seq):
                self.config = self.config.model_copy(update={"decode_cost": self.calibration.decode})
        block_bytes = self.config.block_size_tokens * self.config.kv_bytes_per_token
        for step in mixed_steps:  # blocks copied in on the step: priced as a same-node transfer
            copy_ms = self.config.transfer.t_transfer_ms(step.loaded_blocks * block_bytes, "same_node")
            self.calibration.observe_mixed_step(step.num_seqs, step.context_tokens, step.chunks,
                                                step.step_ms, instance_id, step.seq, copy_ms)
        for span in spans:  # after the steps: a span names steps of this report or earlier ones
            self.calibration.observe_decode_span(instance_id, span.first_seq, span.last_seq)
        margin = tbt_error_margin(self.calibration.decode_error())
        if abs(margin - self.config.tbt_error_frac) >= 0.01:
            self.config = self.config.model_copy(update={"tbt_error_frac": margin})

    def finished(self, request_id: str, handoff_ms: float | None = None) -> None:
        """The request is over (streamed to the end, failed, or cancelled). ``handoff_ms``: how
        long its KV hand-off took, from its prefill's result to the decode's first token (None:
        co-located, or not measured); it calibrates the priced hand-off's overhead when there is
        a calibration and its placement priced a hand-off."""
        self.prefill_done(request_id, None)
        transfer_ms = self._handoff_transfer_ms.pop(request_id, None)
        if (self.calibration is not None and handoff_ms is not None and transfer_ms is not None
                and self.calibration.observe_handoff(handoff_ms, transfer_ms)):
            self.config = self.config.model_copy(
                update={"handoff_overhead_ms": self.calibration.handoff_overhead_ms})
            log.info("KV hand-off overhead now %.1f ms (median of measured hand-offs)",
                     self.calibration.handoff_overhead_ms)
        session_id = self._session_of.pop(request_id, None)
        if session_id is not None:
            self.sessions.finished(session_id)
        instance_id = self._decodes.pop(request_id, None)
        inst = self._instances.get(instance_id) if instance_id else None
        if inst is not None:
            inst.decode_blocks -= inst.decodes.pop(request_id, 0)
            self._refresh_view(instance_id)

    def num_in_flight(self) -> tuple[int, int]:
        """(prefills, decodes) the conductor has placed and not heard the end of."""
        return len(self._prefills), len(self._decodes)
