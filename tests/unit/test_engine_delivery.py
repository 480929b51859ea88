"""The engine thread hands a step's outputs to their event loops: one wake-up per loop a step."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from engine.runner import EngineRunner, _put_all


class _Loop:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls.append((fn, *args))


class _Sink:
    def __init__(self) -> None:
        self.items: list = []

    def put_nowait(self, item) -> None:
        self.items.append(item)


def test_a_steps_outputs_wake_each_loop_once_in_step_order():
    runner = EngineRunner.__new__(EngineRunner)  # no engine: only the delivery is exercised
    runner.num_finished_reqs = 0
    runner.max_prefills, runner._held, runner._prefilling = 0, [], set()
    runner.admission_headroom, runner._admitting = 0, set()
    runner._spans, runner._decode_spans = {}, deque()
    first, second = _Loop(), _Loop()
    sinks = {name: _Sink() for name in "abc"}
    runner._sinks = {"a": (sinks["a"], first), "b": (sinks["b"], first), "c": (sinks["c"], second)}
    outputs = [SimpleNamespace(request_id="a", finished=False), SimpleNamespace(request_id="c", finished=True),
               SimpleNamespace(request_id="b", finished=False), SimpleNamespace(request_id="gone", finished=False),
               SimpleNamespace(request_id="a", finished=True)]
    runner._deliver(outputs)
    assert [len(loop.calls) for loop in (first, second)] == [1, 1]
    for loop in (first, second):
        fn, items = loop.calls[0]
        assert fn is _put_all
        fn(items)
    assert sinks["a"].items == [outputs[0], outputs[4]] and sinks["b"].items == [outputs[2]]
    assert sinks["c"].items == [outputs[1]]
    assert runner.num_finished_reqs == 2 and set(runner._sinks) == {"b"}  # a and c finished
