"""Several answers to one request: ``n`` engine requests over the same prompt, and their streams
run side by side. Shared by the OpenAI front, the gRPC gateway and the engine gRPC contract.

Contract: ``choice_requests`` splits a checked request into ``n`` engine requests (ids ``<id>``,
``<id>-n1``, ...; with a seed, choice i samples with ``seed + i``, vLLM's rule for ``n`` > 1;
the agent session and its leases ride on the first only, so a session step is one step). The
router places them one after the other, so the conductor sees the first prompt's prefill when
it places the next and coalesces them onto it: the prompt is computed once. ``merged`` yields
the items of several streams as they come (``indexed`` tags each with its choice) and closes
them all however it ends; ``all_or_none`` awaits several answers and cancels the rest when one
fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Sequence, TypeVar

import msgspec

from protos.wire import EngineRequest

T = TypeVar("T")

MAX_CHOICES = 16
"""The most choices one request may ask for: each is a sequence in an engine's batch."""


def choice_request_id(request_id: str, index: int) -> str:
    """The engine request id of choice ``index`` (the first keeps the request's own)."""
    return request_id if index == 0 else f"{request_id}-n{index}"


def choice_requests(request: EngineRequest, n: int) -> list[EngineRequest]:
    """The ``n`` engine requests of an ``n``-choice request (module docstring)."""
    assert 1 <= n <= MAX_CHOICES, n
    sampling = request.sampling
    others = [msgspec.structs.replace(
        request, request_id=choice_request_id(request.request_id, i), session_id="", leases=(),
        expected_next_step_s=0.0,
        sampling=(sampling if sampling.seed is None
                  else msgspec.structs.replace(sampling, seed=sampling.seed + i)))
        for i in range(1, n)]
    return [request, *others]


async def all_or_none(awaitables: Sequence) -> list:
    """Every result, in order; when one raises, the others are cancelled and done before the
    error comes out (so each closes its stream)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Every item of ``iterators`` as it comes; the first error ends it. However it ends, every
    iterator is closed."""
    items: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await items.put((item, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await items.put((None, e))
            return
        await items.put((done, None))

    pumps = [asyncio.ensure_future(pump(iterator)) for iterator in iterators]
    try:
        remaining = len(pumps)
        while remaining:
            item, error = await items.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for iterator in iterators:
            with contextlib.suppress(Exception):
                await iterator.aclose()


async def indexed(index: int, events: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """``events`` (one choice's stream) as (``index``, event) pairs, to tell the choices apart
    once ``merged``; closing it closes ``events``."""
    async with contextlib.aclosing(events):
        async for event in events:
            yield index, event
