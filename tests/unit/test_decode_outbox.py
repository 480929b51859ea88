"""Decode outboxes (``decode_worker.outbox`` and ``gateway.decode_streams``): what an engine step
produced for several requests leaves as one item; a request's chunks reach only its own stream,
in order; a cancelled request stops in the worker; a worker's error ends only its request; a
lost instance ends every stream on it; a closed outbox cancels what it carried."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.outbox import Outboxes
from gateway.decode_streams import DecodeStreams, InstanceLost
from protos.errors import InvalidRequest, WorkerFailed
from protos.wire import CallCounts, EngineRequest, SamplingOptions, TokenChunk


def _request(request_id: str, max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(request_id, (1, 2, 3), SamplingOptions(max_tokens=max_tokens))


class _Engine:
    """Steps every running request together: one chunk each per ``step``."""

    def __init__(self) -> None:
        self.running: dict[str, asyncio.Queue] = {}
        self.aborted: list[str] = []

    async def step(self) -> None:
        for queue in self.running.values():
            queue.put_nowait(None)
        await asyncio.sleep(0.005)

    async def generate(self, request: EngineRequest):
        rid = request.request_id
        self.running[rid] = queue = asyncio.Queue()
        try:
            for i in range(request.sampling.max_tokens):
                await queue.get()
                if rid == "bad" and i == 1:
                    raise InvalidRequest("bad at token 1")
                if rid == "bug" and i == 1:
                    raise KeyError("oops")
                last = i == request.sampling.max_tokens - 1
                yield TokenChunk((100 + i,), f"t{i}", finish_reason="length" if last else None)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise
        finally:
            del self.running[rid]


def test_one_engine_step_of_several_requests_leaves_as_one_batch():
    async def go():
        engine = _Engine()
        outboxes = Outboxes(engine.generate)
        stream = outboxes.stream("g1")
        first = asyncio.ensure_future(stream.__anext__())
        for rid in ("a", "b", "c"):
            outboxes.start(_request(rid, 2), "g1")
        await asyncio.sleep(0.005)  # all three running
        await engine.step()
        batch = await first
        await engine.step()
        second = await stream.__anext__()
        await stream.aclose()
        return batch, second, outboxes.num_streams()

    batch, second, left = asyncio.run(go())
    assert batch == [(rid, TokenChunk((100,), "t0")) for rid in ("a", "b", "c")]
    assert second == [(rid, TokenChunk((101,), "t1", finish_reason="length")) for rid in "abc"]
    assert left == 0


def test_an_error_ends_only_its_request_and_a_bug_reads_as_a_failed_worker():
    async def go():
        engine = _Engine()
        outboxes = Outboxes(engine.generate)
        stream = outboxes.stream("g1")
        for rid in ("ok", "bad", "bug"):
            outboxes.start(_request(rid, 2), "g1")
        await asyncio.sleep(0.005)
        items = []
        for _ in range(2):
            await engine.step()
            items += await stream.__anext__()
        await stream.aclose()
        return items

    items = asyncio.run(go())
    ok = [item for rid, item in items if rid == "ok"]
    assert ok == [TokenChunk((100,), "t0"), TokenChunk((101,), "t1", finish_reason="length")]
    [bad_last] = [item for rid, item in items if rid == "bad"][1:]
    assert isinstance(bad_last, InvalidRequest) and str(bad_last) == "bad at token 1"
    [bug_last] = [item for rid, item in items if rid == "bug"][1:]
    assert isinstance(bug_last, WorkerFailed) and str(bug_last) == "worker error: KeyError('oops')"


def test_cancel_stops_the_request_in_the_worker_and_closing_the_outbox_cancels_the_rest():
    async def go():
        engine = _Engine()
        outboxes = Outboxes(engine.generate)
        stream = outboxes.stream("g1")
        outboxes.start(_request("a", 5), "g1")
        outboxes.start(_request("b", 5), "g1")
        await asyncio.sleep(0.005)
        await engine.step()
        await stream.__anext__()
        cancelled = outboxes.cancel("a", "g1"), outboxes.cancel("a", "g1")
        await asyncio.sleep(0.01)
        after_cancel = list(engine.aborted)
        await stream.aclose()  # the gateway went away
        await asyncio.sleep(0.01)
        return cancelled, after_cancel, engine.aborted, outboxes.num_streams()

    cancelled, after_cancel, aborted, left = asyncio.run(go())
    assert cancelled == (True, False)
    assert after_cancel == ["a"]
    assert aborted == ["a", "b"]
    assert left == 0


def test_a_request_id_already_in_flight_from_the_same_gateway_is_an_invalid_request():
    async def go():
        engine = _Engine()
        outboxes = Outboxes(engine.generate)
        stream = outboxes.stream("g1")
        outboxes.start(_request("a"), "g1")
        outboxes.start(_request("a"), "g1")
        batch = await stream.__anext__()
        await stream.aclose()
        return batch

    [(rid, error)] = asyncio.run(go())
    assert rid == "a" and isinstance(error, InvalidRequest)
    assert str(error).startswith("request_id 'a' is already in flight on this instance")


class _Remote:
    def __init__(self, fn) -> None:
        self.remote = fn

    def options(self, **_):
        return self


class _Handle:
    """A decode actor handle over an in-process ``Outboxes``: the outbox's batches as refs."""

    def __init__(self, outboxes: Outboxes, fail_after: int | None = None) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []

        def outbox(subscriber):
            async def refs():
                sent = 0
                async for batch in outboxes.stream(subscriber):
                    if fail_after is not None and sent == fail_after:
                        raise ConnectionError("the actor died")
                    future = asyncio.get_running_loop().create_future()
                    future.set_result(batch)
                    sent += 1
                    yield future

            return refs()

        def start(request, subscriber):
            self.started.append(request.request_id)
            outboxes.start(request, subscriber)

        def cancel(request_id, subscriber):
            self.cancelled.append(request_id)
            outboxes.cancel(request_id, subscriber)

        self.outbox, self.start, self.cancel = _Remote(outbox), _Remote(start), _Remote(cancel)


async def _drive(engine: _Engine, until: asyncio.Future) -> None:
    for _ in range(100):
        if until.done():
            return
        await engine.step()
    raise AssertionError("still streaming after 100 steps")


def test_the_gateway_splits_the_batches_into_each_requests_stream_in_order():
    async def go():
        engine = _Engine()
        calls = CallCounts()
        streams = DecodeStreams(_Handle(Outboxes(engine.generate)), "g1", calls)

        async def collect(rid, n):
            return [chunk async for chunk in streams.stream(_request(rid, n))]

        both = asyncio.gather(collect("a", 2), collect("b", 3))
        await _drive(engine, both)
        streams.close()
        return await both, calls

    (a, b), calls = asyncio.run(go())
    assert [c.token_ids for c in a] == [(100,), (101,)]
    assert [c.token_ids for c in b] == [(100,), (101,), (102,)]
    assert a[-1].finish_reason == b[-1].finish_reason == "length"
    assert calls == CallCounts(blocking={"decode.outbox": 1}, sent={"decode.start": 2})


def test_a_stream_the_client_leaves_is_cancelled_on_the_instance():
    async def go():
        engine = _Engine()
        handle = _Handle(Outboxes(engine.generate))
        streams = DecodeStreams(handle, "g1", CallCounts())

        async def first_only():
            async for chunk in streams.stream(_request("a", 5)):
                return chunk

        first = asyncio.ensure_future(first_only())
        await _drive(engine, first)
        await asyncio.sleep(0.01)
        streams.close()
        return await first, handle, engine.aborted

    chunk, handle, aborted = asyncio.run(go())
    assert chunk.token_ids == (100,)
    assert handle.cancelled == ["a"] and aborted == ["a"]


def test_a_lost_instance_ends_every_stream_on_it_and_later_ones_at_once():
    async def go():
        engine = _Engine()
        streams = DecodeStreams(_Handle(Outboxes(engine.generate), fail_after=1), "g1",
                                CallCounts())
        got: dict[str, list] = {"a": [], "b": []}

        async def collect(rid):
            async for chunk in streams.stream(_request(rid, 5)):
                got[rid].append(chunk.token_ids)

        both = asyncio.gather(collect("a"), collect("b"), return_exceptions=True)
        await _drive(engine, both)
        errors = await both
        with pytest.raises(InstanceLost):
            async for _ in streams.stream(_request("c")):
                pass
        return got, errors

    got, errors = asyncio.run(go())
    assert got == {"a": [(100,)], "b": [(100,)]}
    assert all(isinstance(e, InstanceLost) and isinstance(e.cause, ConnectionError)
               for e in errors)


def test_the_gateway_refuses_a_request_id_already_streaming_on_the_instance():
    async def go():
        engine = _Engine()
        handle = _Handle(Outboxes(engine.generate))
        streams = DecodeStreams(handle, "g1", CallCounts())
        first = streams.stream(_request("a", 5))
        started = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0.005)
        with pytest.raises(InvalidRequest, match="request_id 'a' is already in flight"):
            async for _ in streams.stream(_request("a")):
                pass
        await engine.step()
        chunk = await started
        await first.aclose()
        streams.close()
        return chunk, handle.started

    chunk, started = asyncio.run(go())
    assert chunk.token_ids == (100,) and started == ["a"]
