"""``baton bench conductor`` on a small index: the JSON it writes and the index it builds."""

from __future__ import annotations

import json

from bench import conductor as bench


def test_the_bench_fills_the_index_it_says_and_writes_its_figures(tmp_path):
    out = tmp_path / "conductor.json"
    results = bench.run(out, num_blocks=6_400, num_decisions=40, sizes=(8, 16), echo=lambda line: None)
    assert json.loads(out.read_text()) == results
    assert set(results["decision_us"]) == {"8", "16"}
    for size, figures in results["decision_us"].items():
        assert 0 < figures["p50"] <= figures["p99"]
        assert figures["num_decode_instances"] == int(size) // 4
    assert results["ingest_blocks_per_s"] > 0 and results["store_ingest_blocks_per_s"] > 0
    assert len(results["ingest_runs_blocks_per_s"]) == 2


def test_a_quarter_of_the_chains_are_also_in_the_host_tier():
    r = bench.bench_decisions(8, num_blocks=6_400, num_decisions=10)
    assert r["indexed_blocks"] == 6_400  # 100 chains of 64 distinct blocks
    assert r["host_indexed_blocks"] == 25 * 64
