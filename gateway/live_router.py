"""The live router: serves a request through the conductor and the Ray worker actors.

place (conductor) → prefill (prefill actor; KV lands in the store) → decode (decode actor,
streamed back over its outbox: one Ray stream per instance, a batch per engine step,
``gateway.decode_streams``; or one Ray stream per request, ``decode_stream="per_request"``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import msgspec
import ray
from ray.exceptions import RayActorError, RayTaskError

from conductor.policy import Overloaded
from gateway import metrics
from gateway.decode_streams import DecodeStreams, InstanceLost, new_subscriber_id
from gateway.router import Placed, RouterEvent
from kvstore.keys import (
    KEY_SIZE_BYTES,
    KeyExtras,
    first_salted_block,
    pack_keys,
    prompt_block_keys,
    unpack_keys,
)
from protos.errors import BatonError, NoWorkerReady, WorkerFailed
from protos.wire import (
    CallCounts,
    EngineRequest,
    Placement,
    PlacementRequest,
    PrefillResult,
    PromptBlocks,
    SessionEnd,
    TokenChunk,
)

log = logging.getLogger(__name__)

MAX_PREFILL_ATTEMPTS = 3
"""Placements one request may get when its prefill worker dies before answering."""
MAX_DECODE_CONTINUATIONS = 2
DECODE_STREAMS = ("multiplexed", "per_request")
"""How tokens come back from a decode instance: its outbox, one Ray stream per instance
carrying a batch per engine step (``decode_worker.outbox``), or a Ray stream per request."""
"""Times one stream may move to another decode instance after its decode worker died."""


class PrefillWorkerDied(Exception):
    """The prefill actor died before answering: nothing reached the client, so it is re-placed."""


class DecodeWorkerDied(Exception):
    """The decode actor died mid-stream (the stream knows how many tokens reached the client)."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(f"decode instance {instance_id} died mid-stream")
        self.instance_id = instance_id


def continuation(request: EngineRequest, generated: list[int]) -> EngineRequest:
    """The rest of ``request`` after ``generated`` tokens reached the client: those tokens join
    the prompt (their KV is recomputed; the prompt's own KV is in the store) and the budget
    shrinks by as many. Under greedy decoding the continuation is the tokens the lost instance
    would have produced; a sampled one is a fresh draw from the same distribution.
    ``min_tokens`` shrinks by as many too; the output penalties (presence, frequency) count the
    continuation's own tokens only, as the generated ones are now prompt. The prompt's
    log-probabilities went out with the first chunk: the continuation asks for none."""
    sampling = msgspec.structs.replace(
        request.sampling, max_tokens=request.sampling.max_tokens - len(generated),
        min_tokens=max(0, request.sampling.min_tokens - len(generated)),
        num_prompt_logprobs=None)
    prompt = request.prompt_token_ids + tuple(generated)
    blocks = request.blocks
    if blocks is not None:  # the prompt's full blocks keep their keys; the reply's are hashed here
        blocks = prompt_blocks(prompt, request.cache_salt, blocks.model_id, blocks.kv_layout,
                               blocks.block_size_tokens,
                               unpack_keys(blocks.keys)[:blocks.num_full_blocks],
                               cache_salt_offset=request.cache_salt_offset)
    return msgspec.structs.replace(request, prompt_token_ids=prompt, sampling=sampling,
                                   kv_source_node="", kv_source_blocks=None, blocks=blocks)


def prompt_blocks(token_ids: tuple[int, ...], cache_salt: str, model_id: str, kv_layout: str,
                  block_size_tokens: int, known_full: list[bytes] | tuple = (), *,
                  cache_salt_offset: int = 0) -> PromptBlocks:
    """The block identity of a prompt under the engines' key scheme: the one place a request's
    prompt is hashed (``known_full``: keys of its leading full blocks, hashed before). The salt
    applies from token ``cache_salt_offset`` on (``kvstore.keys``: segmented salts)."""
    extras = KeyExtras(model_id, cache_salt, "", kv_layout,
                       first_salted_block(cache_salt_offset, block_size_tokens))
    keys = prompt_block_keys(token_ids, block_size_tokens, extras, known_full)
    return PromptBlocks(model_id, kv_layout, pack_keys(keys), block_size_tokens,
                        len(token_ids) // block_size_tokens)


def full_block_keys(request: EngineRequest) -> tuple[bytes, ...]:
    """The keys of the request's full prompt blocks (what the KV index matches), if it has any."""
    blocks = request.blocks
    if blocks is None:
        return ()
    return tuple(unpack_keys(blocks.keys[:blocks.num_full_blocks * KEY_SIZE_BYTES]))


class LiveRouter:
    """Implements ``gateway.router.Router`` on a running Ray cluster."""

    def __init__(self, conductor, namespace: str, readiness_interval_s: float = 0.5,
                 decode_stream: str = "multiplexed", lookup_device_hits: bool = True) -> None:
        if decode_stream not in DECODE_STREAMS:
            raise ValueError(f"decode_stream must be one of {DECODE_STREAMS}, not {decode_stream!r}")
        self._decode_stream = decode_stream
        self._lookup_device_hits = lookup_device_hits  # ``gateway.lookup_device_hits``
        self._subscriber = new_subscriber_id()
        self._streams: dict[str, DecodeStreams] = {}
        self._conductor = conductor
        self._namespace = namespace
        self._ready = False
        self._handles: dict[str, ray.actor.ActorHandle] = {}
        self._interval_s = readiness_interval_s
        self._watcher: asyncio.Task | None = None
        self._scheme = None
        self.calls = CallCounts()
        """The remote calls this router made on behalf of requests (not its readiness polls)."""

    def call_counts(self) -> CallCounts:
        return self.calls.snapshot()

    def _finished(self, request_id: str, handoff_ms: float | None = None) -> None:
        self.calls.count("conductor.finished", "sent")
        self._conductor.finished.remote(request_id, handoff_ms)

    async def _finished_before_placing_again(self, request_id: str) -> None:
        """Close the books of a placement that failed before placing the request again: an async
        actor need not run one caller's calls in the order sent (only on a worker's death)."""
        self.calls.count("conductor.finished")
        await self._conductor.finished.remote(request_id)

    def start(self) -> None:
        """Begin polling the conductor for readiness (call from the serving event loop)."""
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        """Stop polling (before Ray shuts down: a call after that would start a new Ray)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        self._ready = False
        for streams in self._streams.values():
            streams.close()
        self._streams.clear()

    async def _watch(self) -> None:
        """Poll readiness; the engines' key scheme is fetched here too, once, before the router
        says it is ready (an engine registers before it is ready), so no request waits for it."""
        while True:
            try:
                ready = await self._conductor.is_ready.remote()
                if ready and self._scheme is None:
                    self._scheme = await self._conductor.key_scheme.remote()
                self._ready = ready
            except Exception:
                self._ready = False
            await asyncio.sleep(self._interval_s)

    def is_ready(self) -> bool:
        return self._ready

    def _handle(self, instance_id: str):
        handle = self._handles.get(instance_id)
        if handle is None:
            self.calls.count("gcs.get_actor")
            handle = ray.get_actor(instance_id, namespace=self._namespace)
            self._handles[instance_id] = handle
        return handle

    async def _with_blocks(self, request: EngineRequest) -> EngineRequest:
        """``request`` with its prompt's block keys under the engines' key scheme (fetched
        once): hashed here, once, and carried to the conductor, the workers and their engines'
        connectors. Unchanged when it carries them already or no engine has registered yet."""
        if request.blocks is not None:
            return request
        if self._scheme is None:  # not fetched by the watcher yet (a router used unstarted)
            self.calls.count("conductor.key_scheme")
            self._scheme = await self._conductor.key_scheme.remote()
        scheme = self._scheme
        if scheme is None:
            return request
        return msgspec.structs.replace(request, blocks=prompt_blocks(
            request.prompt_token_ids, request.cache_salt, scheme.model_id, scheme.kv_layout,
            scheme.block_size_tokens, cache_salt_offset=request.cache_salt_offset))

    @staticmethod
    def _placement_request(request: EngineRequest) -> PlacementRequest:
        """The request as the conductor prices it: its full-block keys, so the KV index can
        match them. A request for its prompt's log-probabilities reuses nothing (it is priced
        and placed with no keys) and is computed where it is decoded (``colocate``)."""
        ttl_s = next((lease.ttl_s for lease in request.leases
                      if lease.lease_id == request.session_id), 0.0)
        whole_prompt = request.sampling.num_prompt_logprobs is not None
        return PlacementRequest(request.request_id, len(request.prompt_token_ids),
                                () if whole_prompt else full_block_keys(request),
                                request.sampling.max_tokens,
                                session_id=request.session_id,
                                expected_next_step_s=request.expected_next_step_s,
                                session_ttl_s=ttl_s,
                                segmented_salt=bool(request.cache_salt and request.cache_salt_offset),
                                colocate=whole_prompt)

    async def stream(self, request: EngineRequest) -> AsyncIterator[RouterEvent]:
        timer = metrics.RequestTimer(time.perf_counter())
        request = await self._with_blocks(request)
        placement_request = self._placement_request(request)
        timer.kv_bytes_per_token = getattr(self._scheme, "kv_bytes_per_token", 0)
        placement, prefilled = await self._place_and_prefill(request, placement_request)
        prefilled_s = time.perf_counter()
        # from the prefill's result to the decode's first token, when disaggregated: what the
        # conductor calibrates the priced hand-off on (reported with the request's end)
        handoff_ms: float | None = None
        measure_handoff = placement.prefill_instance != placement.decode_instance
        generated: list[int] = []
        current = request
        try:
            for moves in range(MAX_DECODE_CONTINUATIONS + 1):
                try:
                    async for event in self._serve(current, placement, prefilled, first=moves == 0):
                        if isinstance(event, Placed):
                            timer.placed(event.placement, event.prefill)
                        else:
                            if measure_handoff and event.token_ids:
                                handoff_ms = (time.perf_counter() - prefilled_s) * 1000.0
                                measure_handoff = False
                            generated.extend(event.token_ids)
                            if moves and event.finish_reason is not None:
                                event = _as_original(event, len(request.prompt_token_ids))
                            timer.chunk(event, time.perf_counter())
                        yield event
                    return
                except DecodeWorkerDied as exc:
                    failure = (f"decode instance {exc.instance_id} died after {len(generated)} tokens "
                               "were delivered; the request can be retried")
                    if moves == MAX_DECODE_CONTINUATIONS:
                        raise WorkerFailed(f"{failure} (moved {moves} times already)") from exc
                    if request.sampling.constrained():  # the grammar's state died with it
                        raise WorkerFailed(f"{failure}; a structured-output stream cannot "
                                           "continue elsewhere") from exc
                # Tokens already reached the client: continue the stream from them on another
                # decode instance instead of failing it.
                await self._finished_before_placing_again(request.request_id)
                if len(generated) >= request.sampling.max_tokens:  # died before its last word
                    yield TokenChunk((), "", finish_reason="length")
                    return
                metrics.RETRIES.labels("decode_worker_died").inc()
                log.warning("request %s: %s; continuing on another decode instance",
                            request.request_id, failure)
                current = continuation(request, generated)
                handoff_ms, measure_handoff = None, False  # not the continuation's hand-off
                try:
                    placement, prefilled = await self._place_and_prefill(
                        current, self._placement_request(current))
                except (NoWorkerReady, Overloaded, WorkerFailed) as error:
                    raise WorkerFailed(f"{failure}; no other decode instance could continue it: "
                                       f"{error}") from error
        finally:  # however it ended, the conductor's books must close
            self._finished(request.request_id, handoff_ms)

    async def _place_and_prefill(self, request: EngineRequest,
                                 placement_request: PlacementRequest) -> tuple[Placement, PrefillResult]:
        """Place and prefill, placing again (up to ``MAX_PREFILL_ATTEMPTS``) when the prefill
        worker dies before answering: nothing reached the client from it."""
        for attempt in range(MAX_PREFILL_ATTEMPTS):
            placement = await self._place(placement_request)
            try:
                return placement, await self._prefill(request, placement)
            except PrefillWorkerDied as exc:
                # nothing reached the client yet: close the books and place it again elsewhere
                await self._finished_before_placing_again(request.request_id)
                metrics.RETRIES.labels("prefill_worker_died").inc()
                if attempt + 1 == MAX_PREFILL_ATTEMPTS:
                    raise WorkerFailed(f"{exc}; gave up after {MAX_PREFILL_ATTEMPTS} placements") from exc
                log.warning("request %s: %s; placing it again", request.request_id, exc)
            except BaseException:
                self._finished(request.request_id)
                raise
        raise AssertionError("unreachable")

    async def _place(self, placement_request: PlacementRequest) -> Placement:
        try:
            self.calls.count("conductor.place")
            return await self._conductor.place.remote(placement_request)
        except RayTaskError as exc:
            error = _unwrap(exc)
            if isinstance(error, Overloaded):
                metrics.REJECTIONS.labels(metrics.rejection_reason(str(error))).inc()
            elif isinstance(error, NoWorkerReady):
                metrics.REJECTIONS.labels("no_worker_ready").inc()
            raise error from exc

    async def close_session(self, session_id: str) -> SessionEnd | None:
        """End the scoped session ``session_id`` (``gateway.sessions``): the conductor forgets
        it and the store nodes release its lease. None: no such live session."""
        self.calls.count("conductor.close_session")
        return await self._conductor.close_session.remote(session_id)

    def _report_dead(self, instance_id: str, exc: BaseException) -> None:
        self._handles.pop(instance_id, None)
        streams = self._streams.pop(instance_id, None)
        if streams is not None:
            streams.close()
        self.calls.count("conductor.report_failure", "sent")
        self._conductor.report_failure.remote(instance_id, type(exc).__name__)

    async def _prefill(self, request: EngineRequest, placement: Placement) -> PrefillResult:
        if placement.prefill_instance == placement.decode_instance:
            # Conditional disaggregation: the decode engine loads the cached prefix and computes
            # the short suffix itself; what it reused is reported with the last token chunk.
            return PrefillResult(request.request_id, placement.decode_instance,
                                 len(request.prompt_token_ids), 0, 0, 0.0,
                                 node_id=placement.pulled_from_node)
        request = msgspec.structs.replace(request, predicted_prefill_ms=placement.prefill_ms)
        if placement.pulled_from_node:  # the conductor's transfer plan: that node's prefix
            request = msgspec.structs.replace(request, kv_source_node=placement.pulled_from_node,
                                              kv_source_blocks=placement.expected_cached_blocks)
        elif not placement.expected_cached_blocks:  # nothing cached: no store lookup either
            request = msgspec.structs.replace(request, store_lookup=False)
        try:
            handle = self._handle(placement.prefill_instance)
            self.calls.count("prefill.prefill")
            result = await handle.prefill.remote(
                request, placement.priority)
        except (RayActorError, ValueError) as exc:  # the actor died, or its name is gone
            self._report_dead(placement.prefill_instance, exc)
            raise PrefillWorkerDied(f"prefill instance {placement.prefill_instance} died") from exc
        except RayTaskError as exc:
            raise _unwrap(exc) from exc
        self.calls.count("conductor.prefill_done", "sent")
        self._conductor.prefill_done.remote(request.request_id, result.num_cached_tokens,
                                            result.engine_prefill_ms)
        return result

    async def _serve(self, request: EngineRequest, placement: Placement,
                     prefilled: PrefillResult, first: bool = True) -> AsyncIterator[RouterEvent]:
        if first:  # a continuation keeps the stream's one Placed
            yield Placed(placement, prefilled)
        colocated = placement.prefill_instance == placement.decode_instance
        if placement.prefill_instance == placement.decode_instance:
            # it prefills itself: its gate orders it by the priced prefill (and the conductor's
            # transfer plan, when it pulls a prefix)
            request = msgspec.structs.replace(request, predicted_prefill_ms=placement.prefill_ms)
            if placement.pulled_from_node:
                request = msgspec.structs.replace(
                    request, kv_source_node=placement.pulled_from_node,
                    kv_source_blocks=placement.expected_cached_blocks)
            elif request.sampling.num_prompt_logprobs is not None or (
                    not self._lookup_device_hits and not needs_store_lookup(placement)):
                # nothing to load; a request for its prompt's log-probabilities computes the
                # whole prompt (vLLM ignores what a connector finds for it): not asking the
                # store saves its round trip and pins
                request = msgspec.structs.replace(request, store_lookup=False)
        else:  # the prompt was computed on the prefill instance: loaded here, pulled first
            # from the prefill's node when that is another one
            request = msgspec.structs.replace(
                request, computes_prompt=False,
                kv_source_node=prefilled.node_id or request.kv_source_node)
        try:
            decode = self._handle(placement.decode_instance)
        except ValueError as exc:  # the named actor is gone
            raise WorkerFailed(
                f"decode instance {placement.decode_instance} is gone; retry: {exc}"
            ) from exc
        if self._decode_stream == "multiplexed":
            async for chunk in self._multiplexed(placement.decode_instance, decode, request):
                if chunk.engine_prefill is not None and colocated:
                    self._prefill_ran(request.request_id, chunk)
                yield chunk
            return
        self.calls.count("decode.generate")  # one streaming call, however many chunks
        chunks = decode.generate.options(num_returns="streaming").remote(request)
        finished = False
        try:
            async for ref in chunks:
                chunk: TokenChunk = await ref
                finished = chunk.finish_reason is not None
                if chunk.engine_prefill is not None and colocated:
                    self._prefill_ran(request.request_id, chunk)
                yield chunk
        except RayActorError as exc:
            self._report_dead(placement.decode_instance, exc)
            raise DecodeWorkerDied(placement.decode_instance) from exc
        except RayTaskError as exc:
            raise _unwrap(exc) from exc
        finally:
            if not finished:
                self.calls.count("decode.cancel", "sent")
                ray.cancel(chunks)


    def _prefill_ran(self, request_id: str, chunk: TokenChunk) -> None:
        """The prefill a decode instance ran itself is over: the queue book and the cost model
        hear of it."""
        self.calls.count("conductor.prefill_done", "sent")
        self._conductor.prefill_done.remote(request_id, chunk.engine_prefill.num_cached_tokens,
                                            chunk.engine_prefill.prefill_ms)

    async def _multiplexed(self, instance_id: str, decode,
                           request: EngineRequest) -> AsyncIterator[TokenChunk]:
        """``request``'s chunks over the instance's outbox (opened at its first request)."""
        streams = self._streams.get(instance_id)
        if streams is None or streams.lost is not None:
            streams = self._streams[instance_id] = DecodeStreams(decode, self._subscriber,
                                                                 self.calls)
        try:
            async for chunk in streams.stream(request):
                yield chunk
        except InstanceLost as lost:
            if self._streams.get(instance_id) is streams:
                del self._streams[instance_id]
                streams.close()
            if isinstance(lost.cause, (RayActorError, ValueError)):  # died, or its name is gone
                self._report_dead(instance_id, lost.cause)
                raise DecodeWorkerDied(instance_id) from lost.cause
            if isinstance(lost.cause, RayTaskError):
                raise _unwrap(lost.cause) from lost.cause
            raise WorkerFailed(f"decode instance {instance_id}: {lost.cause}") from lost.cause


def needs_store_lookup(placement: Placement) -> bool:
    """Whether a co-located prefill's engine should ask its node's store for the prompt's
    blocks: not when the index says all the blocks it can reuse are in the engine's own cache
    (``Placement.device_blocks``), where the answer adds nothing and, on an engine stepping
    other sequences, a lookup not back within a few ms costs the request a step. Where the
    index knows of no reusable block at all it asks: the store may hold what the index missed,
    and without the lookup the engine computes the whole prompt."""
    return not 0 < placement.expected_cached_blocks <= placement.device_blocks


def _as_original(chunk: TokenChunk, num_prompt_tokens: int) -> TokenChunk:
    """A continuation's last chunk, its prompt accounting capped to the original prompt (the
    continuation's prompt also held the tokens generated before the move)."""
    return msgspec.structs.replace(
        chunk, num_loaded_tokens=min(chunk.num_loaded_tokens, num_prompt_tokens),
        num_cached_tokens=min(chunk.num_cached_tokens, num_prompt_tokens))


def _unwrap(exc: RayTaskError) -> BatonError:
    """The Baton error a worker or the conductor raised, as itself (class and attributes intact:
    the fronts map it, ``gateway.status``). Anything else from a worker is a bug there, which
    the client sees as a failed worker."""
    if isinstance(exc.cause, BatonError):
        return exc.cause
    return WorkerFailed(f"worker error: {exc.cause!r}")
