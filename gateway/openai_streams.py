"""The OpenAI HTTP front's streams: the router's event stream as one choice's chunks
(``choice_chunks``, made an SSE body by ``gateway.openai_choices.sse_choices``) or as one text,
and the client's disconnect as cancellation. ``opened``, ``collect_output``, ``event_stream`` and
``unless_disconnected`` serve the Anthropic routes too (``gateway.anthropic_http``).

Contract: every function here closes the router stream it is handed however it ends (the
workers then abort the request); errors raised inside become ``OpenAIError`` (via
``gateway.openai_errors.translated``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Sequence, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from gateway.inference import NOT_READY_MESSAGE
from gateway.openai_errors import error_for, translated
from gateway.openai_requests import Echo
from gateway.openai_responses import Progress, Shape, piece_delta
from gateway.router import Placed, Router
from gateway.tool_parsers import ToolOutput, finish_reason
from protos.errors import NoWorkerReady
from protos.wire import EngineRequest, PositionLogprobs

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client is gone and never sees it


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()


async def choice_chunks(
    events: AsyncIterator,
    progress: Progress,
    shape: Shape,
    request_id: str,
    with_logprobs: bool = False,
    tools: ToolOutput | None = None,
    index: int = 0,
    echo: Echo | None = None,
) -> AsyncIterator[tuple[dict, dict]]:
    """One choice's chunks, each as (its ``choices`` entry, the chunk's other fields): an
    opening (chat), text deltas (with their tokens' ``logprobs`` when ``with_logprobs``), a
    finish with ``baton``. With ``tools`` (chat) the text goes through the tool-call parser
    first: content deltas and ``tool_calls`` deltas. With ``echo`` (completions) the first
    delta starts with the prompt (and its log-probabilities). Closes ``events`` however it
    ends; errors come out as ``OpenAIError``."""
    text_offset = 0
    prompt_only = echo is not None and echo.prompt_only
    with translated(request_id):
        async with contextlib.aclosing(events):
            if shape.chat:
                yield shape.chunk_choice(None, None, role=True, index=index), {}
            async for event in events:
                progress.add(event)
                text, positions, first_prompt_token = event.text, event.logprobs, None
                if echo is not None:  # the first event: the prompt comes first
                    text, positions, first_prompt_token = echo.first(text, positions,
                                                                     event.prompt_logprobs)
                    echo = None
                elif prompt_only:  # the engine's one token is not part of the answer
                    text, positions = "", ()
                if not (text or (with_logprobs and positions)):
                    continue
                logprobs = None
                if with_logprobs:
                    logprobs, text_offset = shape.logprobs(positions, text_offset,
                                                           first_prompt_token)
                if tools is None:
                    yield shape.chunk_choice(text, None, logprobs=logprobs, index=index), {}
                    continue
                deltas = [piece_delta(piece) for piece in tools.feed(text)]
                for number, delta in enumerate(deltas or ([{}] if logprobs else [])):
                    yield shape.delta_choice(delta, None, logprobs if number == 0 else None,
                                             index=index), {}
            assert progress.finish_reason, "router ended the stream without a finish_reason"
    reason = progress.finish_reason
    if tools is not None:
        for piece in tools.close():
            yield shape.delta_choice(piece_delta(piece), index=index), {}
        reason = finish_reason(reason, tools.calls)
    yield shape.chunk_choice(None, reason, index=index), {"baton": progress.baton()}


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


async def opened(router: Router, request: EngineRequest, http_request: Request
                 ) -> tuple[Placed, AsyncIterator] | None:
    """``open_stream`` once the router is ready (``OpenAIError`` 503 when it is not), or None
    when the client went away first (answer ``CLIENT_CLOSED_REQUEST``)."""
    if not router.is_ready():
        raise error_for(NoWorkerReady(NOT_READY_MESSAGE))
    return await unless_disconnected(http_request, open_stream(router, request))


async def opened_progress(router: Router, request: EngineRequest, http_request: Request,
                          received_at: float) -> tuple[Progress, AsyncIterator] | None:
    """``opened``, with the request's ``Progress`` (TTFT counted from ``received_at``)."""
    placed_events = await opened(router, request, http_request)
    if placed_events is None:
        return None
    placed, events = placed_events
    return Progress(placed, received_at, len(request.prompt_token_ids),
                    leases=request.leases), events


async def collected_text(http_request: Request, events: AsyncIterator, progress: Progress,
                         request_id: str) -> str | None:
    """The whole generated text (``collect_output``), or None when the client went away
    first (answer ``CLIENT_CLOSED_REQUEST``)."""
    output = await unless_disconnected(http_request, collect_output(events, progress, request_id))
    return None if output is None else output[0]


def event_stream(body: AsyncIterator[bytes], events: AsyncIterator | Sequence[AsyncIterator],
                 headers: dict[str, str]) -> StreamingResponse:
    """``body`` (built over the router stream ``events``, or several) as a ``text/event-stream``
    answer that closes them all however the answer ends."""
    streams = [events] if not isinstance(events, Sequence) else list(events)

    async def close_streams() -> None:
        # Starlette abandons the body iterator, or never starts it, when the client
        # disconnects; this closes the router streams without waiting for the GC.
        await body.aclose()
        for stream in streams:
            await stream.aclose()

    return StreamingResponse(body, media_type="text/event-stream",
                             headers=headers | {"Cache-Control": "no-cache"},
                             background=BackgroundTask(close_streams))


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
