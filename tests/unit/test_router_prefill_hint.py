"""The live router hands the conductor's priced prefill (``Placement.prefill_ms``) to whichever
engine computes the prompt, as ``EngineRequest.predicted_prefill_ms``: the prefill worker's on
a hand-off, the decode worker's when it prefills itself. A decode that loads a prompt computed
elsewhere is not held by its gate, so it carries no hint it would use."""

from __future__ import annotations

import asyncio

from gateway.live_router import LiveRouter
from protos.wire import EngineRequest, Placement, PrefillResult, SamplingOptions, TokenChunk


class _Remote:
    def __init__(self, fn) -> None:
        self.remote = fn

    def options(self, **_):
        return self


class _Conductor:
    prefill_done = _Remote(lambda *args: None)


class _Prefill:
    def __init__(self) -> None:
        self.seen: list[EngineRequest] = []

        async def prefill(request, priority):
            self.seen.append(request)
            return PrefillResult(request.request_id, "p0", len(request.prompt_token_ids), 0, 1, 5.0)

        self.prefill = _Remote(prefill)


class _Decode:
    """A decode instance's outbox (``outbox`` / ``start`` / ``cancel``): each request started
    ends with one chunk, ``delay_s`` after its start."""

    delay_s = 0.0

    def __init__(self) -> None:
        self.seen: list[EngineRequest] = []
        batches: asyncio.Queue = asyncio.Queue()

        def start(request, subscriber):
            self.seen.append(request)

            async def later():
                await asyncio.sleep(self.delay_s)
                batches.put_nowait([(request.request_id,
                                     TokenChunk((7,), "x", finish_reason="length"))])

            asyncio.get_running_loop().create_task(later())

        def outbox(subscriber):
            async def refs():
                while True:
                    future = asyncio.get_running_loop().create_future()
                    future.set_result(await batches.get())
                    yield future

            return refs()

        self.start, self.outbox = _Remote(start), _Remote(outbox)
        self.cancel = _Remote(lambda *args: None)


def _served(router: LiveRouter, placement: Placement) -> None:
    request = EngineRequest("r1", tuple(range(300)), SamplingOptions(max_tokens=1))

    async def go():
        prefilled = await router._prefill(request, placement)
        return [event async for event in router._serve(request, placement, prefilled)]

    asyncio.run(go())


def _router(**handles) -> LiveRouter:
    router = LiveRouter(_Conductor(), "test")
    router._handles = dict(handles)
    return router


def test_the_prefill_worker_gets_the_priced_prefill_and_the_loading_decode_does_not_need_it():
    prefill, decode = _Prefill(), _Decode()
    _served(_router(p0=prefill, d0=decode),
            Placement("p0", "d0", "baton", prefill_ms=1_234.5, expected_cached_blocks=1))
    assert [r.predicted_prefill_ms for r in prefill.seen] == [1_234.5]
    assert [(r.predicted_prefill_ms, r.computes_prompt) for r in decode.seen] == [(0.0, False)]


def test_a_decode_instance_prefilling_itself_gets_the_priced_prefill():
    decode = _Decode()
    _served(_router(d0=decode), Placement("d0", "d0", "baton", prefill_ms=640.0))
    assert [(r.predicted_prefill_ms, r.computes_prompt) for r in decode.seen] == [(640.0, True)]


def test_a_decode_instance_whose_reusable_prefix_is_all_on_its_device_skips_the_lookup_if_set():
    def sent(placement: Placement, **options) -> bool:
        decode = _Decode()  # a router and an instance per event loop
        router = LiveRouter(_Conductor(), "test", **options)
        router._handles = {"d0": decode}
        _served(router, placement)
        return decode.seen[0].store_lookup

    all_on_device = Placement("d0", "d0", "baton", expected_cached_blocks=5, device_blocks=5)
    assert sent(all_on_device) is True  # the default asks anyway (gateway.lookup_device_hits)
    skip = {"lookup_device_hits": False}
    assert sent(all_on_device, **skip) is False
    assert sent(Placement("d0", "d0", "baton", expected_cached_blocks=7, device_blocks=5),
                **skip) is True
    assert sent(Placement("d0", "d0", "baton", expected_cached_blocks=5), **skip) is True  # unknown
    # nothing reusable known: the store is asked (it may hold what the index missed)
    assert sent(Placement("d0", "d0", "baton", expected_cached_blocks=0, device_blocks=0),
                **skip) is True


class _PlacingConductor:
    """Places every request where it is told and records what the router reports at the end."""

    def __init__(self, placement: Placement) -> None:
        self.ended: list[tuple] = []

        async def place(request):
            return placement

        async def key_scheme():
            return None

        self.place = _Remote(place)
        self.key_scheme = _Remote(key_scheme)
        self.prefill_done = _Remote(lambda *args: None)
        self.finished = _Remote(lambda *args: self.ended.append(args))


class _SlowDecode(_Decode):
    """Its first token comes ``delay_s`` after the call (a load and a step)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s


def _streamed(placement: Placement, **handles) -> list[tuple]:
    conductor = _PlacingConductor(placement)
    router = LiveRouter(conductor, "test")
    router._handles = dict(handles)
    request = EngineRequest("r1", tuple(range(300)), SamplingOptions(max_tokens=1))

    async def go():
        return [event async for event in router.stream(request)]

    asyncio.run(go())
    return conductor.ended


def test_a_disaggregated_requests_hand_off_is_measured_and_reported_with_its_end():
    ended = _streamed(Placement("p0", "d0", "baton", handoff_ms=1.0),
                      p0=_Prefill(), d0=_SlowDecode(0.2))
    assert [request_id for request_id, _ in ended] == ["r1"]
    assert 200.0 <= ended[0][1] < 2_000.0  # the decode's first token came 0.2 s after the prefill


def test_a_co_located_request_reports_no_hand_off():
    ended = _streamed(Placement("d0", "d0", "baton"), d0=_SlowDecode(0.05))
    assert ended == [("r1", None)]
