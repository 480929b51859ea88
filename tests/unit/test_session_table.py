"""The conductor's session table: steps, pauses, divergence, TTL, close, prefetch timing."""

from __future__ import annotations

import pytest

from conductor.sessions import SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def keys(*names: str) -> tuple[bytes, ...]:
    return tuple(name.encode().ljust(16, b".") for name in names)


def test_steps_extend_the_prefix_and_measure_pauses(clock):
    table = SessionTable(clock, default_ttl_s=60)
    first = table.step("s-1", keys("a", "b"))
    assert (first.new, first.diverged, first.pause_s) == (True, False, None)
    table.placed("s-1", "p0", "d0")
    clock.now += 2.0
    table.finished("s-1")
    clock.now += 7.5  # the tool runs
    second = table.step("s-1", keys("a", "b", "c"))
    assert (second.new, second.diverged, second.pause_s) == (False, False, 7.5)
    view = table.view("s-1")
    assert (view.num_steps, view.prefill_instance, view.decode_instance, view.num_prefix_blocks,
            view.idle_s) == (2, "p0", "d0", 3, 0.0)
    assert table.counters.started == 1 and table.counters.steps == 2


def test_a_prompt_that_does_not_extend_the_last_one_starts_the_session_anew(clock):
    table = SessionTable(clock)
    table.step("s-1", keys("a", "b"))
    table.finished("s-1")
    step = table.step("s-1", keys("a", "x", "c"))
    assert (step.new, step.diverged, step.pause_s) == (True, True, None)
    assert table.view("s-1").num_steps == 1
    assert table.counters.diverged == 1


def test_ttl_lapses_only_without_a_running_step(clock):
    table = SessionTable(clock, default_ttl_s=10)
    table.step("s-1", keys("a"))
    clock.now += 50  # a step that runs long does not expire its session
    assert table.expire() == [] and "s-1" in table
    table.finished("s-1")
    clock.now += 10
    assert table.expire() == []  # exactly the TTL: still live
    clock.now += 0.001
    assert table.expire() == ["s-1"] and "s-1" not in table
    assert table.counters.expired == 1


def test_a_step_renews_the_ttl_and_may_change_it(clock):
    table = SessionTable(clock, default_ttl_s=10)
    table.step("s-1", keys("a"), ttl_s=30)
    table.finished("s-1")
    clock.now += 25
    assert table.expire() == []
    table.step("s-1", keys("a", "b"))  # 0 keeps the session's own TTL
    assert table.view("s-1").ttl_s == 30


def test_close(clock):
    table = SessionTable(clock)
    table.step("s-1", keys("a"))
    closed = table.close("s-1")
    assert closed.num_steps == 1 and table.close("s-1") is None
    assert table.counters.closed == 1


def test_expected_gap_is_the_hint_else_the_median_of_past_pauses(clock):
    table = SessionTable(clock)
    table.step("s-1", keys("a"))
    expected = []
    for pause in (4.0, 8.0, 5.0):
        table.finished("s-1")
        expected.append(table.view("s-1").expected_gap_s)
        clock.now += pause
        table.step("s-1", keys("a"))
    assert expected == [None, None, 6.0]  # learned from the second pause on: median(4, 8)
    assert table.view("s-1").expected_gap_s == 5.0  # median of 4, 8, 5
    table.finished("s-1")
    table.step("s-1", keys("a"), expected_next_step_s=2.5)
    assert table.view("s-1").expected_gap_s == 2.5


def test_prefetch_is_due_lead_seconds_before_the_expected_step_once_per_pause(clock):
    table = SessionTable(clock)
    table.step("s-1", keys("a"), expected_next_step_s=10.0)
    assert table.due_for_prefetch(lead_s=2.0) == []  # running
    table.finished("s-1")
    clock.now += 7.9
    assert table.due_for_prefetch(lead_s=2.0) == []
    clock.now += 0.1
    assert [v.session_id for v in table.due_for_prefetch(lead_s=2.0)] == ["s-1"]
    assert table.due_for_prefetch(lead_s=2.0) == []  # once per pause
    table.step("s-1", keys("a", "b"), expected_next_step_s=10.0)
    table.finished("s-1")
    clock.now += 8.0
    assert [v.session_id for v in table.due_for_prefetch(lead_s=2.0)] == ["s-1"]


def test_no_prefetch_without_a_hint_or_enough_pauses(clock):
    table = SessionTable(clock)
    table.step("s-1", keys("a"))
    table.finished("s-1")
    clock.now += 1000
    assert table.due_for_prefetch(lead_s=1.0) == []
