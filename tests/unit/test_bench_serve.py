"""``baton bench serve``: trace expansion and the metrics, with exact expectations."""

from __future__ import annotations

import pytest

from bench.serve import (
    BenchServeError,
    ExpansionOptions,
    RequestRecord,
    block_token_ids,
    compute_metrics,
    expand,
    parse_goodput,
    select_requests,
)
from simulator.trace import TraceRequest


def req(timestamp: float, hash_ids: tuple[int, ...], input_length: int | None = None,
        output_length: int = 10) -> TraceRequest:
    return TraceRequest(timestamp, input_length or 512 * len(hash_ids), output_length, hash_ids)


# ------------------------------------------------------------------------------ expansion


def test_a_block_is_a_function_of_its_id_and_the_seed_only():
    options = ExpansionOptions()
    first = block_token_ids(7, 32, options)
    assert first == block_token_ids(7, 32, options)
    assert len(first) == 32 and all(1_000 <= t < 32_000 for t in first)
    assert first != block_token_ids(8, 32, options)
    assert first != block_token_ids(7, 32, ExpansionOptions(seed=1))
    assert block_token_ids(7, 8, options) == first[:8]


def test_shared_hash_ids_give_identical_prefixes_and_nothing_more():
    calls = expand([req(0, (1, 2, 3)), req(5, (1, 2, 4)), req(9, (5, 2, 3))], ExpansionOptions())
    a, b, c = (call.token_ids for call in calls)
    assert len(a) == len(b) == len(c) == 96  # 3 ids x 32 tokens
    assert a[:64] == b[:64] and a[64:] != b[64:]
    # id 2 after another first id is the same block's tokens (ids name blocks), but not a prefix
    assert a[:32] != c[:32] and a[32:64] == c[32:64]


def test_expansion_is_deterministic_across_calls():
    trace = [req(0, (1, 2)), req(3, (1, 3))]
    assert expand(trace, ExpansionOptions()) == expand(trace, ExpansionOptions())


@pytest.mark.parametrize("token_scale,per_id", [(1, 512), (16, 32), (64, 8), (512, 1)])
def test_token_scale_sets_tokens_per_hash_id_and_scales_the_prompt_length(token_scale, per_id):
    # 1,100 tokens: 3 ids, the last one partial (76 of 512 tokens)
    (call,) = expand([req(0, (1, 2, 3), input_length=1_100)], ExpansionOptions(token_scale=token_scale))
    assert len(call.token_ids) == -(-1_100 // token_scale)
    assert call.token_ids[:per_id] == tuple(block_token_ids(1, per_id, ExpansionOptions()))


def test_a_token_scale_that_does_not_divide_a_block_is_refused():
    with pytest.raises(BenchServeError, match="must divide 512"):
        expand([req(0, (1,))], ExpansionOptions(token_scale=3))


def test_arrivals_are_scaled_from_milliseconds():
    calls = expand([req(0, (1,)), req(1_000, (2,)), req(2_500, (3,))], ExpansionOptions(time_scale=0.5))
    assert [c.arrival_s for c in calls] == [0.0, 0.5, 1.25]
    assert [c.index for c in calls] == [0, 1, 2]


def test_output_lengths_are_scaled_then_clamped():
    trace = [req(0, (1,), output_length=n) for n in (1, 10, 300)]
    options = ExpansionOptions(output_scale=2, min_output_tokens=4, max_output_tokens=100)
    assert [c.max_tokens for c in expand(trace, options)] == [4, 5, 100]
    assert [c.max_tokens for c in expand(trace, ExpansionOptions(max_output_tokens=None))] == [1, 10, 300]


def test_max_input_tokens_cuts_the_prompt_keeping_its_prefix():
    full, cut = (expand([req(0, (1, 2, 3))], ExpansionOptions(max_input_tokens=m))[0] for m in (None, 40))
    assert cut.token_ids == full.token_ids[:40]


def test_select_keeps_the_busiest_sessions_takes_a_prefix_and_starts_at_zero():
    trace = [req(100, (1, 2)), req(200, (9,)), req(300, (1, 3)), req(400, (5,)), req(500, (5, 6)),
             req(600, (1, 4))]
    chosen = select_requests(trace, top_sessions=2)
    assert [(r.timestamp, r.hash_ids) for r in chosen] == [
        (0, (1, 2)), (200, (1, 3)), (300, (5,)), (400, (5, 6)), (500, (1, 4))]
    assert [r.timestamp for r in select_requests(trace, max_requests=2)] == [0, 100]


# ------------------------------------------------------------------------------ metrics


def records() -> list[RequestRecord]:
    a = RequestRecord(0, sent_s=10.0, delta_times_s=[10.1, 10.15, 10.25], prompt_tokens=100,
                      cached_tokens=50, completion_tokens=3, prefill_instance="d0", decode_instance="d0")
    b = RequestRecord(1, sent_s=11.0, delta_times_s=[11.3, 11.4], prompt_tokens=100, cached_tokens=0,
                      completion_tokens=2, prefill_instance="p0", decode_instance="d0")
    failed = RequestRecord(2, sent_s=11.5, error="UNAVAILABLE: no decode instance is ready")
    return [a, b, failed]


def test_metrics_follow_vllm_bench_serve_on_synthetic_timestamps():
    m = compute_metrics(records(), duration_s=2.0, percentiles=(50, 99), goodput_slos_ms={"ttft": 200, "tpot": 80})
    approx = pytest.approx
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 200, 5)
    assert (m["request_throughput"], m["output_throughput"], m["total_token_throughput"]) == (1.0, 2.5, 102.5)
    # TTFT 100 and 300 ms; numpy's linear percentile: p99 = 100 + 0.99 x 200
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["p50_ttft_ms"], m["p99_ttft_ms"]) == approx((200, 200, 200, 298))
    assert m["std_ttft_ms"] == approx(100)
    # TPOT (E2EL - TTFT) / (n - 1): (250 - 100) / 2 = 75 and (400 - 300) / 1 = 100
    assert (m["mean_tpot_ms"], m["p99_tpot_ms"]) == approx((87.5, 99.75))
    # ITL: every gap between deltas: 50, 100 (a) and 100 (b)
    assert (m["mean_itl_ms"], m["median_itl_ms"], m["p99_itl_ms"]) == approx((250 / 3, 100, 100))
    # E2EL: the last delta's arrival: 250 and 400 ms
    assert (m["mean_e2el_ms"], m["median_e2el_ms"]) == approx((325, 325))
    # goodput: a meets TTFT <= 200 and TPOT <= 80; b's TTFT is 300
    assert m["request_goodput"] == 0.5
    assert (m["prompt_tokens"], m["cached_tokens"], m["hit_ratio"], m["colocated"]) == (200, 50, 0.25, 1)
    assert m["errors"] == {"UNAVAILABLE": 1}


def test_a_single_token_request_has_no_tpot_and_counts_zero_tpot_for_goodput():
    one = RequestRecord(0, sent_s=0.0, delta_times_s=[0.5], prompt_tokens=10, completion_tokens=1)
    m = compute_metrics([one], duration_s=1.0, goodput_slos_ms={"tpot": 1})
    assert (m["mean_tpot_ms"], m["mean_itl_ms"], m["mean_ttft_ms"], m["mean_e2el_ms"]) == (0, 0, 500, 500)
    assert m["request_goodput"] == 1.0
    assert compute_metrics([one], 1.0)["request_goodput"] is None


def test_goodput_slos_parse_as_vllm_spells_them():
    assert parse_goodput(["ttft:2000", "tpot:100"]) == {"ttft": 2000.0, "tpot": 100.0}
    assert parse_goodput(["ttft:1,e2el:5000"]) == {"ttft": 1.0, "e2el": 5000.0}
    with pytest.raises(BenchServeError, match="KEY is one of ttft, tpot, e2el"):
        parse_goodput(["itl:50"])
    with pytest.raises(BenchServeError, match="expects KEY:MS"):
        parse_goodput(["ttft:fast"])
