"""Where a policy's TTFT goes beyond the oracle's: the parts by hand on a small fleet, and parts
that add up to each request's excess on a replayed slice."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app

from simulator.breakdown import COMPONENTS, mean_parts, ttft_over_oracle
from simulator.fleet import FleetConfig
from simulator.oracle import oracle_ttft_ms
from simulator.profile import load_profile
from simulator.sim import Simulation, Workload
from simulator.trace import load_trace
from tests.unit.test_simulator_events import PROFILE, fleet, workload

TRACE = Path(__file__).parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


def test_the_parts_of_a_queued_a_handed_off_and_a_rejected_request_by_hand():
    """One prefill instance, three cold prompts at once. A: prefill 0 -> 20 ms, hand-off 2 ms,
    one 5 ms step: TTFT 27 against the oracle's 20 + 5. B waits 20 ms for A's prefill, then the
    same: 47 against 25. C (5,000 tokens, 60 ms) is priced 40 ms of queue + 60 over the 80 ms
    SLO and rejected: charged 80 against the oracle's 65."""
    w = workload((0.0, 1000, 1, [1, 2]), (0.0, 1000, 1, [3, 4]), (0.0, 5000, 1, list(range(10, 20))))
    sim = Simulation(w, fleet(admission=True, ttft_slo_ms=80.0), PROFILE, "least_loaded").run()
    assert sim.rejected.tolist() == [False, False, True]
    parts = ttft_over_oracle(sim)
    assert list(parts) == list(COMPONENTS)
    assert parts["handoff_and_steps"].tolist() == pytest.approx([2.0, 2.0, 0.0])
    assert parts["queue"].tolist() == pytest.approx([0.0, 20.0, 0.0])
    assert parts["rejected"].tolist() == pytest.approx([0.0, 0.0, 15.0])
    for name in ("coalesce_hold", "prefix_transfer", "miss_prefill", "oracle_cap"):
        assert parts[name].tolist() == [0.0, 0.0, 0.0], name
    means = mean_parts(parts)
    assert means["queue"] == pytest.approx(20.0 / 3) and means["rejected"] == pytest.approx(5.0)
    assert mean_parts(parts, np.array([False, True, False]))["queue"] == pytest.approx(20.0 / 3)


@pytest.mark.parametrize("policy", ["baton", "mooncake", "round_robin"])
def test_the_parts_add_up_to_each_requests_ttft_over_the_oracle(policy):
    requests = load_trace(TRACE)[:300]
    f = FleetConfig(num_prefill_instances=2, num_decode_instances=2, prediction_error=0.3, error_seed=2)
    profile = load_profile("analytic")
    sim = Simulation(Workload(requests), f, profile, policy, rate_scale=2.0).run()
    parts = ttft_over_oracle(sim)
    total = sum(parts.values())
    oracle_raw, _ = oracle_ttft_ms(sim.workload, f, profile)
    charged = np.where(sim.served, sim.ttft_ms, f.ttft_slo_ms)
    assert total == pytest.approx(charged - np.minimum(oracle_raw, f.ttft_slo_ms), abs=1e-6)
    assert sum(mean_parts(parts).values()) == pytest.approx(charged.mean() - np.minimum(oracle_raw, 5000).mean())
    if policy == "baton":  # the co-located path's parts too
        assert sim.colocated.any() and (sim.served & ~sim.colocated).any()


def test_replay_breakdown_re_simulates_a_written_replay(tmp_path):
    trace = tmp_path / "small.jsonl"
    trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:160]))
    out = tmp_path / "out"
    args = ["--prefill", "2", "--decode", "2", "--policy", "mooncake,baton", "--prediction-error", "0.3"]
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(trace), *args, "--no-goodput",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    result = CliRunner().invoke(app, ["bench", "replay-breakdown", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert sum(line.startswith("| ") and "/" in line for line in lines) == len(COMPONENTS) + 2  # + header, total
    for policy in ("baton", "mooncake"):  # the same runs as the replay's
        assert f"{policy}: TTFT mean {results[policy]['ttft_ms']['mean']:,.0f} ms" in result.output
    total = next(line for line in lines if line.startswith("| **total"))
    excess = results["baton"]["ttft_ms"]["mean"] - results["oracle"]["ttft_ms"]["mean"]
    assert total.split("|")[2].split("/")[0].strip() == f"{excess:,.0f}"
    result = CliRunner().invoke(app, ["bench", "replay-breakdown", str(out), "--policy", "dynamo_kv"])
    assert result.exit_code == 2 and "no results for dynamo_kv" in " ".join(result.output.split())
