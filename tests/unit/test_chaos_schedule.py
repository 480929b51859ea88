"""``baton chaos``'s fault schedules: drawn up front from the seed, so the time a fault takes
to inject never pushes the later ones back and a run of S seconds gets about S / every_s."""

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
