"""Drive an in-process vLLM ``LLMEngine`` from asyncio.

vLLM's ``LLMEngine`` is synchronous and not thread-safe. One thread owns it: it takes new
requests and aborts from a command queue, runs ``step()`` while anything is unfinished, and hands
each output to the asyncio queue of its request. The engine never sees a call from any other
thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from protos.errors import InvalidRequest, WorkerFailed
from engine.sampling import sampling_params
from engine.step_shapes import ScheduleTap
from protos.wire import DecodeSpan, DecodeStep, EngineRequest, MixedStep

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_TRANSFER_POLL_S = 0.0005
"""How often an engine with nothing to step but KV transfers under way asks whether they are
done (each ask is one empty engine step)."""


class EngineDead(WorkerFailed):
    """The engine thread stopped (crash or shutdown); no request can be served."""


class EngineRejected(InvalidRequest):
    """vLLM refused the request itself (its own validation); the engine is fine."""


@dataclass
class _Add:
    request: EngineRequest
    max_tokens: int
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    priority: int = 0
    gated: bool = False
    """Its prompt is computed here, so it waits its turn at the prefill gate."""
    arrived_ms: float = field(default_factory=lambda: time.monotonic() * 1000.0)

    def gate_key(self, shortest_first: bool) -> tuple[int, float]:
        """The prefill gate's order, lowest first: priority, then arrival, plus the priced
        prefill (``EngineRequest.predicted_prefill_ms``) when ``shortest_first``: among prompts
        arriving together the shortest goes first, and one is passed only by prompts that
        arrived less than its own prefill after it and are shorter. Unpriced prompts (0) go in
        arrival order."""
        predicted = self.request.predicted_prefill_ms if shortest_first else 0.0
        return self.priority, self.arrived_ms + predicted


@dataclass
class _Abort:
    request_id: str


DECODE_STEPS_KEPT = 128
"""Decode-step timings a runner keeps between two ``take_decode_steps`` (the newest): a stats
interval of 0.5 s holds ~30 CPU steps, ~50 of a GPU's."""

MIXED_STEPS_KEPT = 128
"""Mixed-step timings a runner keeps between two ``take_mixed_steps`` (the newest)."""

DECODE_SPANS_KEPT = 256
"""Finished requests' ``DecodeSpan``s a runner keeps between two ``take_decode_spans``."""

OPEN_SPANS_MAX = 4096
"""Spans of running requests a runner keeps at most (past it they are dropped: a request the
runner never saw end, e.g. under a vLLM that names requests otherwise, leaks nothing)."""


def engine_prefill_ms(output) -> float | None:
    """The engine's own prefill time of a ``RequestOutput`` (ms): from when its scheduler
    first scheduled the request to its first token, both engine-core timestamps of vLLM's
    request stats; None before the first token or with stats off."""
    stats = getattr(output, "metrics", None)
    scheduled, first = getattr(stats, "scheduled_ts", 0.0), getattr(stats, "first_token_ts", 0.0)
    if not scheduled or not first or first < scheduled:
        return None
    return (first - scheduled) * 1000.0


def _drained(queue_: deque) -> list:
    """Everything in ``queue_``, oldest first, taken out one by one (the engine thread may append
    meanwhile: each ``popleft`` is atomic, and what it appends after is left for next time)."""
    items = []
    while queue_:
        items.append(queue_.popleft())
    return items


def _put_all(items) -> None:
    """On a request's event loop: each (sink, output) of one engine step, in step order."""
    for sink, output in items:
        sink.put_nowait(output)


class EngineRunner:
    """Owns one ``LLMEngine`` and its stepping thread.

    ``max_prefills`` (> 0) is the prefill gate: at most that many gated requests (those whose
    prompt this engine computes) are in the engine before their first token; the others wait
    here and are added, by priority then arrival (``gate_order`` "arrival"), or arrival plus
    priced prefill ("shortest_first": shortest first among prompts arriving together,
    ``_Add.gate_key``), as first tokens come out. vLLM's scheduler
    packs every waiting prompt it has into a step up to its token budget, and on a CPU a step
    costs about its tokens, so a burst of N prompts packed into one step gives all N their
    first token when the last is computed; one at a time, the k-th gets it after k prompts.
    0: no gate (vLLM packs them; where a step's cost is flat in its tokens, as on a GPU below
    its compute bound, packing is the better choice).
    """

    def __init__(self, engine_args, max_prefills: int = 0, gate_order: str = "arrival",
                 admission_headroom: int = 0) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine

        from engine import cpu_seeds

        cpu_seeds.install()  # before the engine makes its generators (see the module)

        started = time.perf_counter()
        self.engine = LLMEngine.from_engine_args(engine_args)
        self.start_seconds = time.perf_counter() - started
        from kvstore.connector_meta import engine_step_gate

        self._step_gate = engine_step_gate(engine_args)
        """Opened once a step's outputs are handed out: the KV saves the step handed off start
        then (``kvstore.connector_meta.StepGate``); None without a Baton connector."""
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._in_flight: set[str] = set()  # request ids between generate() start and end
        self.max_prefills = max_prefills
        self.shortest_first = gate_order == "shortest_first"  # ``engine.prefill_gate_order``
        self.admission_headroom = admission_headroom  # ``engine.admission_headroom_tokens``
        self._admitting: set[str] = set()
        """Requests that skip the gate (their prompt KV is loaded: hand-offs) in the engine
        before their first token, while ``admission_headroom`` is on (``_leave_room``)."""
        self._held: list[_Add] = []  # gated requests waiting for the gate (engine thread only)
        self._prefilling: set[str] = set()  # gated requests in the engine before their first token
        self._dead: BaseException | None = None
        self._stopping = False
        self.num_finished_reqs = 0
        self._decode_steps: deque[DecodeStep] = deque(maxlen=DECODE_STEPS_KEPT)
        self._mixed_steps: deque[MixedStep] = deque(maxlen=MIXED_STEPS_KEPT)
        self._decode_seq = 0  # the next timed step's number (``DecodeStep.seq``, ``MixedStep.seq``)
        scheduler = self._scheduler()
        self._tap = ScheduleTap(scheduler) if scheduler is not None else None
        self._spans: dict[str, list[int]] = {}  # running request -> [first, last] decode step
        self._decode_spans: deque[DecodeSpan] = deque(maxlen=DECODE_SPANS_KEPT)
        self._thread = threading.Thread(target=self._loop, name="baton-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio side

    async def generate(self, request: EngineRequest, max_tokens: int | None = None,
                       priority: int = 0, computes_prompt: bool = True) -> AsyncIterator:
        """Yield vLLM ``RequestOutput`` deltas for ``request`` until it finishes.

        ``priority`` orders the waiting queue of an engine that schedules by priority (lower
        first). ``computes_prompt`` False (a decode whose prompt KV was computed elsewhere and
        is loaded) skips the prefill gate. Closing the iterator early (the caller was
        cancelled) aborts the request.
        """
        if self._dead is not None:
            raise EngineDead(f"engine stopped: {self._dead!r}")
        if request.request_id in self._in_flight:
            raise EngineRejected(
                f"request_id '{request.request_id}' is already in flight on this instance; "
                "give every request its own id (or leave it empty for a generated one)"
            )
        self._in_flight.add(request.request_id)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        budget = request.sampling.max_tokens if max_tokens is None else max_tokens
        self._commands.put(_Add(request, budget, sink, loop, priority, gated=computes_prompt))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, EngineRejected):
                    finished = True
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDead(f"engine failed while serving the request: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request.request_id))
            self._in_flight.discard(request.request_id)

    def num_running_and_waiting(self) -> tuple[int, int]:
        scheduler = self._scheduler()
        held = len(self._held)
        if scheduler is None:
            return len(self._sinks), held
        return len(scheduler.running), len(scheduler.waiting) + held

    def kv_usage_frac(self) -> float:
        """Fraction of the engine's KV cache blocks in use (0 when it cannot be read)."""
        scheduler = self._scheduler()
        manager = getattr(scheduler, "kv_cache_manager", None)
        usage = getattr(manager, "usage", 0.0)
        return float(usage) if isinstance(usage, (int, float)) else 0.0

    def max_model_len(self) -> int:
        """The engine's context window in tokens, as vLLM configured it."""
        return self.engine.vllm_config.model_config.max_model_len

    def kv_layout(self) -> tuple[str, int]:
        """(dtype as vLLM names it, block size in tokens) of the engine's KV cache."""
        cfg = self.engine.vllm_config
        return str(cfg.model_config.dtype), cfg.cache_config.block_size

    def _scheduler(self):
        core = getattr(self.engine, "engine_core", None)
        inner = getattr(core, "engine_core", None)
        return getattr(inner, "scheduler", None)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopping = True
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            while not self._stopping:
                busy = self._busy()
                self._drain_commands(block=not busy)
                if busy or self.engine.has_unfinished_requests():
                    if self.admission_headroom:
                        self._leave_room()
                    decoding = self._decode_only()
                    schedules = self._tap.num_schedules if self._tap is not None else 0
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    step_ms = (time.perf_counter() - started) * 1000.0
                    if decoding is not None and outputs:
                        self._timed_decode_step(*decoding, step_ms)
                    elif outputs and self._tap is not None and self._tap.num_schedules == schedules + 1:
                        self._timed_mixed_step(step_ms)
                    self._deliver(outputs)
                    if self._step_gate is not None:
                        self._step_gate.open()
                    if not outputs and self._only_transfers():
                        time.sleep(_TRANSFER_POLL_S)  # nothing to step: let the copies run
        except BaseException as exc:  # the engine is unusable: fail every waiting request
            log.exception("engine thread crashed")
            self._dead = exc
            waiting = [(held.sink, held.loop) for held in self._held]
            for sink, loop in [*self._sinks.values(), *waiting]:
                loop.call_soon_threadsafe(sink.put_nowait, exc)
            self._sinks.clear()
            self._held.clear()
            return
        self._dead = EngineDead("engine shut down")

    def _leave_room(self) -> None:
        """Before a step: while a hand-off (a decode whose prompt KV was computed elsewhere and
        is loaded here: a few tokens of work) waits for its first token, the steps stay short.
        A prompt's chunk is capped at ``admission_headroom`` tokens (vLLM's
        ``long_prefill_token_threshold``) and the gate lets no new prompt in
        (``_gate_full``). vLLM schedules running requests first: a chunk took the whole step
        budget, so a hand-off waited for every chunk of the prompt, and where a whole prompt
        fits one step it joined the next prompt's step (~2 s each on a float32 CPU, against a
        ~0.15 s decode step). Lifted once it has its first token."""
        scheduler = self._scheduler()
        config = getattr(scheduler, "scheduler_config", None)
        if config is None:
            return
        cap = self.admission_headroom if self._admitting else 0
        if config.long_prefill_token_threshold != cap:
            config.long_prefill_token_threshold = cap

    def _decode_only(self) -> tuple[int, int, list[str]] | None:
        """(sequences, context tokens, their request ids) when the next step can only decode:
        every running request is past its prompt and none waits to be scheduled; else None (a
        step with a prefill in it is not a decode step)."""
        scheduler = self._scheduler()
        if (scheduler is None or not scheduler.running or scheduler.waiting
                or getattr(scheduler, "kv_holding_waiting", None)):
            return None
        context = 0
        for request in scheduler.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                return None
            context += request.num_computed_tokens
        return len(scheduler.running), context, [r.request_id for r in scheduler.running]

    def _timed_decode_step(self, num_seqs: int, context_tokens: int, request_ids: list[str],
                           step_ms: float) -> None:
        """Keep a timed decode-only step, numbered, and extend its requests' spans."""
        seq = self._decode_seq
        self._decode_seq += 1
        self._decode_steps.append(DecodeStep(num_seqs, context_tokens, step_ms, seq))
        self._extend_spans(request_ids, seq)

    def _timed_mixed_step(self, step_ms: float) -> None:
        """Keep the step just run, numbered, when it decoded beside prompt chunks (its shape
        from the scheduler's tap), and extend its decoding requests' spans."""
        shape = self._tap.last
        if shape is None or not shape.is_mixed:
            return
        seq = self._decode_seq
        self._decode_seq += 1
        self._mixed_steps.append(MixedStep(len(shape.decode_request_ids), shape.context_tokens,
                                           shape.chunks, step_ms, seq, shape.loaded_blocks))
        self._extend_spans(shape.decode_request_ids, seq)

    def _extend_spans(self, request_ids, seq: int) -> None:
        if len(self._spans) > OPEN_SPANS_MAX:
            self._spans.clear()
        for request_id in request_ids:
            span = self._spans.get(request_id)
            if span is None:
                self._spans[request_id] = [seq, seq]
            else:
                span[1] = seq

    def _pop_span(self, request_id: str) -> list[int] | None:
        """The span of ``request_id`` as the caller names it. vLLM's scheduler names a request
        by that id plus ``-`` and 8 random characters (``InputProcessor.assign_request_id``),
        its outputs by the caller's id."""
        span = self._spans.pop(request_id, None)
        if span is None:
            prefix = request_id + "-"
            key = next((k for k in self._spans if k.startswith(prefix) and len(k) == len(prefix) + 8),
                       None)
            span = self._spans.pop(key) if key is not None else None
        return span

    def _end_span(self, request_id: str) -> None:
        """The request is over: its span (if it was in a timed decode-only step) is reported."""
        span = self._pop_span(request_id)
        if span is not None:
            self._decode_spans.append(DecodeSpan(span[0], span[1]))

    def take_decode_spans(self) -> list[DecodeSpan]:
        """The spans of the requests finished since the last call (at most ``DECODE_SPANS_KEPT``)."""
        return _drained(self._decode_spans)

    def take_decode_steps(self) -> list[DecodeStep]:
        """The decode-only steps timed since the last call (at most ``DECODE_STEPS_KEPT``)."""
        return _drained(self._decode_steps)

    def take_mixed_steps(self) -> list[MixedStep]:
        """The mixed steps timed since the last call (at most ``MIXED_STEPS_KEPT``)."""
        return _drained(self._mixed_steps)

    def _busy(self) -> bool:
        """Requests to step, or KV transfers the connector has not reported finished (a load a
        request waits for, the saves of a finished request whose blocks vLLM holds)."""
        if self.engine.has_unfinished_requests():
            return True
        scheduler = self._scheduler()
        return bool(scheduler is not None and scheduler.has_requests())

    def _only_transfers(self) -> bool:
        """Nothing runs: every request left waits for its KV, or is finished and held."""
        scheduler = self._scheduler()
        return scheduler is not None and not scheduler.running

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            held = next((h for h in self._held if h.request.request_id == command.request_id), None)
            if held is not None:  # never reached the engine
                self._held.remove(held)
                return
            self._prefilling.discard(command.request_id)
            self._admitting.discard(command.request_id)
            self._pop_span(command.request_id)  # aborted: not judged
            if self._sinks.pop(command.request_id, None) is not None:
                self.engine.abort_request([command.request_id])
            self._admit_held()
            return
        if command.gated and self._gate_full():
            self._held.append(command)  # (in arrival order: commands come in the order sent)
            return
        self._add(command)

    def _gate_full(self) -> bool:
        """No gated prompt goes in while the gate is full, or while a hand-off waits for its
        first token (``_leave_room``)."""
        return 0 < self.max_prefills <= len(self._prefilling) or bool(self._admitting)

    def _admit_held(self) -> None:
        """Add held requests while the gate has room, the lowest ``_Add.gate_key`` first (among
        equal keys the first to arrive: ``min`` keeps the first of equal keys)."""
        while self._held and not self._gate_full():
            command = min(self._held, key=lambda held: held.gate_key(self.shortest_first))
            self._held.remove(command)
            self._add(command)

    def _add(self, command: _Add) -> None:
        from vllm.inputs import TokensPrompt

        from kvstore.connector import request_transfer_params

        req = command.request
        s = req.sampling
        transfer = request_transfer_params(req)  # what the KV connector reads of this request
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        self._sinks[req.request_id] = (command.sink, command.loop)
        try:  # vLLM's own checks (SamplingParams and add_request) reject, never kill the engine
            params = sampling_params(s, command.max_tokens, transfer)
            self.engine.add_request(req.request_id, prompt, params, priority=command.priority)
            if command.gated:
                self._prefilling.add(req.request_id)
            elif self.admission_headroom:
                self._admitting.add(req.request_id)
        except Exception as exc:  # rejected by vLLM's own validation
            self._sinks.pop(req.request_id, None)
            rejected = EngineRejected(str(exc))
            command.loop.call_soon_threadsafe(command.sink.put_nowait, rejected)

    def _deliver(self, outputs) -> None:
        """Hand a step's outputs to their requests: one wake-up of each event loop a step, not
        one per output. Each wake-up is a write to the loop's self-pipe from this thread, and
        per output they were 7% of a co-located engine process's busy samples (py-spy, agent
        fleet, 8 streams)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            if (output.request_id in self._prefilling or output.request_id in self._admitting) and (
                    output.finished or any(c.token_ids for c in output.outputs)):
                self._prefilling.discard(output.request_id)  # its prompt is computed
                self._admitting.discard(output.request_id)
            if output.finished:
                entry = self._sinks.pop(output.request_id, None)
                self.num_finished_reqs += 1
                self._end_span(output.request_id)
            else:
                entry = self._sinks.get(output.request_id)
            if entry is not None:
                sink, loop = entry
                batches.setdefault(loop, []).append((sink, output))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        self._admit_held()
