"""The discrete-event simulation of one fleet serving one trace under one placement policy.

Placement is the live conductor's own code: a ``ConductorState`` (its in-flight books, the
snapshot it builds, ``POLICIES[name]``, ``with_prices``, ``admit``) reading a KV index that the
simulated caches keep exact (``SimKvIndex``), on a clock the simulation sets. Worker stats
(waiting requests, KV use) reach it every ``stats_interval_ms``, as the live conductor polls them.
The placement is then carried out by the simulated mechanism: the prefill instance loads its
local prefix (own device, then its node's host and disk tiers), pulls the rest of the prefix from
``placement.pulled_from``, computes the remainder, writes every block to its node's store, and
hands the KV to the decode instance, which batches. A block is visible (in a cache, so in the
index) only once the prefill computing it, or the pull bringing it, has ended.

In-flight coalescing, for the policies in ``FleetConfig.coalesce_policies``, is the live
conductor's: a request whose next blocks an in-flight prefill is computing
waits for that prefill to end, or for ``coalesce_max_wait_ms``, when waiting is priced faster
than placing now (``ConductorState.coalesce_wait``), and is placed then; its TTFT counts the
wait. The live conductor's other form, queueing the request at once behind that prefill on an
engine that computes one prompt at a time (``ConductorState.place_behind``), is not simulated:
the simulated fleet's ``PolicyConfig.prompts_at_once`` stays 0.

Prefill and transfer times are the ``price`` the policies predict with, evaluated on the caches
as they are when the prefill starts (the queue in between may change them), times a seeded
per-request error factor (``simulator.prediction_error``; 1 when ``prediction_error`` is 0).
Transfers do not contend for links.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import Any, Callable, NamedTuple

import numpy as np

from conductor.cost_model import CostProfile
from conductor.policy import (
    POLICIES,
    ClusterSnapshot,
    Overloaded,
    PolicyConfig,
    PrefixHit,
    price,
)
from conductor.state import CoalesceWait, ConductorState
from protos.errors import BatonError
from protos.wire import PlacementRequest
from simulator.cache import BlockIndex, DeviceCache, NodeStore
from simulator.fleet import FleetConfig
from simulator.instances import DecodeInstance, Instance, Job, PrefillInstance, Seq
from simulator.prediction_error import error_factors
from simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest, ceiling_hit_ratio


class SimulationError(BatonError):
    """A policy returned a placement the simulated mechanism cannot carry out."""


class Workload:
    """A trace made ready to replay: per-request arrays shared by every simulation of it."""

    def __init__(self, requests: list[TraceRequest], name: str = "trace") -> None:
        self.name = name
        self.block_size_tokens = TRACE_BLOCK_TOKENS
        self.arrival_ms = [r.timestamp for r in requests]
        self.keys = [tuple(k.to_bytes(8, "little", signed=True) for k in r.hash_ids) for r in requests]
        """Block keys: the hash ids as 8 bytes, what ``PlacementRequest.block_keys`` carries."""
        self.num_prompt_tokens = [r.input_length for r in requests]
        self.num_output_tokens = [max(1, r.output_length) for r in requests]
        """A request with no output still produces its first token."""
        self.placement_requests = [
            PlacementRequest(f"req-{i}", r.input_length, keys, max_tokens=output)
            for i, (r, keys, output) in enumerate(zip(requests, self.keys, self.num_output_tokens))
        ]
        self.num_private_blocks = [
            max(0, math.ceil((p + o) / TRACE_BLOCK_TOKENS) - len(k))
            for p, o, k in zip(self.num_prompt_tokens, self.num_output_tokens, self.keys)
        ]
        self.num_blocks = sum(len(k) for k in self.keys)
        self.ceiling_hit_ratio = ceiling_hit_ratio(requests)

    def __len__(self) -> int:
        return len(self.arrival_ms)


def policy_config(fleet: FleetConfig, profile: CostProfile, block_size_tokens: int) -> PolicyConfig:
    """The PolicyConfig a live conductor with this profile and these SLOs would run with."""
    fields: dict[str, Any] = dict(
        block_size_tokens=block_size_tokens, kv_bytes_per_token=profile.kv_bytes_per_token,
        prefill_cost=profile.prefill, transfer=profile.transfer, decode_cost=profile.decode,
        ttft_slo_ms=fleet.ttft_slo_ms if fleet.admission else None,
        tbt_slo_ms=fleet.tbt_slo_ms if fleet.admission else None,
    )
    fields.update(fleet.policy_overrides)
    return PolicyConfig(**fields)


WARM_PRIORITY = 1 << 40
"""Queue priority of a rejected request prefilled only for its KV: after every placed one."""
WARM_CHUNK_BLOCKS = 8
"""Such a prefill runs in chunks of this many blocks, each queued again behind placed work
(chunked prefill under priority scheduling), so it delays a placed request by one chunk at most."""


def _instance_order(inst: Instance) -> int:
    return inst.idx


class PrefillTimes(NamedTuple):
    """What one prefill takes once it starts (ms): its prefix load, then its compute."""

    load_ms: float
    """The local prefix from the host and disk tiers plus the pull from the placement's source."""
    compute_ms: float
    """The prompt past the cached blocks."""

    @property
    def total_ms(self) -> float:
        return self.load_ms + self.compute_ms


class SimKvIndex:
    """The KV index ``ConductorState`` reads, answered from the simulated caches (always exact:
    no events to lose). What the conductor tells it from prefill reports is already true here."""

    def __init__(self, index: BlockIndex, instances: list[Instance]) -> None:
        self._index = index
        self._instances = instances
        self._by_id = {inst.instance_id: inst for inst in instances}

    def add_instance(self, instance_id: str, node_id: str, model_id: str, kv_layout: str) -> None:
        assert instance_id in self._by_id

    def remove_instance(self, instance_id: str) -> None:
        raise AssertionError("instances never leave a simulated fleet")

    def clear_instance(self, instance_id: str) -> None:
        raise AssertionError("simulated instances never become unready")

    def note_device_blocks(self, instance_id: str, keys: object) -> None:
        pass

    def forget_device_blocks(self, instance_id: str, keys: object) -> None:
        pass

    def prefix_hits(self, keys: tuple[bytes, ...]) -> dict[str, PrefixHit]:
        instances = self._instances
        return {instances[i].instance_id: PrefixHit(c[0], c[1], c[2])
                for i, c in self._index.leading_runs(keys).items()}

    def num_device_blocks(self, instance_id: str) -> int:
        return self._by_id[instance_id].cache.num_cached_blocks


class Simulation:
    """One run: ``Simulation(workload, fleet, profile, policy, rate_scale).run()``; the per-request
    records are then in ``ttft_ms``, ``max_gap_ms``, ``num_cached_blocks`` and friends."""

    def __init__(self, workload: Workload, fleet: FleetConfig, profile: CostProfile, policy: str,
                 rate_scale: float = 1.0, profile_name: str = "analytic") -> None:
        if policy not in POLICIES:
            raise SimulationError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        assert rate_scale > 0
        self.workload, self.fleet, self.profile = workload, fleet, profile
        self.policy_name, self.policy = policy, POLICIES[policy]
        self.rate_scale = rate_scale
        self.profile_name = profile_name
        self.config = policy_config(fleet, profile, workload.block_size_tokens)
        self.keys = workload.keys
        self.num_private_blocks = workload.num_private_blocks
        self.block_bytes = workload.block_size_tokens * profile.kv_bytes_per_token
        self.now_ms = 0.0
        self._build_fleet()
        n = len(workload)
        self.ttft_ms = np.full(n, np.nan)
        self.max_gap_ms = np.zeros(n)
        self.num_cached_blocks = np.zeros(n, dtype=np.int64)
        self.num_pulled_blocks = np.zeros(n, dtype=np.int64)
        self.num_computed_tokens = np.zeros(n, dtype=np.int64)
        self.prefill_ms = np.zeros(n)
        self.transfer_ms = np.zeros(n)
        self.predicted_ttft_ms = np.full(n, np.nan)
        """The conductor's priced T = transfer + queue + prefill at placement (ms)."""
        self.queue_wait_ms = np.full(n, np.nan)
        """Arrival to the start of the prefill (ms)."""
        self.prefill_factor, self.transfer_factor = error_factors(n, fleet.prediction_error, fleet.error_seed)
        """Actual over priced prefill and transfer time, per request."""
        self.coalesce = policy in fleet.coalesce_policies
        self.warm_rejected = policy in fleet.warm_rejected_policies
        self.coalesce_wait_ms = np.zeros(n)
        """How long coalescing held the request before placing it (ms)."""
        self.coalesced = np.zeros(n, dtype=bool)
        self._waiters: dict[str, list[int]] = {}
        """In-flight request id → the requests held until its prefill ends."""
        self._held_since_ms: dict[int, float] = {}
        self._holds: dict[int, CoalesceWait] = {}
        """Request index → the priced wait it holds on its instance (``ConductorState.hold``)."""
        self.served = np.zeros(n, dtype=bool)
        self.rejected = np.zeros(n, dtype=bool)
        self.unservable = np.zeros(n, dtype=bool)
        self.colocated = np.zeros(n, dtype=bool)
        self.finished = np.zeros(n, dtype=bool)
        self.tbt_values: list[float] = []
        self.tbt_weights: list[int] = []
        self._heap: list[tuple[float, int, Callable[[float, Any], None], Any]] = []
        self._tiebreak = itertools.count()

    def _build_fleet(self) -> None:
        fleet = self.fleet
        per_node = fleet.instances_per_node
        device_blocks = fleet.capacity_blocks(fleet.device_kv_bytes, self.block_bytes)
        host_blocks = fleet.capacity_blocks(fleet.host_kv_bytes_per_node, self.block_bytes)
        disk_blocks = fleet.capacity_blocks(fleet.disk_kv_bytes_per_node, self.block_bytes)
        if device_blocks < 1:
            raise SimulationError(f"device_kv_bytes {fleet.device_kv_bytes:g} holds no "
                                  f"{self.block_bytes}-byte block; raise it")
        roles = ([("prefill", PrefillInstance)] * fleet.num_prefill_instances
                 + [("decode", DecodeInstance)] * fleet.num_decode_instances)
        node_of: list[int] = []
        node_ids: list[str] = []
        instances_of: list[list[int]] = []
        for role in ("prefill", "decode"):
            count = fleet.num_prefill_instances if role == "prefill" else fleet.num_decode_instances
            for i in range(count):
                if i % per_node == 0:
                    node_ids.append(f"{role}-node-{i // per_node:03d}")
                    instances_of.append([])
                instances_of[-1].append(len(node_of))
                node_of.append(len(node_ids) - 1)
        self.index = BlockIndex(node_of, instances_of)
        self.stores = [NodeStore(n, host_blocks, disk_blocks, self.index) for n in range(len(node_ids))]
        self.instances: list[Instance] = []
        self.prefill: list[PrefillInstance] = []
        self.decode: list[DecodeInstance] = []
        for idx, (role, cls) in enumerate(roles):
            pool = self.prefill if role == "prefill" else self.decode
            inst = cls(idx, f"{role}-{len(pool):04d}", node_ids[node_of[idx]],
                       DeviceCache(device_blocks, idx, self.index), self.stores[node_of[idx]], self)
            pool.append(inst)  # type: ignore[arg-type]
            self.instances.append(inst)
        self.by_id = {inst.instance_id: inst for inst in self.instances}
        self.dirty: set[Instance] = set()
        """Instances whose worker stats changed since the conductor last polled them."""
        self._next_poll_ms = 0.0
        self._max_blocks = device_blocks
        self.conductor = ConductorState(self.policy_name, self.config, SimKvIndex(self.index, self.instances),
                                        clock=lambda: self.now_ms / 1000.0)
        for inst in self.instances:
            role = "prefill" if isinstance(inst, PrefillInstance) else "decode"
            self.conductor.register(inst.instance_id, role, inst.node_id, "simulated", "simulated")
            self.conductor.set_ready(inst.instance_id, True)

    # -- the event loop ---------------------------------------------------------------------------

    def schedule(self, at_ms: float, callback: Callable[[float, Any], None], arg: Any) -> None:
        heapq.heappush(self._heap, (at_ms, next(self._tiebreak), callback, arg))

    def run(self) -> Simulation:
        """Replay every arrival and run until the last request has finished."""
        conductor_log = logging.getLogger("conductor.state")
        level = conductor_log.level
        conductor_log.setLevel(logging.ERROR)  # its per-request warnings would flood a replay
        try:
            self._run()
        finally:
            conductor_log.setLevel(level)
        return self

    def _run(self) -> None:
        arrivals = [t / self.rate_scale for t in self.workload.arrival_ms]
        heap, pop = self._heap, heapq.heappop
        i, n = 0, len(arrivals)
        while i < n or heap:
            if heap and (i == n or heap[0][0] <= arrivals[i]):
                at_ms, _, callback, arg = pop(heap)
                self.now_ms = at_ms
                callback(at_ms, arg)
            else:
                self.now_ms = arrivals[i]
                self._arrive(i, arrivals[i])
                i += 1

    # -- placement --------------------------------------------------------------------------------

    def _arrive(self, i: int, now_ms: float) -> None:
        keys = self.keys[i]
        if len(keys) + self.num_private_blocks[i] > self._max_blocks:
            self.unservable[i] = True  # larger than any device: no placement can serve it
            return
        if self.coalesce:
            wait = self.conductor.coalesce_wait(self.workload.placement_requests[i],
                                                self.fleet.coalesce_min_blocks)
            if wait is not None and wait.wins:  # priced against placing now, as live
                self.conductor.hold(wait)
                self._holds[i] = wait
                self._waiters.setdefault(wait.owner, []).append(i)
                self._held_since_ms[i] = now_ms
                self.schedule(now_ms + self.fleet.coalesce_max_wait_ms, self._hold_expired, i)
                return
        self._place(i, now_ms)

    def _release_held(self, request_id: str, now_ms: float) -> None:
        """The prefill of ``request_id`` ended: place what waited for it (the live conductor
        places a woken request without a second look for another in-flight prefill)."""
        for i in self._waiters.pop(request_id, ()):
            since = self._held_since_ms.pop(i, None)
            if since is not None:
                self.conductor.release(self._holds.pop(i))
                self.coalesce_wait_ms[i] = now_ms - since
                self.coalesced[i] = True
                self._place(i, now_ms)

    def _hold_expired(self, now_ms: float, i: int) -> None:
        since = self._held_since_ms.pop(i, None)
        if since is not None:
            self.conductor.release(self._holds.pop(i))
            self.coalesce_wait_ms[i] = now_ms - since
            self._place(i, now_ms)

    def _place(self, i: int, now_ms: float) -> None:
        if self.dirty and now_ms >= self._next_poll_ms:
            # in instance order: a set of objects iterates in address order, which differs from
            # process to process, and the order of the updates moves the conductor's refreshes
            for inst in sorted(self.dirty, key=_instance_order):
                self.conductor.update_load(inst.instance_id, *inst.load())
            self.dirty.clear()
            self._next_poll_ms = now_ms + self.fleet.stats_interval_ms
        try:
            placement = self.conductor.place(self.workload.placement_requests[i])
        except Overloaded:
            self.rejected[i] = True
            if self.warm_rejected and self._room_to_warm():
                target = min(self.prefill, key=lambda p: (p.current is not None, len(p.queue)))
                target.enqueue(Job(i, None, None, WARM_PRIORITY, min(WARM_CHUNK_BLOCKS, len(self.keys[i]))),
                               now_ms)
            return
        prefill_inst = self.by_id[placement.prefill_instance]
        decode_inst = self.by_id[placement.decode_instance]
        if not isinstance(decode_inst, DecodeInstance) or (
                isinstance(prefill_inst, DecodeInstance) and prefill_inst is not decode_inst):
            raise SimulationError(
                f"policy {self.policy_name} placed prefill on {prefill_inst.instance_id} and decode on "
                f"{decode_inst.instance_id}; decode must be a decode instance, and a decode instance "
                "prefills only requests it decodes itself")
        self.predicted_ttft_ms[i] = placement.transfer_ms + placement.queue_ms + placement.prefill_ms
        source = self.by_id[placement.pulled_from] if placement.pulled_from else None
        job = Job(i, source, decode_inst, placement.priority)
        self.served[i] = True
        if prefill_inst is decode_inst:
            self.colocated[i] = True
            decode_inst.enqueue_prefill(job, now_ms)
        else:
            prefill_inst.enqueue(job, now_ms)  # type: ignore[attr-defined]

    # -- the mechanism, called by instances -------------------------------------------------------

    def begin_prefill(self, inst: Instance, job: Job, now_ms: float) -> PrefillTimes:
        """Load the local prefix, pull the rest from the placement's source, compute the remainder:
        returns how long the load and the compute take (ms), priced on the caches as they are now,
        each times the request's drawn error factor."""
        i = job.req
        keys = self.job_keys(job)
        request = self.workload.placement_requests[i]
        if job.num_blocks is not None:
            request = PlacementRequest(request.request_id, min(len(keys) * self.workload.block_size_tokens,
                                                               request.num_prompt_tokens), keys)
        local = self.index.leading_run(inst.idx, keys)
        prefix_hits = {inst.instance_id: PrefixHit(*local)}
        source_view = None
        source = job.source
        if source is not None and source is not inst:
            remote = self.index.leading_run(source.idx, keys)
            local_len, remote_len = sum(local), sum(remote)
            if remote_len > local_len:
                prefix_hits[source.instance_id] = PrefixHit(*remote)
                source_view = source.bare_view
                read = keys[:remote_len]
                source.cache.touch(read)
                source.store.put(read, insert_absent=False)
        snapshot = ClusterSnapshot((inst.bare_view,), (), 0, prefix_hits)
        cost = price(snapshot, request, self.config, inst.bare_view, source_view)
        cached_tokens = min(cost.num_cached_blocks * self.workload.block_size_tokens, request.num_prompt_tokens)
        prefill_ms = cost.prefill_ms * self.prefill_factor[i]
        transfer_ms = cost.transfer_ms * self.transfer_factor[i]
        if job.decode is None:  # a warming chunk: the request's compute is the sum of its chunks
            self.prefill_ms[i] += prefill_ms
            self.num_computed_tokens[i] += request.num_prompt_tokens - cached_tokens
            return PrefillTimes(transfer_ms, prefill_ms)
        self.num_cached_blocks[i] = cost.num_cached_blocks
        self.num_pulled_blocks[i] = cost.num_pulled_blocks
        self.num_computed_tokens[i] = request.num_prompt_tokens - cached_tokens
        self.prefill_ms[i] = prefill_ms
        self.transfer_ms[i] = transfer_ms
        self.queue_wait_ms[i] = now_ms - self.workload.arrival_ms[i] / self.rate_scale
        return PrefillTimes(transfer_ms, prefill_ms)

    def num_prefill_chunks(self, i: int) -> int:
        """The mixed steps request ``i``'s prefill takes on a decode instance (its computed
        suffix in chunks of ``baton_prefill_chunk_tokens``, at least one), as pricing counts them."""
        return max(1, -(-int(self.num_computed_tokens[i]) // self.config.baton_prefill_chunk_tokens))

    def num_last_chunk_room_tokens(self, i: int) -> int:
        """The step's token budget (``baton_prefill_chunk_tokens``) left beside the last chunk
        of request ``i``'s prefill on a decode instance: 0 when that chunk is a full one."""
        chunk_tokens = self.config.baton_prefill_chunk_tokens
        last_tokens = int(self.num_computed_tokens[i]) - (self.num_prefill_chunks(i) - 1) * chunk_tokens
        return chunk_tokens - last_tokens

    def end_prefill(self, inst: Instance, job: Job, now_ms: float) -> None:
        """The KV connector writes every block of the prompt to the node's store; the worker
        reports the prefill to the conductor."""
        i = job.req
        inst.store.put(self.job_keys(job))
        cached_tokens = self.workload.num_prompt_tokens[i] - int(self.num_computed_tokens[i])
        request_id = self.workload.placement_requests[i].request_id
        self.conductor.prefill_done(request_id, cached_tokens)
        if self._waiters:
            self._release_held(request_id, now_ms)

    def _room_to_warm(self, finishing: Instance | None = None) -> bool:
        """Whether at most ``warm_max_busy_frac`` of the prefill pool is busy (``finishing``, the
        instance whose chunk just ended, counts as idle)."""
        num_busy = sum(1 for p in self.prefill if p.current is not None and p is not finishing)
        return num_busy <= self.fleet.warm_max_busy_frac * len(self.prefill)

    def job_keys(self, job: Job) -> tuple[bytes, ...]:
        keys = self.keys[job.req]
        return keys if job.num_blocks is None else keys[:job.num_blocks]

    def hand_off(self, prefill_inst: Instance, job: Job, now_ms: float) -> None:
        """Send the KV the decode instance does not already hold on device (none for a
        rejected request prefilled only to warm the cache)."""
        i, decode_inst = job.req, job.decode
        if decode_inst is None:
            if job.num_blocks is not None and job.num_blocks < len(self.keys[i]) and self._room_to_warm(prefill_inst):
                prefill_inst.enqueue(Job(i, None, None, WARM_PRIORITY, min(  # type: ignore[attr-defined]
                    job.num_blocks + WARM_CHUNK_BLOCKS, len(self.keys[i]))), now_ms)
            return
        keys = self.keys[i]
        num_prompt_tokens = self.workload.num_prompt_tokens[i]
        held_tokens = min(decode_inst.cache.leading_run(keys) * self.workload.block_size_tokens,
                          num_prompt_tokens)
        path = "same_node" if prefill_inst.node_id == decode_inst.node_id else "remote_host"
        transfer_ms = self.profile.transfer.t_transfer_ms(
            (num_prompt_tokens - held_tokens) * self.profile.kv_bytes_per_token, path)
        self.schedule(now_ms + transfer_ms, decode_inst.on_kv_arrived, self.new_seq(i))

    def new_seq(self, i: int) -> Seq:
        return Seq(i, self.keys[i], self.workload.num_prompt_tokens[i], self.workload.num_output_tokens[i],
                   self.num_private_blocks[i])

    def step_ms(self, num_seqs: int, num_context_tokens: int) -> float:
        return self.profile.decode.t_step_ms(num_seqs, num_context_tokens)

    def first_token(self, i: int, at_ms: float) -> None:
        self.ttft_ms[i] = at_ms - self.workload.arrival_ms[i] / self.rate_scale

    def tbt_samples(self, gap_ms: float, count: int) -> None:
        self.tbt_values.append(gap_ms)
        self.tbt_weights.append(count)

    def finish(self, seq: Seq) -> None:
        self.max_gap_ms[seq.req] = seq.max_gap_ms
        self.finished[seq.req] = True
        self.conductor.finished(self.workload.placement_requests[seq.req].request_id)

    def check_invariants(self) -> None:
        for inst in self.instances:
            inst.cache.check_invariants()
        for store in self.stores:
            store.check_invariants()
