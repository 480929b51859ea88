"""What an operator reads: ``baton status`` fitted to the terminal (nothing truncated, the least
needed columns give way, ``--wide`` shows all), and front addresses as bound, with a warning
when a cluster deployment serves loopback only."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from typer.testing import CliRunner

from cli import operate
from cli.main import app
from conductor.state import PlacementCounters
from gateway.admin_wire import StatusView
from protos.wire import FrontAddresses, InstanceRow, PoolStatus, StoreRow, TierCounters

INSTANCES = [
    InstanceRow("opstest-prefill-0", "prefill", "node-7f3a9c", "ready", 3, 4, 5, 0.25, 1000, 640,
                12.5, None),
    InstanceRow("opstest-decode-12", "decode", "node-1b2c3d", "draining", 0, 9, 1, 0.5, 0, 0,
                None, 7.25),
]
POOLS = PoolStatus(
    "baton", {"prefill": {"ready": 1}, "decode": {"draining": 1}}, INSTANCES,
    [StoreRow("node-7f3a9c", 100, 40, 6, 7, 8, TierCounters(1, 2, 3, 4, 9, 5, 1))],
    PlacementCounters(placed=10), [])
FRONTS = FrontAddresses("10.0.0.7", 50051, 8000, False, "127.0.0.1", "0.0.0.0")
HEADERS = ("instance", "pool", "node", "state", "waiting", "running", "booked", "KV used",
           "prefix hits", "TTFT ms", "ITL ms")


@pytest.fixture
def status_of(monkeypatch):
    monkeypatch.setattr(operate, "_operator", lambda *args: SimpleNamespace(
        status=lambda: StatusView(POOLS, FRONTS, "opstest")))

    def run(columns: int, *flags: str) -> str:
        result = CliRunner().invoke(app, ["status", *flags], env={"COLUMNS": str(columns)})
        assert result.exit_code == 0, result.output
        return result.output

    return run


def test_an_80_column_terminal_gets_whole_values_and_fewer_columns(status_of):
    out = status_of(80)

    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    for row in INSTANCES:
        assert row.instance_id in out and row.phase in out
    for kept in ("instance", "pool", "state", "running", "KV used"):
        assert kept in out
    for dropped in ("booked", "ITL ms"):
        assert dropped not in out
    assert "columns hidden to fit 80 columns; --wide shows them" in out


@pytest.mark.parametrize("columns, flags", [(200, ()), (80, ("--wide",))])
def test_a_wide_terminal_or_wide_flag_shows_every_column(status_of, columns, flags):
    out = status_of(columns, *flags)

    for header in HEADERS + ("pull failures",):
        assert header in out
    assert "hidden" not in out
    assert "7" in out and "node-1b2c3d" in out


def test_fronts_print_where_they_listen():
    assert operate.front_lines(FRONTS) == [
        "gRPC  127.0.0.1:50051", "HTTP  http://10.0.0.7:8000/v1   metrics: http://10.0.0.7:8000/metrics"]
    assert operate.loopback_warning(FRONTS).startswith("gRPC listens on loopback only")
    everywhere = FrontAddresses("10.0.0.7", 50051, None, False, "0.0.0.0", "127.0.0.1")
    assert operate.front_lines(everywhere) == ["gRPC  10.0.0.7:50051"]
    assert operate.loopback_warning(everywhere) is None  # no HTTP front: nothing on loopback
    both = FrontAddresses("10.0.0.7", 1, 2, True, "localhost", "::1")
    assert operate.loopback_warning(both).startswith("gRPC and HTTP listen on loopback only")
    old_gateway = FrontAddresses("10.0.0.7", 50051, 8000)  # no bound hosts reported
    assert operate.front_lines(old_gateway)[0] == "gRPC  10.0.0.7:50051"
    assert operate.loopback_warning(old_gateway) is None


def test_status_shows_the_cost_models_held_out_error(monkeypatch):
    from protos.wire import CostModelStatus, PredictionError

    pools = msgspec.structs.replace(POOLS, cost_model=CostModelStatus(True, PredictionError(7.5, 21.25, 40)))
    monkeypatch.setattr(operate, "_operator", lambda *args: SimpleNamespace(
        status=lambda: StatusView(pools, FRONTS, "opstest")))
    out = CliRunner().invoke(app, ["status", "--wide"], env={"COLUMNS": "200"}).output
    assert ("cost model: calibrating from measured timings; prefill error median 7.5%, p90 21.2% "
            "(last 40 held out); decode not measured yet") in out
    assert operate.cost_model_line(CostModelStatus(False)) == (
        "cost model: fixed (conductor.calibrate_cost_model false); error not measured")
    warm = CostModelStatus(True, None, None, "warm-up of 7 prefills")
    assert operate.cost_model_line(warm) == (
        "cost model: calibrating from measured timings (prefill model: warm-up of 7 prefills); "
        "prefill not measured yet; decode not measured yet")
    per_request = CostModelStatus(True, None, PredictionError(8.0, 31.0, 200), "", 0.0, None,
                                  PredictionError(3.5, 9.25, 60))
    assert operate.cost_model_line(per_request) == (
        "cost model: calibrating from measured timings; prefill not measured yet; decode error "
        "median 8.0%, p90 31.0% (last 200 held out); decode per request error median 3.5%, p90 "
        "9.2% (last 60 held out)")
    every = CostModelStatus(True, None, PredictionError(8.0, 31.0, 200), "", 0.0, None,
                            PredictionError(3.5, 9.25, 60), PredictionError(14.5, 22.0, 36),
                            PredictionError(6.0, 13.5, 44))
    assert operate.cost_model_line(every) == (
        "cost model: calibrating from measured timings; prefill not measured yet; decode error "
        "median 8.0%, p90 31.0% (last 200 held out); decode per request error median 3.5%, p90 "
        "9.2% (last 60 held out); decode beside prompt chunks, per step error median 14.5%, p90 "
        "22.0% (last 36 held out); decode per request, all steps error median 6.0%, p90 13.5% "
        "(last 44 held out)")
    handoff = CostModelStatus(True, None, None, "", 283.5, PredictionError(9.0, 30.5, 17))
    assert operate.cost_model_line(handoff) == (
        "cost model: calibrating from measured timings; prefill not measured yet; decode not "
        "measured yet; KV hand-off overhead 283.5 ms, hand-off error median 9.0%, p90 30.5% "
        "(last 17 held out)")
