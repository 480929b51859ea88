"""The engine runner opens its connector's step gate once a step's outputs are handed out, so the
KV saves that step handed off start after them (``kvstore.connector_meta.StepGate``)."""

from __future__ import annotations

import queue
from collections import deque
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="kvstore.connector_meta is built on vLLM's connector types")

from engine.runner import EngineRunner  # noqa: E402
from kvstore.connector_meta import StepGate, engine_step_gate, step_gate  # noqa: E402


class _Loop:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.events.append("outputs handed out")


class _Gate(StepGate):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def open(self) -> None:
        self.events.append("gate opened")
        super().open()


class _Engine:
    """One step with one output, then the runner is told to stop."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner, self.steps = runner, 0

    def has_unfinished_requests(self) -> bool:
        return self.steps == 0

    def step(self):
        self.steps += 1
        self.runner._stopping = True
        return [SimpleNamespace(request_id="r", finished=False)]


def _runner(events: list[str], gate) -> EngineRunner:
    runner = EngineRunner.__new__(EngineRunner)  # no vLLM engine: the loop and its delivery
    runner.engine = _Engine(runner)
    runner._stopping, runner._commands, runner._tap = False, queue.Queue(), None
    runner.num_finished_reqs = 0
    runner.max_prefills, runner._held, runner._prefilling = 0, [], set()
    runner.admission_headroom, runner._admitting = 0, set()
    runner._spans, runner._decode_spans = {}, deque()
    runner._sinks = {"r": (SimpleNamespace(put_nowait=lambda item: None), _Loop(events))}
    runner._step_gate = gate
    return runner


def test_the_step_gate_opens_after_the_steps_outputs_are_handed_out():
    events: list[str] = []
    gate = _Gate(events)
    gate.close()  # the connector closed it when the step handed a save off
    runner = _runner(events, gate)

    runner._loop()

    assert events == ["outputs handed out", "gate opened"]
    assert gate.is_open()


def test_an_engine_without_a_baton_connector_has_no_step_gate():
    runner = _runner([], None)
    runner._loop()  # nothing to open: the step still runs and delivers
    assert runner.engine.steps == 1
    assert engine_step_gate(SimpleNamespace(kv_transfer_config=None)) is None
    other = SimpleNamespace(kv_connector="SomeOtherConnector", kv_connector_extra_config={})
    assert engine_step_gate(SimpleNamespace(kv_transfer_config=other)) is None


def test_the_runner_and_the_connector_share_the_engines_gate():
    baton = SimpleNamespace(kv_connector="BatonConnector",
                            kv_connector_extra_config={"engine_id": "gate-test-engine"})
    gate = engine_step_gate(SimpleNamespace(kv_transfer_config=baton))
    assert gate is step_gate("gate-test-engine")  # what the connector of that engine holds
    assert gate is not step_gate("another-engine")
