"""``baton bench conductor`` on a small index: the JSON it writes and the index it builds."""

from __future__ import annotations

import json

from bench import conductor as bench


def test_the_bench_fills_the_index_it_says_and_writes_its_figures(tmp_path):
    out = tmp_path / "conductor.json"
    results = bench.run(out, num_blocks=6_400, num_decisions=40, sizes=(8, 16), echo=lambda line: None)
    assert json.loads(out.read_text()) == results
    assert set(results["decision_us"]) == {"8", "16"}
    assert set(results["decision_us_shared_trunk"]) == {"8", "16"}  # the agent case, same shape
    for key in ("decision_us", "decision_us_shared_trunk"):
        for size, figures in results[key].items():
            assert set(figures) == {"p50", "p99", "num_decode_instances"}
            assert 0 < figures["p50"] <= figures["p99"]
            assert figures["num_decode_instances"] == int(size) // 4
    assert results["ingest_blocks_per_s"] > 0 and results["store_ingest_blocks_per_s"] > 0
    assert len(results["ingest_runs_blocks_per_s"]) == 2


def test_in_the_agent_case_every_instance_holds_the_trunk():
    from conductor.kv_index import KvIndex

    index = KvIndex()
    prefill, decode = [f"p{i}" for i in range(8)], ["d0", "d1"]
    for n, instance_id in enumerate(prefill + decode):
        index.add_instance(instance_id, f"node-{n // 4}", bench.MODEL, bench.LAYOUT)
    trunk, agents = bench._add_shared_trunk(index, prefill, decode, bench.random.Random(0))
    keys = bench.block_keys(trunk + agents[3][:5 * bench.BLOCK_TOKENS], bench.BLOCK_TOKENS,
                            bench.KeyExtras(bench.MODEL, "", "", bench.LAYOUT))
    hits = index.prefix_hits(keys)
    assert set(hits) == set(prefill + decode) and len(agents) == 2 * len(prefill)
    holder = prefill[3 % len(prefill)]  # agent a's history is on prefill instance a mod N
    assert {i: h.num_blocks for i, h in hits.items()} == {
        i: bench.TRUNK_BLOCKS + (5 if i == holder else 0) for i in prefill + decode}


def test_a_quarter_of_the_chains_are_also_in_the_host_tier():
    r = bench.bench_decisions(8, num_blocks=6_400, num_decisions=10)
    assert r["indexed_blocks"] == 6_400  # 100 chains of 64 distinct blocks
    assert r["host_indexed_blocks"] == 25 * 64
