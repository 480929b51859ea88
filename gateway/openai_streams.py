"""The OpenAI HTTP front's streams: the router's event stream as an SSE body or as one text, and
the client's disconnect as cancellation.

Contract: every function here closes the router stream it is handed however it ends (the
workers then abort the request); errors raised inside become ``OpenAIError`` (via
``gateway.openai_errors.translated``); once the first SSE byte is out they become an
``error`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, TypeVar

import msgspec
from fastapi import Request

from gateway.openai_errors import OpenAIError, translated
from gateway.openai_responses import Progress, Shape
from gateway.router import Placed, Router
from protos.wire import EngineRequest, PositionLogprobs

T = TypeVar("T")


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()


async def sse_events(
    events: AsyncIterator,
    progress: Progress,
    shape: Shape,
    header: dict,
    include_usage: bool,
    request_id: str,
    with_logprobs: bool = False,
) -> AsyncIterator[bytes]:
    """The SSE body: an opening chunk (chat), text deltas (with their tokens' ``logprobs`` when
    ``with_logprobs``), a finish chunk with ``baton``, an optional usage chunk, ``[DONE]``. An
    error after the first byte becomes an ``error`` event.
    """
    usage_field = {"usage": None} if include_usage else {}
    text_offset = 0
    try:
        with translated(request_id):
            async with contextlib.aclosing(events):
                if shape.chat:
                    opening = shape.chunk_choice(None, None, role=True)
                    yield sse({**header, "choices": [opening], **usage_field})
                async for event in events:
                    progress.add(event)
                    if event.text or (with_logprobs and event.logprobs):
                        logprobs = None
                        if with_logprobs:
                            logprobs, text_offset = shape.logprobs(event.logprobs, text_offset)
                        choice = shape.chunk_choice(event.text, None, logprobs=logprobs)
                        yield sse({**header, "choices": [choice], **usage_field})
                assert progress.finish_reason, "router ended the stream without a finish_reason"
        finish = shape.chunk_choice(None, progress.finish_reason)
        yield sse({**header, "choices": [finish], **usage_field, "baton": progress.baton()})
        if include_usage:
            yield sse({**header, "choices": [], "usage": progress.usage()})
    except OpenAIError as e:
        yield sse(e.body)
    yield sse("[DONE]")


async def collect_output(events: AsyncIterator, progress: Progress,
                         request_id: str) -> tuple[str, list[PositionLogprobs]]:
    """The whole generated text and its tokens' log-probabilities (empty unless asked for);
    closes ``events`` however it ends."""
    text_parts: list[str] = []
    positions: list[PositionLogprobs] = []
    with translated(request_id):
        async with contextlib.aclosing(events):
            async for event in events:
                progress.add(event)
                text_parts.append(event.text)
                positions.extend(event.logprobs)
        assert progress.finish_reason, "router ended the stream without a finish_reason"
    return "".join(text_parts), positions


async def open_stream(router: Router, request: EngineRequest) -> tuple[Placed, AsyncIterator]:
    """Starts the router's stream and waits for ``Placed``, so that placement errors still get
    a proper HTTP status; the caller owns (and must close) the returned stream."""
    events = router.stream(request)
    try:
        with translated(request.request_id):
            placed = await anext(events)
            assert isinstance(placed, Placed), "router sent a token chunk before Placed"
    except BaseException:
        await events.aclose()
        raise
    return placed, events


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or ``None`` after cancelling it because the client went away."""
    work_task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.wait({work_task})
    return None if work_task.cancelled() else work_task.result()
