"""bench.kvcopy on CPU: its report's rows and keys, and its byte check catches a broken copy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import kvcopy


@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_cpu_report_has_one_row_per_op_and_says_it_measures_the_code_path(layout):
    report = kvcopy.run(layout=layout, blocks=4, rounds=1, staging_blocks=2)
    assert report["device"] == "cpu" and report["note"] == kvcopy.CPU_NOTE
    assert [(r["op"], r["mode"]) for r in report["rows"]] == [("load", "direct"), ("save", "direct")]
    for row in report["rows"]:
        assert row["gbps"] > 0 and row["raw_gbps"] > 0 and row["legacy_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["gbps"] / row["raw_gbps"], abs=1e-3)
        assert row["gbps_min"] <= row["gbps"] <= row["gbps_max"]
    assert report["bytes_per_copy"] == 4 * report["block_bytes"]


def test_a_copier_that_drops_bytes_fails_the_run(monkeypatch):
    monkeypatch.setattr(kvcopy.BlockCopier, "save", lambda self, arena, ids, slots: _NoCopy())
    with pytest.raises(RuntimeError, match="did not round-trip"):
        kvcopy.run(blocks=2, rounds=1)


class _NoCopy:
    def wait(self) -> None:
        return None


def test_module_runs_with_torch_only_and_writes_json(tmp_path):
    out = tmp_path / "kvcopy.json"
    code = ("import runpy, sys; sys.argv = ['kvcopy', '--blocks', '2', '--rounds', '1', "
            f"'--json', {str(out)!r}]; runpy.run_module('bench.kvcopy', run_name='__main__'); "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'vllm', 'ray', 'msgspec', 'pydantic', 'ucxx', 'redis', 'grpc'}); print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert [r["op"] for r in json.loads(out.read_text())["rows"]] == ["load", "save"]
