"""``baton profile``'s evaluation: which points it fits and which it holds out, and that the fit
and the held-out errors are what the measurements say (a fake engine on a fake clock)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from bench import profile
from conductor.cost_model import DecodeCostModel, PrefillCostModel, PrefillSample

TRUE_PREFILL = PrefillCostModel(intercept_ms=12.0, per_token_ms=0.4, per_token_sq_ms=2e-5,
                                per_token_cached_ms=3e-5)
TRUE_DECODE = DecodeCostModel(step_ms_base=15.0, step_ms_per_seq=1.5, step_ms_per_kv_token=4e-4)


@pytest.mark.parametrize("max_len,max_tokens,block_size", [(8192, 4096, 128), (8192, 4096, 16),
                                                          (2048, 1024, 16), (3000, 4096, 128)])
def test_held_out_prefills_are_off_the_grid_or_longer_than_every_fitted_one(max_len, max_tokens, block_size):
    points = profile.prefill_points(max_len, max_tokens, block_size)
    grid = {(u, c) for u in profile.UNCACHED_GRID for c in profile.CACHED_GRID}
    assert len(points.fit) >= 4 and set(points.fit) <= grid
    assert points.off_grid and not set(points.off_grid) & grid
    longest_fit = max(u + c for u, c in points.fit)
    assert points.longer and all(u + c > longest_fit for u, c in points.longer)
    assert max(u + c for u, c in points.off_grid) <= longest_fit + max(profile.OFF_GRID_UNCACHED)
    for u, c in points.fit + points.off_grid + points.longer:
        assert u > 0 and c % block_size == 0 and u + c <= max_tokens and u + c + 1 < max_len


def test_decode_points_vary_batch_and_context_independently():
    """The old profile set context = 272 × batch, so the two terms were collinear; now both the
    fitted and the held-out points span both axes and the fit's features have full rank."""
    fit, held_out = profile.decode_points(8192)
    assert held_out and not set(fit) & set(held_out)
    for points in (fit, held_out):
        assert len({b for b, _ in points}) >= 2 and len({c for _, c in points}) >= 2
    features = np.array([[1.0, b, b * (c + profile.DECODE_NEW_TOKENS // 2)] for b, c in fit])
    assert np.linalg.matrix_rank(features / np.abs(features).max(axis=0)) == 3
    assert all(b * c <= profile.DECODE_MAX_BATCH_TOKENS for b, c in fit + held_out)


class FakeClock:
    now = 0.0

    def perf_counter(self) -> float:
        return self.now


class FakeRunner:
    """An engine whose prefill takes TRUE_PREFILL's time over the prefix it has seen (whole
    blocks) and whose decode steps take TRUE_DECODE's time for the running batch."""

    def __init__(self, clock: FakeClock, block_size: int) -> None:
        self.clock, self.block_size = clock, block_size
        self.seen: list[tuple[int, ...]] = []
        self.running: dict[str, int] = {}

    def _cached(self, tokens: tuple[int, ...]) -> int:
        best = 0
        for other in self.seen:
            n = 0
            while n < min(len(other), len(tokens) - 1) and other[n] == tokens[n]:
                n += 1
            best = max(best, n // self.block_size * self.block_size)
        return best

    async def generate(self, request):
        tokens = request.prompt_token_ids
        cached = self._cached(tokens)
        self.seen.append(tokens)
        self.clock.now += TRUE_PREFILL.t_prefill_ms(len(tokens) - cached, cached) / 1000.0
        self.running[request.request_id] = len(tokens)
        try:
            for step in range(request.sampling.max_tokens):
                if step:  # every running sequence yields once per step: each advances 1/batch of it
                    await asyncio.sleep(0)
                    context = sum(self.running.values())
                    self.clock.now += TRUE_DECODE.t_step_ms(len(self.running), context) / len(self.running) / 1000.0
                    self.running[request.request_id] += 1
                yield SimpleNamespace(num_cached_tokens=cached, finished=step == request.sampling.max_tokens - 1)
        finally:
            del self.running[request.request_id]


def test_the_fit_and_its_held_out_errors_follow_the_measurements(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(profile.time, "perf_counter", clock.perf_counter)
    runner = FakeRunner(clock, 16)
    points = profile.prefill_points(8192, 2048, 16)
    samples = asyncio.run(profile.measure_prefill(runner, points, seed=0, progress=lambda m: None, repeats=1))
    assert [(s.uncached_tokens, s.cached_tokens) for s in samples["longer"]] == points.longer
    fitted = PrefillCostModel.fit(samples["fit"])
    error = profile.held_out_prefill_error(fitted, samples["off_grid"], samples["longer"])
    assert set(error) == {"median", "p90", "median_off_grid", "p90_off_grid", "median_longer", "p90_longer"}
    assert error["p90"] < 0.01  # the fake engine is the model exactly: nothing to miss
    fit, held_out = profile.decode_points(8192)
    decode_samples = asyncio.run(profile.measure_decode(runner, fit + held_out, 0, lambda m: None))
    decode = DecodeCostModel.fit(decode_samples[:len(fit)])
    assert decode.step_ms_per_seq == pytest.approx(TRUE_DECODE.step_ms_per_seq, rel=0.05)
    assert decode.step_ms_per_kv_token == pytest.approx(TRUE_DECODE.step_ms_per_kv_token, rel=0.05)
    assert profile.held_out_decode_error(decode, decode_samples[len(fit):])["p90"] < 2.0


def test_held_out_errors_are_measured_against_what_the_engine_took():
    model = PrefillCostModel(intercept_ms=0.0, per_token_ms=1.0, per_token_sq_ms=0.0, per_token_cached_ms=0.0)
    off_grid = [PrefillSample(uncached_tokens=100, cached_tokens=0, prefill_ms=110.0)]  # 100 predicted: 9.09%
    longer = [PrefillSample(uncached_tokens=200, cached_tokens=0, prefill_ms=100.0)]  # 200 predicted: 100%
    error = profile.held_out_prefill_error(model, off_grid, longer)
    assert error["median_off_grid"] == pytest.approx(9.09, abs=0.01)
    assert error["median_longer"] == pytest.approx(100.0)
    assert error["median"] == pytest.approx((9.09 + 100.0) / 2, abs=0.01)
