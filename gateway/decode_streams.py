"""The gateway's end of the decode outboxes (``decode_worker.outbox``): one Ray stream per decode
instance carries every stream this gateway runs there, a batch per engine step, and is split
here into each request's chunks."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator

import ray
from protos.errors import BatonError, InvalidRequest, WorkerFailed
from protos.wire import CallCounts, EngineRequest, TokenChunk

log = logging.getLogger(__name__)


class InstanceLost(Exception):
    """The instance's outbox stream broke: its actor died (``cause``: Ray's error)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"decode outbox lost: {cause!r}")
        self.cause = cause


class DecodeStreams:
    """Every decode stream this gateway runs on one decode instance."""

    def __init__(self, handle, subscriber: str, calls: CallCounts) -> None:
        self._handle = handle
        self._subscriber = subscriber
        self._calls = calls
        self._queues: dict[str, asyncio.Queue] = {}
        self.lost: InstanceLost | None = None
        calls.count("decode.outbox")  # once per instance, however many requests
        self._refs = handle.outbox.options(num_returns="streaming").remote(subscriber)
        self._pump = asyncio.get_running_loop().create_task(self._split())

    async def _split(self) -> None:
        try:
            async for ref in self._refs:
                for request_id, item in await ref:
                    queue = self._queues.get(request_id)
                    if queue is not None:  # else it was cancelled: its last chunks are dropped
                        queue.put_nowait(item)
            raise WorkerFailed("the decode instance closed its outbox")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every stream on it learns why
            self.lost = InstanceLost(exc)
            for queue in self._queues.values():
                queue.put_nowait(self.lost)

    async def stream(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        """``request``'s chunks until its last; ``InstanceLost`` when the instance's stream
        broke, the worker's ``BatonError`` as itself."""
        request_id = request.request_id
        if self.lost is not None:
            raise self.lost
        if request_id in self._queues:
            raise InvalidRequest(
                f"request_id '{request_id}' is already in flight on this instance; give every "
                "request its own id (or leave it empty for a generated one)")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._calls.count("decode.start", "sent")
        self._handle.start.remote(request, self._subscriber)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, InstanceLost):
                    raise item
                if isinstance(item, BatonError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            del self._queues[request_id]
            if not finished and self.lost is None:
                self._calls.count("decode.cancel", "sent")
                self._handle.cancel.remote(request_id, self._subscriber)

    def close(self) -> None:
        """Stop splitting and end the instance's outbox (its requests are cancelled there)."""
        self._pump.cancel()
        if self.lost is None and ray.is_initialized():
            try:
                ray.cancel(self._refs)
            except Exception:  # noqa: BLE001 - Ray is shutting down, or the actor is gone
                log.debug("could not cancel a decode outbox", exc_info=True)


def new_subscriber_id() -> str:
    """A gateway's name on the decode instances' outboxes."""
    return f"gateway-{uuid.uuid4().hex[:12]}"

