"""The engine runner's prefill gate (``engine.max_prefills_in_flight``): prompts computed here
go into the engine one at a time, the next when the one before has its first token, by
priority, then arrival (``engine.prefill_gate_order: arrival``, the default) or arrival plus the
conductor's priced prefill (``shortest_first``: shortest first among prompts arriving together,
none passed indefinitely); a decode whose prompt was computed elsewhere is never held; an abort
of a held request never reaches the engine; an engine crash fails the held ones too."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.runner import EngineRunner, _Abort, _Add
from protos.wire import EngineRequest, SamplingOptions


class _Loop:
    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)


class _Sink:
    def __init__(self) -> None:
        self.items: list = []

    def put_nowait(self, item) -> None:
        self.items.append(item)


class _Engine:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, priority=0) -> None:
        self.added.append(request_id)

    def abort_request(self, request_ids) -> None:
        self.aborted.extend(request_ids)


def _runner(max_prefills: int, shortest_first: bool = False, admission_headroom: int = 0) -> EngineRunner:
    runner = EngineRunner.__new__(EngineRunner)  # no vLLM engine: the gate's bookkeeping only
    runner.engine, runner.max_prefills = _Engine(), max_prefills
    runner.shortest_first = shortest_first
    runner.admission_headroom, runner._admitting = admission_headroom, set()
    runner._sinks, runner._held, runner._prefilling = {}, [], set()
    runner.num_finished_reqs = 0
    runner._spans, runner._decode_spans, runner._tap = {}, deque(), None
    return runner


def _add(runner: EngineRunner, request_id: str, priority: int = 0, gated: bool = True,
         arrived_ms: float = 0.0, predicted_prefill_ms: float = 0.0) -> _Sink:
    sink = _Sink()
    request = EngineRequest(request_id, (1, 2, 3), SamplingOptions(max_tokens=4),
                            predicted_prefill_ms=predicted_prefill_ms)
    runner._apply(_Add(request, 4, sink, _Loop(), priority, gated=gated, arrived_ms=arrived_ms))
    return sink


def _output(request_id: str, tokens: tuple[int, ...] = (9,), finished: bool = False):
    return SimpleNamespace(request_id=request_id, finished=finished,
                           outputs=[SimpleNamespace(token_ids=list(tokens))])


def test_prompts_go_in_one_at_a_time_each_after_the_first_token_before_it():
    runner = _runner(1)
    for request_id in ("a", "b", "c"):
        _add(runner, request_id)
    assert runner.engine.added == ["a"] and [h.request.request_id for h in runner._held] == ["b", "c"]
    runner._deliver([_output("a", tokens=())])  # an output with no token yet: a is still in prefill
    assert runner.engine.added == ["a"]
    runner._deliver([_output("a")])
    assert runner.engine.added == ["a", "b"]
    runner._deliver([_output("a"), _output("b", finished=True)])  # a decodes on; b ends at once
    assert runner.engine.added == ["a", "b", "c"] and runner._held == []


def test_the_gate_admits_by_priority_then_arrival_and_its_size_is_the_limit():
    runner = _runner(2)
    for request_id, priority in (("a", 0), ("b", 0), ("c", 5), ("d", 1), ("e", 1)):
        _add(runner, request_id, priority)
    assert runner.engine.added == ["a", "b"]
    runner._deliver([_output("a")])
    assert runner.engine.added == ["a", "b", "d"]
    runner._deliver([_output("b"), _output("d")])
    assert runner.engine.added == ["a", "b", "d", "e", "c"]


HELD = (("long", 1_000.0, 2_000.0), ("short", 1_100.0, 200.0), ("late-long", 2_000.0, 0.0),
        ("later", 2_200.0, 100.0), ("last", 9_000.0, 0.0))
"""(request id, arrival ms, priced prefill ms), in arrival order: shortest-first keys 3,000 /
1,300 / 2,000 (unpriced) / 2,300 / 9,000 (unpriced)."""


@pytest.mark.parametrize("shortest_first, order", [
    (True, ["running", "short", "late-long", "later", "long", "last"]),
    (False, ["running", "long", "short", "late-long", "later", "last"])])
def test_the_shortest_priced_prefill_goes_first_but_a_long_one_is_passed_only_for_its_own_length(
        shortest_first, order):
    runner = _runner(1, shortest_first)
    _add(runner, "running", arrived_ms=0.0)
    for request_id, arrived, predicted in HELD:
        _add(runner, request_id, arrived_ms=arrived, predicted_prefill_ms=predicted)
    for request_id in order[:-1]:
        runner._deliver([_output(request_id)])
    assert runner.engine.added == order
    # "later" passed "long", which arrived 1,200 ms before it: less than long's 2,000 ms prefill


def test_a_loaded_decode_is_never_held_and_no_gate_holds_nothing():
    runner = _runner(1)
    _add(runner, "a")
    _add(runner, "loaded", gated=False)
    assert runner.engine.added == ["a", "loaded"] and runner._prefilling == {"a"}
    open_gate = _runner(0)
    for request_id in "abc":
        _add(open_gate, request_id)
    assert open_gate.engine.added == ["a", "b", "c"] and open_gate._held == []


def test_aborting_a_held_request_never_reaches_the_engine_and_aborting_the_prefill_admits_the_next():
    runner = _runner(1)
    for request_id in "abc":
        _add(runner, request_id)
    runner._apply(_Abort("b"))
    assert runner.engine.aborted == [] and [h.request.request_id for h in runner._held] == ["c"]
    runner._apply(_Abort("a"))
    assert runner.engine.aborted == ["a"] and runner.engine.added == ["a", "c"]


def test_held_requests_count_as_waiting():
    runner = _runner(1)
    runner._scheduler = lambda: SimpleNamespace(running=[1], waiting=[])
    for request_id in "abc":
        _add(runner, request_id)
    assert runner.num_running_and_waiting() == (1, 2)


def test_the_gate_is_first_come_first_served_unless_configured():
    assert EngineConfig().prefill_gate_order == "arrival"


@pytest.mark.parametrize("device, configured, gate", [
    ("cpu", None, 1), ("cuda", None, 0), ("cpu", 0, 0), ("cuda", 2, 2)])
def test_the_default_gate_is_one_prompt_on_a_cpu_and_none_on_cuda(device, configured, gate):
    assert EngineConfig(device=device, max_prefills_in_flight=configured).prefill_gate == gate


def test_an_engine_crash_fails_the_held_requests_as_well_as_those_in_the_engine():
    import queue
    from collections import deque

    runner = _runner(1)
    runner._commands, runner._stopping, runner._decode_steps = queue.Queue(), False, deque()
    runner._scheduler = lambda: None
    sinks = [_add(runner, request_id) for request_id in "ab"]
    boom = RuntimeError("step failed")
    runner.engine.has_unfinished_requests = lambda: True
    runner.engine.step = lambda: (_ for _ in ()).throw(boom)
    runner._loop()
    assert [sink.items for sink in sinks] == [[boom], [boom]]
    assert runner._held == [] and runner._dead is boom


def test_a_handoff_waiting_for_its_first_token_holds_the_next_prompt_with_headroom_on():
    runner = _runner(1, admission_headroom=64)
    _add(runner, "a")  # a prompt computing here
    _add(runner, "h", gated=False)  # a hand-off: its prompt KV is loaded, it skips the gate
    runner._deliver([_output("a")])  # a's first token: the gate has room again ...
    _add(runner, "b")
    assert runner.engine.added == ["a", "h"]  # ... but b waits while h has no token yet
    runner._deliver([_output("h", tokens=())])
    assert runner.engine.added == ["a", "h"]
    runner._deliver([_output("h")])  # h's first token: b goes in
    assert runner.engine.added == ["a", "h", "b"] and not runner._admitting


def test_without_headroom_a_handoff_holds_nothing():
    runner = _runner(1)
    _add(runner, "h", gated=False)
    _add(runner, "b")
    assert runner.engine.added == ["h", "b"] and not runner._admitting


def test_an_aborted_handoff_releases_the_prompts_it_held():
    runner = _runner(1, admission_headroom=64)
    _add(runner, "h", gated=False)
    _add(runner, "b")
    assert runner.engine.added == ["h"]
    runner._apply(_Abort("h"))
    assert runner.engine.added == ["h", "b"] and runner.engine.aborted == ["h"]
