"""``baton bench soak``'s arithmetic: the growth per hour of a sampled series is the
least-squares slope over the run's second half, beside its first, last and peak values. The live
soak runs outside CI (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench.soak import (
    Sample,
    engine_memory_growth,
    growth_of,
    rss_growth_by_role,
    rss_kinds_mb,
    slope_per_hour,
)


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
    assert set(growth) == set(Sample.__struct_fields__) - {"at_s", "rss_mb_by_role",
                                                            "engine_memory"}


STATUS = """Name:\tray::KVStoreNode
VmRSS:\t  309248 kB
RssAnon:\t  102400 kB
RssFile:\t   51200 kB
RssShmem:\t  155648 kB
VmSwap:\t       0 kB
"""


def test_resident_memory_by_kind_is_read_from_the_kernels_status_lines():
    assert rss_kinds_mb(STATUS) == {"anon": 100.0, "file": 50.0, "shmem": 152.0}
    assert rss_kinds_mb("Name:\tkthreadd\n") == {"anon": 0.0, "file": 0.0, "shmem": 0.0}


def test_growth_by_role_tells_a_growing_heap_from_arena_pages_touched():
    # the engine's heap holds while its arena pages grow 60 MB a minute; the store starts late
    samples = []
    for minute in range(5):
        by_role = {"engine": {"anon": 500.0, "file": 80.0, "shmem": 60.0 * minute}}
        if minute >= 2:
            by_role["store"] = {"anon": 40.0 + minute, "file": 10.0, "shmem": 256.0}
        samples.append(Sample(minute * 60.0, 0, 100, 12, 0, 0, 0, 40, 0, rss_mb_by_role=by_role))

    growth = rss_growth_by_role(samples)

    assert growth["engine"]["anon"].per_hour == 0.0
    assert growth["engine"]["shmem"].per_hour == 3600.0
    assert (growth["engine"]["shmem"].first, growth["engine"]["shmem"].last) == (0.0, 240.0)
    assert growth["store"]["anon"].per_hour == 60.0  # one MB a minute over the second half
    assert (growth["store"]["shmem"].first, growth["store"]["shmem"].peak) == (0.0, 256.0)


def test_the_engines_memory_series_grow_apart_and_a_sample_without_a_report_is_left_out():
    # KV pages touched 10 MB a minute, the heap in use flat; the third sample got no report
    samples = []
    for minute in range(6):
        report = {} if minute == 2 else {"kv_cache_resident_mb": 10.0 * minute,
                                         "malloc_in_use_mb": 700.0}
        samples.append(Sample(minute * 60.0, 0, 100, 12, 0, 0, 0, 40, 0, engine_memory=report))

    growth = engine_memory_growth(samples)

    assert set(growth) == {"kv_cache_resident_mb", "malloc_in_use_mb"}
    assert growth["kv_cache_resident_mb"].per_hour == 600.0
    assert (growth["kv_cache_resident_mb"].first, growth["kv_cache_resident_mb"].last) == (0.0, 50.0)
    assert growth["malloc_in_use_mb"].per_hour == 0.0
    assert engine_memory_growth(samples[2:3]) == {}
