"""Simulated instances: a prefill instance (a FIFO of prefills, one at a time) and a decode
instance (continuous batching, plus the short prefills conditional disaggregation sends it).

Both only change state when the simulation calls them at an event time; the simulation owns the
clock, the event heap, the caches' index and the per-request records (``Simulation`` in
``simulator.sim``; the instances call its ``begin_prefill``, ``end_prefill`` and ``schedule``).
Waiting prefills run in the order of the placement's ``priority`` (lower first: the conductor
passes minus the cached blocks, longest prefix first), then first come first served, as vLLM's
priority scheduling runs them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from typing import TYPE_CHECKING

from conductor.policy import InstanceView
from simulator.cache import DeviceCache, NodeStore

if TYPE_CHECKING:
    from simulator.sim import Simulation


class Job:
    """One placed request on its way through prefill."""

    __slots__ = ("req", "source", "decode", "priority", "num_blocks")

    def __init__(self, req: int, source: Instance | None, decode: DecodeInstance | None, priority: int,
                 num_blocks: int | None = None) -> None:
        self.req = req
        self.source = source
        """The instance the placement pulls the prefix from (None: local prefix only)."""
        self.decode = decode
        """None: a rejected request prefilled only to warm the cache (``warm_rejected_policies``)."""
        self.priority = priority
        self.num_blocks = num_blocks
        """Prefill only the first this many blocks (a warming chunk); None: the whole prompt."""


class PrefillQueue:
    """Waiting prefills, lowest ``priority`` first, then in arrival order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Job]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, job: Job) -> None:
        heapq.heappush(self._heap, (job.priority, next(self._order), job))

    def peek(self) -> Job:
        return self._heap[0][2]

    def pop(self) -> Job:
        return heapq.heappop(self._heap)[2]


class Seq:
    """One request decoding on a decode instance."""

    __slots__ = ("req", "keys", "num_context_tokens", "num_remaining_tokens", "num_emitted_tokens",
                 "last_token_ms", "num_private_blocks", "max_gap_ms")

    def __init__(self, req: int, keys: tuple[bytes, ...], num_prompt_tokens: int, num_output_tokens: int,
                 num_private_blocks: int) -> None:
        self.req = req
        self.keys = keys
        self.num_context_tokens = num_prompt_tokens
        self.num_remaining_tokens = num_output_tokens
        self.num_emitted_tokens = 0
        self.last_token_ms = 0.0
        self.num_private_blocks = num_private_blocks
        """Blocks for generated tokens past the prompt's keyed blocks, reserved at admission."""
        self.max_gap_ms = 0.0


class Instance:
    """What both roles share: identity, node, device cache, and the view policies see."""

    def __init__(self, idx: int, instance_id: str, node_id: str, cache: DeviceCache, store: NodeStore,
                 sim: Simulation) -> None:
        self.idx = idx
        self.instance_id = instance_id
        self.node_id = node_id
        self.cache = cache
        self.store = store
        self.sim = sim
        self.bare_view = InstanceView(instance_id, node_id=node_id)
        """Identity only: what ``price`` needs to cost a prefill that starts now."""

    def load(self) -> tuple[int, float]:
        """What the worker's stats report: (waiting requests, device KV in use 0..1)."""
        raise NotImplementedError


class PrefillInstance(Instance):
    """Prefills its queue one at a time, in priority order. A pulled prefix enters the device
    cache (and so the index) when its transfer ends, the computed blocks when the prefill ends
    (what KV events report live: a block exists once it is computed); then every block goes to
    the node's store and the KV is handed to the request's decode instance."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.queue = PrefillQueue()
        self.current: Job | None = None
        self.chunk_ms = 0.0
        self.num_chunks_left = 0

    def load(self) -> tuple[int, float]:
        num_used_blocks = len(self.sim.keys[self.current.req]) if self.current is not None else 0
        return len(self.queue), num_used_blocks / self.cache.capacity_blocks

    def enqueue(self, job: Job, now_ms: float) -> None:
        self.queue.push(job)
        self.sim.dirty.add(self)
        if self.current is None:
            self._start_next(now_ms)

    def _start_next(self, now_ms: float) -> None:
        if not self.queue:
            self.current = None
            return
        job = self.queue.pop()
        duration_ms = self.sim.begin_prefill(self, job, now_ms).total_ms
        self.current = job
        num_pulled = int(self.sim.num_pulled_blocks[job.req])
        if num_pulled:
            pulled_ms = float(self.sim.transfer_ms[job.req])
            self.sim.schedule(now_ms + pulled_ms, self.on_pull_done, job)
        self.sim.schedule(now_ms + duration_ms, self.on_prefill_done, None)

    def on_pull_done(self, now_ms: float, job: Job) -> None:
        """The pulled prefix has landed: it is a replica here from now on."""
        if self.current is job:
            # one prefill at a time: nothing to pin against
            self.cache.insert(self.sim.keys[job.req][:int(self.sim.num_cached_blocks[job.req])])
            self.sim.dirty.add(self)

    def on_prefill_done(self, now_ms: float, _arg: object) -> None:
        job = self.current
        assert job is not None
        self.cache.insert(self.sim.job_keys(job))
        self.sim.end_prefill(self, job, now_ms)
        self.sim.hand_off(self, job, now_ms)
        self._start_next(now_ms)
        self.sim.dirty.add(self)


IDLE, DECODING, PREFILLING = 0, 1, 2


class DecodeInstance(Instance):
    """Continuous batching: every step emits one token for each running sequence and takes
    ``DecodeStepModel.step_ms(batch size, context tokens)``.

    Between events that change the batch the step time is constant (it is computed when the
    segment starts; context growth within a segment, at most a few % of the KV term, is not
    re-priced), so a run of steps is one event, not one event per token. New sequences join,
    and queued short prefills start, at the next step boundary.

    A prefill here (co-location) runs one at a time, in two phases. First its cached prefix
    loads from the node's host and disk tiers (the load part of ``Simulation.begin_prefill``),
    as the KV connector's asynchronous load does live: the request waits for its KV while the
    running batch keeps decoding at its plain step time and handed-off sequences keep joining at
    step boundaries; the prefill holds the instance's prefill slot meanwhile, so the next queued
    prefill waits for it to end (vLLM could start one meanwhile; the conductor's queue book
    prices them in series, and so does this). Then, at the first step boundary after the load
    lands (at once without one), its compute runs as vLLM's chunked prefill does and as
    ``conductor.pricing.colocated_price`` prices it: the uncached suffix in chunks of
    ``baton_prefill_chunk_tokens``, each chunk one mixed step that also steps the running batch
    (chunk's share of the compute + the batch's decode step), so the compute takes its own time
    plus one decode step per chunk and each running sequence gains a token per chunk. Sequences
    that arrive meanwhile join as vLLM's scheduler lets them (``vllm/v1/core/sched/scheduler.py``,
    0.32: running requests first, a prefill chunk takes what is left of the step's token budget,
    waiting requests are scheduled only while budget remains): a full chunk leaves none, so they
    wait for the last chunk, and join at its start when it is shorter than a full one (up to as
    many as the tokens it leaves; the budget counts prefill tokens only, as pricing does), else
    when the prefill ends. Only the compute is spread over the chunks, never the load. A
    sequence is admitted once its prompt blocks and the private blocks for its whole output fit
    the device cache (no preemption); a prefill reserves its blocks when its load starts.
    """

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.prefill_queue = PrefillQueue()
        self.mode = IDLE
        self.version = 0
        self.segment_start_ms = 0.0
        self.step_ms = 0.0
        self.num_boundary_steps = 0
        self.num_context_tokens = 0
        self.current: Job | None = None
        """The prefill holding the prefill slot, from its load's start to its last chunk's end."""
        self.loading = False
        """Whether ``current``'s prefix load is still in flight (its chunks not yet started)."""
        self.chunk_ms = 0.0
        self.num_chunks_left = 0
        self.num_last_chunk_room_tokens = 0
        """The token budget ``current``'s last chunk leaves: how many waiting sequences may join
        at its start (0: it is a full chunk)."""

    def load(self) -> tuple[int, float]:
        return (len(self.waiting) + len(self.prefill_queue),
                self.cache.num_used_blocks / self.cache.capacity_blocks)

    def enqueue_prefill(self, job: Job, now_ms: float) -> None:
        """Conditional disaggregation: prefill here, then decode here."""
        self.prefill_queue.push(job)
        self._wake(now_ms)

    def on_kv_arrived(self, now_ms: float, seq: Seq) -> None:
        """The KV of a request prefilled elsewhere is here."""
        self.waiting.append(seq)
        self._wake(now_ms)

    def on_load_done(self, now_ms: float, job: Job) -> None:
        """``job``'s prefix has landed: its chunks start at the next step boundary."""
        assert self.current is job and self.loading
        self.loading = False
        self._wake(now_ms)

    def _wake(self, now_ms: float) -> None:
        """Bring the next step boundary forward to the first one at or after ``now_ms``."""
        self.sim.dirty.add(self)
        if self.mode == IDLE:
            self._start(now_ms)
            return
        steps = max(0, math.ceil((now_ms - self.segment_start_ms) / self.step_ms - 1e-9))
        if self.mode == PREFILLING:
            # a waiting sequence can join at the last chunk's start only (see the class)
            if not (self.waiting and self.num_last_chunk_room_tokens > 0):
                return
            steps = max(steps, self.num_chunks_left - 1)
        if steps < self.num_boundary_steps:
            self._schedule_boundary(steps)

    def _schedule_boundary(self, num_steps: int) -> None:
        self.version += 1
        self.num_boundary_steps = num_steps
        self.sim.schedule(self.segment_start_ms + num_steps * self.step_ms, self.on_boundary, self.version)

    def on_boundary(self, now_ms: float, version: int) -> None:
        if version != self.version:
            return  # superseded by an earlier boundary
        if self.mode == DECODING:
            self._advance(self.num_boundary_steps)
        elif self.mode == PREFILLING:
            self._advance(self.num_boundary_steps)
            self.num_chunks_left -= self.num_boundary_steps
            if self.num_chunks_left > 0:
                if self.num_chunks_left == 1:
                    self._admit(now_ms, self.num_last_chunk_room_tokens)
                self._prefill_segment(now_ms)
                return
            job = self.current
            assert job is not None
            self.current = None
            self.cache.publish(self.sim.keys[job.req])
            self.sim.end_prefill(self, job, now_ms)
            self._join(self.sim.new_seq(job.req), now_ms)
        self.mode = IDLE
        self.sim.dirty.add(self)
        self._start(now_ms)

    def _begin_prefill(self, now_ms: float) -> None:
        """Take the first queued prefill into the prefill slot if its blocks fit; its load, when
        it has one, lands ``load_ms`` from now (``on_load_done``)."""
        job = self.prefill_queue.peek()
        keys = self.sim.keys[job.req]
        num_private = self.sim.num_private_blocks[job.req]
        if not self.cache.can_acquire(keys, num_private):
            return
        self.prefill_queue.pop()
        times = self.sim.begin_prefill(self, job, now_ms)
        self.cache.acquire(keys, num_private, visible=False)  # published when it ends
        self.current = job
        self.num_chunks_left = self.sim.num_prefill_chunks(job.req)
        self.chunk_ms = times.compute_ms / self.num_chunks_left
        self.num_last_chunk_room_tokens = self.sim.num_last_chunk_room_tokens(job.req)
        if times.load_ms > 0:
            self.loading = True
            self.sim.schedule(now_ms + times.load_ms, self.on_load_done, job)

    def _prefill_segment(self, now_ms: float) -> None:
        """Mixed steps of the running prefill until its last chunk or the batch's next finish."""
        self.segment_start_ms = now_ms
        if self.running:
            self.step_ms = self.chunk_ms + self.sim.step_ms(len(self.running), self.num_context_tokens)
            num_steps = min(self.num_chunks_left, min(seq.num_remaining_tokens for seq in self.running))
        else:
            self.step_ms, num_steps = self.chunk_ms, self.num_chunks_left
        self._schedule_boundary(num_steps)

    def _advance(self, num_steps: int) -> None:
        """Account ``num_steps`` steps of the current segment to every running sequence."""
        if num_steps == 0:
            return
        start_ms, step_ms = self.segment_start_ms, self.step_ms
        first_ms = start_ms + step_ms
        sim = self.sim
        num_plain_gaps = 0
        finished = []
        for seq in self.running:
            if seq.num_emitted_tokens == 0:
                sim.first_token(seq.req, first_ms)
            else:
                gap_ms = first_ms - seq.last_token_ms
                if gap_ms > step_ms + 1e-9:
                    sim.tbt_samples(gap_ms, 1)
                    if gap_ms > seq.max_gap_ms:
                        seq.max_gap_ms = gap_ms
                else:
                    num_plain_gaps += 1
            if num_steps > 1 or seq.num_emitted_tokens:
                if step_ms > seq.max_gap_ms:
                    seq.max_gap_ms = step_ms
            num_plain_gaps += num_steps - 1
            seq.num_emitted_tokens += num_steps
            seq.num_remaining_tokens -= num_steps
            seq.num_context_tokens += num_steps
            seq.last_token_ms = start_ms + num_steps * step_ms
            if seq.num_remaining_tokens == 0:
                finished.append(seq)
        self.num_context_tokens += num_steps * len(self.running)
        if num_plain_gaps:
            sim.tbt_samples(step_ms, num_plain_gaps)
        for seq in finished:
            self.running.remove(seq)
            self.num_context_tokens -= seq.num_context_tokens
            self.cache.release(seq.keys, seq.num_private_blocks)
            sim.finish(seq)

    def _join(self, seq: Seq, now_ms: float) -> None:
        self.running.append(seq)
        self.num_context_tokens += seq.num_context_tokens
        seq.last_token_ms = now_ms

    def _admit(self, now_ms: float, max_seqs: int | None = None) -> None:
        """At a step boundary: waiting sequences join the batch in arrival order while their
        blocks fit (at most ``max_seqs``)."""
        cache, num_joined = self.cache, 0
        while (self.waiting and (max_seqs is None or num_joined < max_seqs)
               and cache.can_acquire(self.waiting[0].keys, self.waiting[0].num_private_blocks)):
            seq = self.waiting.popleft()
            cache.acquire(seq.keys, seq.num_private_blocks)
            self._join(seq, now_ms)
            num_joined += 1

    def _start(self, now_ms: float) -> None:
        """At a step boundary with no segment in progress: admit, begin the next prefill (its
        load, if any, in flight from now), run the loaded prefill's chunks, or decode."""
        self._admit(now_ms)
        if self.current is None and self.prefill_queue:
            self._begin_prefill(now_ms)
        if self.current is not None and not self.loading:
            self.mode = PREFILLING
            self._prefill_segment(now_ms)
            return
        if self.running:
            self.mode = DECODING
            self.segment_start_ms = now_ms
            self.step_ms = self.sim.step_ms(len(self.running), self.num_context_tokens)
            self._schedule_boundary(min(seq.num_remaining_tokens for seq in self.running))
