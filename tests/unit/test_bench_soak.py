"""``baton bench soak``'s arithmetic: the growth per hour of a sampled series is the
least-squares slope over the run's second half, beside its first, last and peak values. The live
soak runs outside CI (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench.soak import Sample, growth_of, slope_per_hour


@pytest.mark.parametrize("points, expected", [
    ([], 0.0),
    ([(0.0, 5.0)], 0.0),
    ([(0.0, 1.0), (3600.0, 3.0)], 2.0),
    ([(0.0, 10.0), (60.0, 10.0), (120.0, 10.0)], 0.0),  # flat: no growth
    ([(0.0, 0.0), (1.0, 2.0), (2.0, 1.0), (3.0, 3.0)], 0.8 * 3600),  # noisy, fitted
    ([(5.0, 1.0), (5.0, 9.0)], 0.0),  # one instant: no slope to fit
])
def test_slope_per_hour_is_the_least_squares_line(points, expected):
    assert slope_per_hour(points) == pytest.approx(expected)


def _sample(at_s: float, rss_mb: float, redis_keys: int) -> Sample:
    return Sample(at_s, rss_mb, 100, 12, 0, 0, redis_keys, 40, 0)


def test_growth_fits_only_the_second_half_after_warm_up():
    # RSS climbs during warm-up, then holds; Redis keys grow by 1 a minute throughout
    samples = [_sample(0, 100, 0), _sample(60, 900, 1), _sample(120, 1000, 2),
               _sample(180, 1000, 3), _sample(240, 1000, 4)]

    growth = growth_of(samples)

    assert (growth["rss_mb"].first, growth["rss_mb"].last, growth["rss_mb"].peak) == (
        100.0, 1000.0, 1000.0)
    assert growth["rss_mb"].per_hour == 0.0  # the second half is flat
    assert growth["redis_keys"].per_hour == 60.0
    assert set(growth) == set(Sample.__struct_fields__) - {"at_s"}
