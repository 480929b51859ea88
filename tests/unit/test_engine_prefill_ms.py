"""engine.runner.engine_prefill_ms: the engine's own prefill time from vLLM's request stats."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.runner import engine_prefill_ms


def output(**stats):
    return SimpleNamespace(metrics=SimpleNamespace(**stats) if stats else None)


def test_scheduled_to_first_token_without_the_queue():
    assert engine_prefill_ms(output(queued_ts=5.0, scheduled_ts=10.0, first_token_ts=10.25)) == pytest.approx(250.0)


@pytest.mark.parametrize("stats", [{}, {"scheduled_ts": 10.0, "first_token_ts": 0.0},
                                   {"scheduled_ts": 0.0, "first_token_ts": 3.0},
                                   {"scheduled_ts": 10.0, "first_token_ts": 9.0}])
def test_no_figure_before_the_first_token_or_without_stats(stats):
    assert engine_prefill_ms(output(**stats)) is None


def _runner_over(running, waiting=()):
    from collections import deque

    from engine.runner import EngineRunner

    runner = EngineRunner.__new__(EngineRunner)  # no engine: only the scheduler is read
    scheduler = SimpleNamespace(running=list(running), waiting=list(waiting), kv_holding_waiting=[])
    runner.engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)))
    runner._decode_steps = deque(maxlen=4)
    runner._decode_seq, runner._spans, runner._decode_spans = 0, {}, deque(maxlen=4)
    return runner


def req(computed: int, prompt: int, request_id: str = "r"):
    return SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt,
                           request_id=request_id)


def test_a_step_counts_as_decode_only_when_every_running_request_is_past_its_prompt():
    assert _runner_over([req(130, 100, "a"), req(64, 64, "b")])._decode_only() == (2, 194, ["a", "b"])
    assert _runner_over([req(130, 100), req(32, 64)])._decode_only() is None  # one still prefilling
    assert _runner_over([req(130, 100)], waiting=[req(0, 50)])._decode_only() is None  # one to schedule
    assert _runner_over([])._decode_only() is None


def test_decode_steps_are_taken_once_and_only_the_newest_kept():
    from protos.wire import DecodeStep

    runner = _runner_over([])
    for i in range(6):
        runner._decode_steps.append(DecodeStep(1, i, float(i)))
    assert [s.context_tokens for s in runner.take_decode_steps()] == [2, 3, 4, 5]
    assert runner.take_decode_steps() == []


def test_a_finished_request_reports_the_numbered_decode_steps_it_was_in():
    from protos.wire import DecodeSpan, DecodeStep

    runner = _runner_over([])
    # vLLM's scheduler names a request by the caller's id plus 8 random characters
    a, b = "a-1f3e5d7c", "b"  # b: an engine that keeps the caller's ids
    runner._timed_decode_step(1, 100, [a], 20.0)        # step 0: a alone
    runner._timed_decode_step(2, 230, [a, b], 25.0)     # step 1
    runner._timed_decode_step(2, 232, [a, b], 26.0)     # step 2
    runner._timed_decode_step(1, 131, [b], 21.0)        # step 3: a finished after step 2
    runner._end_span("a")
    assert runner.take_decode_spans() == [DecodeSpan(0, 2)]
    runner._end_span("never-stepped")  # finished without a timed decode-only step
    runner._end_span("b")
    assert runner.take_decode_spans() == [DecodeSpan(1, 3)]
    assert runner.take_decode_spans() == []
    assert [s.seq for s in runner.take_decode_steps()] == [0, 1, 2, 3]
    assert DecodeStep(1, 1, 1.0).seq == -1  # a step from a runner that does not number them
