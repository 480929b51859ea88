"""``baton bench itl``'s bookkeeping: which gaps belong to which phase, how big the pool of
cached prompts must be, the summary over runs, and the order of the configurations."""

from __future__ import annotations

import asyncio

import pytest

from bench.itl import ItlRun, _Gaps, pool_size, run_itl, summary
from cluster.config import load_config


def test_a_gap_belongs_to_the_phase_both_its_ends_fall_in():
    gaps = _Gaps()
    gaps.streams = [[0.0, 0.1, 0.25, 1.0, 1.05], [0.5, 0.52]]
    assert gaps.window(0.0, 0.5) == pytest.approx([100.0, 150.0])
    assert gaps.window(0.5, 2.0) == pytest.approx([50.0, 20.0])  # 0.25 -> 1.0 straddles


def test_the_pool_outgrows_the_decode_engines_own_kv_cache():
    config = load_config(None, {"engine.model": "smollm2", "engine.kv_cache_gib": 1.0,
                                "engine.dtype": "bfloat16"})  # 'auto' is float32 on a CPU without bf16
    # SmolLM2 in bf16: 23,040 bytes a token, so 1 GiB holds 46,603 tokens: 15 prompts of 3,000
    assert pool_size(config, 3000) == 15 + 6 + 3  # and the control phase's 3


def _run(async_transfers: bool, ratio: float, too_light: bool = False) -> ItlRun:
    return ItlRun(
        async_kv_transfers=async_transfers, idle_itl_p50_ms=40.0, idle_itl_p99_ms=50.0,
        loaded_itl_p50_ms=42.0, loaded_itl_p99_ms=50.0 * ratio, ratio=ratio,
        idle_max_gap_ms=60.0, loaded_max_gap_ms=70.0, idle_gaps=100, loaded_gaps=200, loads=300,
        loads_per_s=10.0, load_gbps=1.5, loaded_ttft_p50_ms=200.0,
        loaded_tokens_generated_mean=16.0, decode_batch_size=20.0, busy_itl_p50_ms=45.0,
        busy_itl_p99_ms=55.0, ratio_vs_busy=ratio / 1.1, busy_requests_per_s=9.0, busy_loads=3,
        busy_decode_batch_size=19.0, too_light=too_light)


def test_the_summary_is_the_median_of_each_figure_and_flags_any_light_run():
    runs = [_run(True, 1.0), _run(True, 1.4, too_light=True), _run(True, 1.2)]
    out = summary(runs)
    assert (out["ratio"], out["loaded_itl_p99_ms"], out["runs"], out["too_light"]) == (
        1.2, 60.0, 3, True)


def test_the_order_must_name_both_configurations():
    config = load_config(None, {"engine.model": "tiny"})
    with pytest.raises(ValueError, match="async and sync"):
        asyncio.run(run_itl(config, order="async,async"))


@pytest.mark.parametrize("prefill, decode, reason, kind", [
    ("d0", "d0", "colocated: priced 812.5 ms < prefill pool 1,020 ms; load 2,944 tokens",
     "co-located: colocated: priced N ms < prefill pool N,N ms"),
    ("p0", "d0", "cost 1.2 ms = transfer 0.4 + queue 0 + prefill 0.8",
     "prefill pool: cost N ms = transfer N + queue N + prefill N"),
    ("", "d0", "", "prefill pool: ?"),
])
def test_a_loaded_requests_placement_says_where_its_prefill_ran_and_why(prefill, decode, reason,
                                                                       kind):
    from bench.itl import placement_kind

    assert placement_kind(prefill, decode, reason) == kind
