"""``baton bench overload``'s bookkeeping: how each answer is classified (served, rejected with a
retry hint, any other status), how a run is judged sustainable, and its percentiles. The live
benchmark itself runs outside CI (docs/benchmarks.md)."""

from __future__ import annotations

import os
import random

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from bench import overload
from protos.baton.v1 import inference_pb2 as pb


class ScriptedStub:
    """A stand-in for the Inference stub: each call answers the next scripted item (a ``Usage``
    for a served stream, an ``AioRpcError`` to raise)."""

    def __init__(self, script):
        self.script = list(script)

    def Generate(self, request, timeout):  # noqa: N802 - the stub's method name
        item = self.script.pop(0)

        async def stream():
            if isinstance(item, AioRpcError):
                raise item
            yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=[1], text="a"))
            yield pb.GenerateResponse(final=pb.Final(finish_reason="length", usage=item))

        return stream()


def _error(code: grpc.StatusCode, hint: str | None) -> AioRpcError:
    trailing = Metadata(("retry-after-ms", hint)) if hint is not None else Metadata()
    return AioRpcError(code, Metadata(), trailing, details="x")


async def test_answers_are_served_rejected_with_a_hint_or_other():
    stub = ScriptedStub([
        pb.Usage(prompt_tokens=10, completion_tokens=5, ttft_ms=100.0, e2e_ms=500.0),
        _error(grpc.StatusCode.RESOURCE_EXHAUSTED, "1000"),
        _error(grpc.StatusCode.RESOURCE_EXHAUSTED, None),  # no hint: not a clean rejection
        _error(grpc.StatusCode.UNAVAILABLE, "1000"),
        _error(grpc.StatusCode.INTERNAL, None),
    ])
    outcomes = [await overload._one(stub, [1, 2, 3], 5) for _ in range(5)]

    assert outcomes[0] == overload.Outcome("OK", 100.0, 100.0)  # (500 - 100) / (5 - 1)
    assert [o.status for o in outcomes[1:]] == [
        "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED (no retry hint)", "UNAVAILABLE (retry hint)",
        "INTERNAL"]


async def test_a_run_counts_each_kind_and_its_slo_attainment():
    served = [pb.Usage(completion_tokens=3, ttft_ms=ttft, e2e_ms=ttft + 2 * tbt)
              for ttft, tbt in ((100, 10), (300, 10), (100, 50), (150, 20))]
    stub = ScriptedStub(served + [_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "500"),
                                  _error(grpc.StatusCode.INTERNAL, None)])

    run = await overload.drive(stub, [[1, 2]], rate_rps=2000.0, duration_s=0.0031,
                               max_tokens=3, rng=_rng_with_gaps(6), ttft_slo_ms=200.0,
                               tbt_slo_ms=30.0)

    assert (run.sent, run.admitted, run.rejected, run.other_errors) == (6, 4, 1, 1)
    assert run.other_statuses == {"INTERNAL": 1}
    assert (run.slo_attainment_admitted, run.ttft_attainment_admitted,
            run.tbt_attainment_admitted) == (0.5, 0.75, 0.75)
    assert (run.p50_ttft_ms_admitted, run.p99_ttft_ms_admitted) == (100.0, 300.0)
    assert not overload.sustains(run)
    assert overload.sustains(overload.Run(**{**_fields(run), "rejected": 0, "other_errors": 0,
                                             "slo_attainment_admitted": 0.9}))


def _rng_with_gaps(count: int) -> random.Random:
    """An RNG whose exponential draws put ``count`` arrivals 0.5 ms apart."""
    rng = random.Random(0)
    rng.expovariate = lambda _rate: 0.0005  # type: ignore[method-assign]
    return rng


def _fields(run: overload.Run) -> dict:
    return {name: getattr(run, name) for name in run.__struct_fields__}


@pytest.mark.parametrize("values, q, expected", [([], 0.5, 0.0), ([3.0], 0.99, 3.0),
                                                  ([1, 2, 3, 4], 0.5, 2), ([1, 2, 3, 4], 0.99, 4)])
def test_percentiles_are_the_nearest_rank(values, q, expected):
    from bench.stats import percentile

    assert percentile(values, q) == expected


async def test_the_clients_drive_from_a_process_of_their_own():
    # nothing listens on the target: every request is UNAVAILABLE, answered in the client process
    clients = overload.ClientProcess("127.0.0.1:1")
    try:
        order = overload.DriveOrder("127.0.0.1:1", [[1, 2, 3]], rate_rps=200.0, duration_s=0.2,
                                    max_tokens=2, seed=0.25, ttft_slo_ms=100.0, tbt_slo_ms=10.0)
        run, recovery_s = await clients.drive(order)
        again, _ = await clients.drive(order)
    finally:
        clients.close()

    assert clients._pid is not None and clients._pid != os.getpid()
    assert run.sent > 0 and run.other_statuses == {"UNAVAILABLE": run.sent}
    assert again.sent == run.sent  # the same seed: the same arrivals
    assert recovery_s is None  # no recovery asked for
    assert run.peak_rss_mb > 0  # this process sampled, the client's own excluded
