"""The replay's default prediction error: fitted to the live cost model's measured one, read
from the outputs that publish it, and said in the report."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from typer.testing import CliRunner

from bench.replay import drawn_error
from cli.main import app
from protos.errors import BatonError
from protos.wire import CostModelStatus, PoolStatus, PredictionError
from simulator.live_error import (
    LIVE_PREFILL_ERROR,
    DrawnError,
    MeasuredError,
    UnreadableMeasurement,
    read_measured_error,
)
from simulator.prediction_error import (
    abs_error_quantile,
    error_factors,
    mean_abs_error_of,
    sigma_for_mean_abs_error,
    sigma_for_median_abs_error,
)

TRACE = Path(__file__).parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


@pytest.mark.parametrize("median", [0.075, 0.13, 0.192])
def test_fitted_draws_have_the_measured_median_and_the_stated_p90(median):
    sigma = sigma_for_median_abs_error(median)
    drawn, _ = error_factors(400_000, mean_abs_error_of(sigma), seed=5)
    # the live figure is |predicted - actual| / actual = |1/f - 1|: the same distribution
    live = np.abs(1 / drawn - 1)
    assert np.median(live) == pytest.approx(median, rel=0.01)
    assert np.median(np.abs(drawn - 1)) == pytest.approx(median, rel=0.01)
    assert np.percentile(live, 90) == pytest.approx(abs_error_quantile(sigma, 0.9), rel=0.01)


def test_mean_abs_error_of_inverts_sigma_for_mean_abs_error():
    for error in (0.0, 0.058, 0.1, 0.3):
        assert mean_abs_error_of(sigma_for_mean_abs_error(error)) == pytest.approx(error, abs=1e-12)
    assert abs_error_quantile(0.0, 0.9) == 0.0 and sigma_for_median_abs_error(0.0) == 0.0


def test_the_default_is_fitted_to_the_recorded_live_median():
    drawn = drawn_error(None, None)
    assert drawn.fitted_to == LIVE_PREFILL_ERROR and drawn.median_pct == 13.0
    # a 13 % median is a lognormal sigma of 0.194: 15.6 % mean |error|, 31.9 % p90 (measured 25.8)
    assert drawn.mean_abs_error == pytest.approx(0.1565, abs=5e-4)
    assert drawn.p90_pct == pytest.approx(31.9, abs=0.1)
    assert "e1f0bda" in drawn.describe() and "held-out median 13 %" in drawn.describe()


def test_a_given_error_is_drawn_as_given():
    drawn = drawn_error(0.1, None)
    assert drawn == DrawnError.given(0.1) and drawn.fitted_to is None
    assert drawn.mean_abs_error == 0.1 and drawn.median_pct == pytest.approx(8.39, abs=0.01)
    assert drawn.describe().endswith("as given (--prediction-error)")
    assert drawn_error(0.0, None).p90_pct == 0.0
    with pytest.raises(BatonError, match="give one"):
        drawn_error(0.1, TRACE)


def test_the_live_error_is_read_from_baton_status_json(tmp_path):
    pools = PoolStatus("baton", {}, [], [], {}, [], cost_model=CostModelStatus(True, PredictionError(9.5, 21.25, 40)))
    path = tmp_path / "status.json"
    path.write_bytes(msgspec.json.encode({"status": pools, "fronts": None}))  # as `baton status --json`
    measured = read_measured_error(path)
    assert (measured.median_pct, measured.p90_pct) == (9.5, 21.25)
    assert "40 held-out prefills" in measured.source
    assert drawn_error(None, path).median_pct == 9.5


def test_the_live_error_is_the_median_over_a_peers_files_baton_runs(tmp_path):
    runs = [{"stack": "baton-0p2d", "cost_model_error_pct": {"prefill": {"median": m, "p90": p}}}
            for m, p in ((7.5, 14.9), (11.4, 36.0), (19.2, 44.3))]
    runs.append({"stack": "smg-round_robin"})  # SMG runs record none
    path = tmp_path / "peers.json"
    path.write_text(json.dumps({"options": {}, "runs": runs, "summary": {}}))
    assert read_measured_error(path) == MeasuredError(
        median_pct=11.4, p90_pct=36.0, source=f"baton bench peers {path} (median over 3 Baton runs)")


@pytest.mark.parametrize("content, message", [
    ("not json", "cannot read"),
    (json.dumps({"status": {"cost_model": None}}), "reports no prefill error"),
    (json.dumps({"runs": [{"stack": "smg-round_robin"}]}), "no Baton run"),
    (json.dumps({"something": 1}), "neither"),
])
def test_an_unreadable_live_error_says_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "f.json"
    path.write_text(content)
    with pytest.raises(UnreadableMeasurement, match=message):
        read_measured_error(path)


def test_the_report_says_which_error_it_drew_with(tmp_path):
    trace = tmp_path / "small.jsonl"
    trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:120]))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(trace), "--prefill", "2", "--decode", "2",
                                      "--policy", "least_loaded", "--no-goodput", "--out", str(out)])
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["fleet"]["prediction_error"] == pytest.approx(0.1565, abs=5e-4)
    assert run["prediction_error"]["fitted_to"]["median_pct"] == 13.0
    assert "fitted to the live prefill model's held-out median 13 %" in (out / "results.md").read_text()
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(trace), "--prefill", "2", "--decode", "2",
                                      "--policy", "least_loaded", "--no-goodput", "--out", str(out),
                                      "--prediction-error", "0"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "run.json").read_text())["prediction_error"]["fitted_to"] is None
    assert "prediction error 0.0% mean |error| (median 0.0 %, p90 0.0 %), as given" in (out / "results.md").read_text()
