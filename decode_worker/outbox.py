"""One Ray stream per gateway for all its decode streams on an instance, a batch per step.

A streaming Ray call per request sends one item per token: each is pickled, reported to its
owner over gRPC and unpickled there, on the engine's core. With a batch of sequences that is
one crossing per sequence per step, and on a CPU the engine's forward pass waits for the core
while they run (``bench.decode_probe``: 44-48 ms a token at 4 sequences an engine, 36-38 with
crossings cut 8x, a bare engine ~34). Here a gateway opens one stream per decode instance
(``DecodeWorker.outbox``) and starts requests on it (``DecodeWorker.start``); what the
requests' engine step produced goes out as one item, ``[(request_id, chunk or error), ...]``.
Every token still leaves at the end of the step that made it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

from protos.errors import BatonError, InvalidRequest, WorkerFailed
from protos.wire import EngineRequest, TokenChunk

log = logging.getLogger(__name__)

Item = tuple[str, "TokenChunk | BatonError"]
"""(request id, its next chunk, or the error that ended it)."""


class Outbox:
    """One subscriber's started requests and what they produced since its last batch."""

    def __init__(self) -> None:
        self.pending: list[Item] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self.closed = False

    def put(self, request_id: str, item: TokenChunk | BatonError) -> None:
        self.pending.append((request_id, item))
        self._wake.set()

    async def batches(self) -> AsyncIterator[list[Item]]:
        """Each batch once something is pending. The engine hands a step's outputs to the
        event loop in one callback (``EngineRunner._deliver``), so every request's chunk of
        that step is put before this wakes: one step, one batch."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self.pending = self.pending, []
            yield batch

    def close(self) -> None:
        """The subscriber is gone: its requests are cancelled (each aborts in the engine)."""
        self.closed = True
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()


class Outboxes:
    """The outboxes of one decode worker, by subscriber (a gateway's id)."""

    def __init__(self, generate: Callable[[EngineRequest], AsyncIterator[TokenChunk]]) -> None:
        self._generate = generate
        self._by_subscriber: dict[str, Outbox] = {}

    def _get(self, subscriber: str) -> Outbox:
        outbox = self._by_subscriber.get(subscriber)
        if outbox is None or outbox.closed:
            outbox = self._by_subscriber[subscriber] = Outbox()
        return outbox

    async def stream(self, subscriber: str) -> AsyncIterator[list[Item]]:
        """The subscriber's batches until it closes the stream (or dies: Ray cancels it)."""
        outbox = self._get(subscriber)
        try:
            async for batch in outbox.batches():
                yield batch
        finally:
            outbox.close()
            if self._by_subscriber.get(subscriber) is outbox:
                del self._by_subscriber[subscriber]

    def start(self, request: EngineRequest, subscriber: str) -> None:
        """Serve ``request``; its chunks, or the error that ends it, go to ``subscriber``."""
        outbox = self._get(subscriber)
        if request.request_id in outbox.tasks:
            outbox.put(request.request_id, InvalidRequest(
                f"request_id '{request.request_id}' is already in flight on this instance; give "
                "every request its own id (or leave it empty for a generated one)"))
            return
        outbox.tasks[request.request_id] = asyncio.get_running_loop().create_task(
            self._serve(request, outbox))

    def cancel(self, request_id: str, subscriber: str) -> bool:
        """Stop serving a request (its client went away); False when it was not running."""
        outbox = self._by_subscriber.get(subscriber)
        task = outbox.tasks.pop(request_id, None) if outbox is not None else None
        if task is None:
            return False
        task.cancel()
        return True

    def num_streams(self) -> int:
        return sum(len(outbox.tasks) for outbox in self._by_subscriber.values())

    async def _serve(self, request: EngineRequest, outbox: Outbox) -> None:
        request_id = request.request_id
        try:
            async for chunk in self._generate(request):
                outbox.put(request_id, chunk)
        except asyncio.CancelledError:
            return
        except BatonError as exc:
            outbox.put(request_id, exc)
        except Exception as exc:  # noqa: BLE001 - a bug in the worker: the stream fails, not the actor
            log.exception("decode stream %s failed", request_id)
            outbox.put(request_id, WorkerFailed(f"worker error: {exc!r}"))
        finally:
            if outbox.tasks.get(request_id) is asyncio.current_task():
                del outbox.tasks[request_id]
