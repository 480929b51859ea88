"""The engine's warm-up points: spread over uncached and cached tokens, inside the window."""

from __future__ import annotations

import pytest

from engine.warmup import warmup_points


def test_the_points_for_a_long_window_span_both_dimensions():
    assert warmup_points(8192, 128) == [
        (2048, 0), (8, 0), (256, 0), (1024, 0),  # the prefix, then fresh prompts: a step's floor
        (128, 1024), (512, 1024), (128, 2048), (512, 2048),  # over half and all of the prefix
    ]


@pytest.mark.parametrize("max_len,block_size", [(2048, 16), (1000, 128), (600, 16), (600, 128)])
def test_every_point_fits_the_window_and_caches_whole_blocks(max_len, block_size):
    points = warmup_points(max_len, block_size)
    assert points, "a window this long has room for a prefix and a suffix"
    prefix = points[0][0]
    assert points[0] == (prefix, 0) and prefix % block_size == 0
    for uncached, cached in points:
        assert uncached >= 1 and uncached + cached + 1 < max_len
        assert cached % block_size == 0 and cached <= prefix
    assert {c for _, c in points} > {0} and len({u for u, _ in points}) >= 3  # the fit needs both


def test_a_window_too_short_for_a_cached_prefix_gets_no_warm_up():
    assert warmup_points(200, 128) == []
