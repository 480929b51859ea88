"""bench.kvstore's fair harness: row names, ABBA order, fresh processes, the row's figures."""

from __future__ import annotations

import pytest

from bench import kvstore


def test_disk_stands_for_its_four_rows_in_a_fixed_order():
    assert kvstore.expand_paths(("disk", "shm")) == [
        "shm", "disk-write", "disk-write-nodigest", "disk-write-fsync", "disk-read"]
    assert kvstore.expand_paths(("disk-read",)) == ["disk-read"]
    with pytest.raises(ValueError, match="unknown benchmark paths"):
        kvstore.expand_paths(("nvme",))


def test_a_row_is_medians_their_ratio_and_the_spreads():
    row = kvstore._row("tcp", [2.0, 4.0, 3.0], [2.0, 2.0, 4.0])
    assert (row.gbps, row.baseline_gbps, row.ratio) == (3.0, 2.0, 1.5)
    assert row.gbps_spread == (2.0, 4.0) and row.baseline_gbps_spread == (2.0, 4.0)
    assert row.ratio_spread == (0.75, 2.0) and row.runs == 3 and row.target_ratio == 0.8


def test_runs_alternate_the_order_and_each_side_is_its_own_process(monkeypatch):
    calls = []

    def fake(m):
        calls.append((m.path, m.side))
        return 2.0 if m.side == "path" else 4.0

    monkeypatch.setattr(kvstore, "measure_side", fake)
    [row] = kvstore.run_benchmark(num_blocks=4, rounds=1, paths=("shm",), runs=4)
    assert [side for _, side in calls] == ["path", "baseline", "baseline", "path",
                                           "path", "baseline", "baseline", "path"]
    assert row.ratio == 0.5 and row.runs == 4


def test_a_real_disk_read_pair_runs_in_fresh_processes(tmp_path):
    [row] = kvstore.run_benchmark(block_bytes=64 * 1024, num_blocks=4, rounds=1,
                                  disk_dir=str(tmp_path), paths=("disk-read",), runs=2)
    assert row.path == "disk-read" and row.gbps > 0 and row.baseline_gbps > 0
    assert list(tmp_path.iterdir()) == []  # each process cleaned up its files
