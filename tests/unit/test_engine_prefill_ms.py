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
