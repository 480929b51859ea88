"""``baton chaos``'s fault schedules: drawn up front from the seed, so the time a fault takes
to inject never pushes the later ones back and a run of S seconds gets about S / every_s; and
how the drill tells that a victim it armed has died."""

from __future__ import annotations

import random
from itertools import accumulate

import pytest

from bench.chaos import fault_times


def test_the_times_are_the_seeded_draws_accumulated_up_to_the_duration():
    draws = random.Random(5)
    gaps = [10.0 * draws.uniform(0.5, 1.5) for _ in range(40)]
    expected = [t for t in accumulate(gaps) if t < 120.0]

    assert fault_times(random.Random(5), 10.0, 120.0) == expected
    assert fault_times(random.Random(5), 10.0, 120.0) == fault_times(random.Random(5), 10.0, 120.0)
    assert all(5.0 <= b - a <= 15.0 for a, b in zip([0.0, *expected], expected))


def test_a_run_of_s_seconds_gets_about_s_over_every_faults():
    counts = [len(fault_times(random.Random(seed), 10.0, 120.0)) for seed in range(500)]
    # gaps average every_s, so about 120 / 10 times, less the one cut at the end on average
    assert sum(counts) / len(counts) == pytest.approx(11.5, abs=0.3)
    assert min(counts) >= 7 and max(counts) <= 23


def test_a_schedule_set_to_zero_injects_nothing():
    assert fault_times(random.Random(1), 0.0, 120.0) == []
    assert fault_times(random.Random(1), 10.0, 4.0) == []  # the first draw is at least 5 s


async def test_a_victim_that_dies_before_its_arming_call_returns_died_as_told():
    """A store node's block server may reach the armed moment on its other thread before the
    call that armed it has answered: that call then fails with the actor's death, which is the
    fault taking effect, not an error of the drill (its ping is never needed)."""
    import ray

    from bench.chaos import _died_when_told

    async def arm_and_die():
        raise ray.exceptions.RayActorError()

    async def ping():
        raise AssertionError("not pinged: the arming call already showed the death")

    said: list[str] = []
    assert await _died_when_told(arm_and_die, ping, "the KV store node n1", "mid-pull", said.append)
    assert said[-1] == "the KV store node n1 died mid-pull, before the call that told it returned"

    async def arm():
        return None

    pings = 0

    async def ping_until_dead():
        nonlocal pings
        pings += 1
        if pings == 2:
            raise ray.exceptions.RayActorError()

    assert await _died_when_told(arm, ping_until_dead, "w0", "mid-save", said.append, window_s=5)
    assert (pings, said[-1]) == (2, "w0 died mid-save")


async def test_when_one_of_the_drills_loops_fails_the_others_are_stopped_before_it_raises():
    """A failed fault (a Redis that would not restart) must not leave the client loops running
    while the cluster is stopped under them: their next Ray call would start a new Ray."""
    import asyncio

    from bench.chaos import _all_or_none

    stopped: list[str] = []

    async def client(name: str) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            stopped.append(name)
            raise

    async def failing_fault() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("redis-server exited with -11")

    with pytest.raises(RuntimeError, match="exited with -11"):
        await _all_or_none(client("a"), failing_fault(), client("b"))
    assert sorted(stopped) == ["a", "b"]  # both cancelled, and done, before the error came out
