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


def test_default_block_sizes_are_the_engines_and_shape_the_blocks():
    from engine.config import CPU_KV_BLOCK_TOKENS, CUDA_KV_BLOCK_TOKENS

    assert kvcopy.BLOCK_TOKENS == {"gpu": CUDA_KV_BLOCK_TOKENS, "cpu": CPU_KV_BLOCK_TOKENS}
    layers, heads, head_dim = kvcopy.MODELS["smollm2-135m"]
    bf16 = 2
    for layout, asked, block_size in (("cpu", None, CPU_KV_BLOCK_TOKENS),
                                      ("gpu", None, CUDA_KV_BLOCK_TOKENS), ("cpu", 128, 128)):
        report = kvcopy.run(layout=layout, blocks=2, rounds=1, staging_blocks=2, block_size=asked)
        assert report["block_size"] == block_size
        # K and V of every layer, one block: 2 x heads x block_size x head_dim elements
        assert report["block_bytes"] == layers * 2 * heads * block_size * head_dim * bf16


def test_cli_rejects_a_block_size_below_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        kvcopy.main(["--block-size", "0", "--blocks", "2", "--rounds", "1"])
    assert exit_info.value.code == 2
    assert "--block-size must be at least 1" in capsys.readouterr().err


def test_split_gives_consecutive_runs_of_near_equal_length():
    assert kvcopy.split([1, 2, 3, 4, 5, 6, 7], 3) == [[1, 2, 3], [4, 5], [6, 7]]
    assert kvcopy.split([1, 2], 8) == [[1], [2]]  # never an empty request
    assert kvcopy.split([1, 2, 3], 1) == [[1, 2, 3]]


def test_per_step_row_times_one_call_a_request_against_one_for_the_step(monkeypatch):
    calls = []
    real_load = kvcopy.BlockCopier.load

    def counted(self, arena, slots, block_ids):
        calls.append(len(slots))
        return real_load(self, arena, slots, block_ids)

    monkeypatch.setattr(kvcopy.BlockCopier, "load", counted)
    report = kvcopy.run(layout="cpu", blocks=6, rounds=1, staging_blocks=2, requests=4)
    (row,) = report["per_step"]
    assert row["mode"] == "direct" and row["requests"] == 4
    assert row["ratio"] == pytest.approx(row["one_call_gbps"] / row["per_request_gbps"], abs=1e-3)
    assert row["one_call_gbps"] == next(r["gbps"] for r in report["rows"] if r["op"] == "load")
    # the check's call, then two rounds (warm-up + 1) of one step call and 4 request calls
    assert sorted(calls) == sorted([6] + 2 * [6, 2, 2, 1, 1])


def test_cli_rejects_fewer_than_one_request(capsys):
    with pytest.raises(SystemExit) as exit_info:
        kvcopy.main(["--requests", "0", "--blocks", "2", "--rounds", "1"])
    assert exit_info.value.code == 2
    assert "--requests must be at least 1" in capsys.readouterr().err
