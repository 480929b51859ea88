"""``baton bench replay``: the goodput search, profiles, the command line and what it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from conductor.cost_model import PrefillCostModel
from simulator.profile import AnalyticGpu, ProfileError, load_profile
from simulator.replay import UnknownPolicy, find_goodput, parse_policies

TRACE = Path(__file__).parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


def test_goodput_doubles_then_bisects_until_the_bracket_is_within_2_percent():
    tried = []

    def attainment(scale):
        tried.append(scale)
        return 0.95 if scale <= 5.0 else 0.5

    search = find_goodput(attainment)
    # 1, 2, 4 pass, 8 fails; then [4, 8] is bisected in log space six times: 4·2^(k/64) with
    # k = 32 (5.66 fails), 16 (4.76 passes), 24 (5.19 fails), 20 (4.97 passes), 22 (5.08 fails),
    # 21 (5.02 fails): the bracket 2^(1/64) = 1.1% wide
    bisections = [4 * 2 ** (k / 64) for k in (32, 16, 24, 20, 22, 21)]
    assert tried == pytest.approx([1, 2, 4, 8, *bisections])
    assert search.goodput == pytest.approx(4 * 2 ** (20 / 64)) and search.upper == pytest.approx(4 * 2 ** (21 / 64))
    assert search.goodput <= 5.0 < search.upper and search.upper / search.goodput <= 1.02
    assert [p.rate_scale for p in search.points] == tried


@pytest.mark.parametrize("true_goodput", [0.37, 1.0, 3.3, 7.99, 12.5])
def test_the_goodput_bracket_holds_the_answer_within_2_percent(true_goodput):
    search = find_goodput(lambda s: 0.95 if s <= true_goodput else 0.5)
    assert search.goodput <= true_goodput < search.upper <= search.goodput * 1.02


def test_goodput_halves_when_the_trace_rate_already_fails():
    search = find_goodput(lambda s: 0.91 if s <= 0.3 else 0.2)
    assert [p.rate_scale for p in search.points][:3] == [1.0, 0.5, 0.25]
    assert 0.25 <= search.goodput <= 0.3 < search.upper


def test_goodput_is_zero_when_nothing_passes_and_capped_when_everything_does():
    assert (find_goodput(lambda s: 0.0, max_doublings=3).goodput, find_goodput(lambda s: 0.0, max_doublings=3).upper) == (0.0, 0.125)
    capped = find_goodput(lambda s: 1.0, max_doublings=3)
    assert (capped.goodput, capped.upper) == (8.0, None)


def test_policy_names():
    assert parse_policies("all")[-1] == "baton" and len(parse_policies("all")) == 7
    assert parse_policies("baton, mooncake") == ["baton", "mooncake"]
    with pytest.raises(UnknownPolicy, match="nope"):
        parse_policies("baton,nope")


def test_analytic_profile_follows_flops_and_bandwidth():
    profile = AnalyticGpu().profile()
    assert profile.kv_bytes_per_token == 2 * 40 * 8 * 128 * 2 == 163_840
    assert profile.prefill.per_token_ms == pytest.approx(2 * 14e9 / (989e12 * 0.5) * 1e3)
    assert profile.prefill.intercept_ms == pytest.approx(28e9 / 3.35e12 * 1e3)
    assert profile.decode.step_ms_base == pytest.approx(28e9 / (3.35e12 * 0.8) * 1e3)
    assert profile.decode.step_ms_per_kv_token == pytest.approx(163_840 / (3.35e12 * 0.8) * 1e3)
    # a 15k-token prompt, uncached: about a second on one H100
    assert 900 < profile.prefill.t_prefill_ms(15_000, 0) < 1_200


def test_a_baton_profile_file_loads(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({
        "model": "smollm2", "device": "cpu", "block_size_tokens": 16, "kv_bytes_per_token": 23040,
        "prefill": PrefillCostModel().model_dump(),
        "transfer": {"same_node": {"bytes_per_s": 3e9, "setup_ms": 0.2},
                     "remote_host": {"bytes_per_s": 1.4e9, "setup_ms": 1.0},
                     "remote_disk": {"bytes_per_s": 1e9, "setup_ms": 2.0}},
        "decode": {"step_ms_base": 15.0, "step_ms_per_seq": 1.0, "step_ms_per_kv_token": 1e-4},
        "something_else": 1,
    }))
    profile = load_profile(str(path))
    assert profile.decode.t_step_ms(2, 10_000) == pytest.approx(18.0)
    assert profile.kv_bytes_per_token == 23040
    path.write_text(json.dumps({"prefill": {}}))
    with pytest.raises(ProfileError, match="lacks transfer, decode"):
        load_profile(str(path))
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(str(tmp_path / "missing.json"))


def test_bad_trace_or_policy_exits_2(tmp_path):
    runner = CliRunner()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n')
    for args, message in (
        (["--trace", str(tmp_path / "none.jsonl")], "does not exist"),
        (["--trace", str(bad)], "1 hash_ids for 1000 tokens"),
        (["--trace", str(TRACE), "--policy", "nope"], "unknown policy nope"),
        (["--trace", str(TRACE), "--profile", str(bad)], "profile"),
    ):
        result = runner.invoke(app, ["bench", "replay", *args, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2, result.output
        assert message in " ".join(result.output.split())


def test_replay_writes_results_table_and_plots(tmp_path):
    trace = tmp_path / "small.jsonl"
    trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:300]))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(trace), "--prefill", "4",
                                      "--decode", "4", "--policy", "least_loaded,baton", "--out", str(out),
                                      "--jobs", "1"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["least_loaded", "baton", "oracle"]
    oracle = results.pop("oracle")
    assert set(oracle["ttft_ms"]) == {"mean", "p50", "p90", "p99"} and oracle["goodput_rate_scale"] > 0
    assert results["least_loaded"]["tuned"] == {}  # no knobs
    tuned = results["baton"]["tuned"]
    assert tuned["baton_colocation"] in ("priced", "short")
    assert set(tuned) == {"baton_replication_margin_frac", "baton_colocation",
                          *(["short_prefill_tokens"] if tuned["baton_colocation"] == "short" else [])}
    assert len(results["baton"]["tuning"]) == 12
    for entry in results.values():
        lo, hi = entry["goodput_ci"]
        assert lo == entry["goodput_rate_scale"] and hi <= lo * 1.02
        assert entry["ttft_mean_vs_oracle"] >= 1.0
        assert {"hit_ratio", "hit_ceiling_fraction", "ttft_ms", "tbt_p99_ms", "slo_attainment",
                "goodput_rate_scale", "prefill_compute_s", "profile"} <= set(entry)
        assert set(entry["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
        assert set(entry["slo_attainment"]) == {"ttft", "tbt", "both"}
        assert entry["goodput_rate_scale"] > 0 and entry["profile"] == "analytic"
        assert entry["goodput_sweep"][0]["rate_scale"] == 1.0
    assert "SIMULATED" in (out / "results.md").read_text()
    run = json.loads((out / "run.json").read_text())
    assert (run["num_tune_requests"], run["num_race_requests"]) == (75, 225)
    assert (out / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "goodput.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "run.json").read_text())["simulated"] is True
