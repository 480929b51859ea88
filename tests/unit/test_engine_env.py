"""What a CPU worker's environment carries before vLLM is imported, and what the bound on
oneDNN's kernel cache (``engine.onednn_primitive_cache_capacity``) does: vLLM-CPU's linear
layers compile a oneDNN matmul per token count they see, and oneDNN keeps 1,024 of them by
default, each holding memory. Measured in a fresh process per setting, the way a worker gets
it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.builder import engine_env
from engine.config import EngineConfig

PROBE = """
import sys, torch
from vllm import _custom_ops as ops
from worker.memory import malloc_stats
torch.manual_seed(0)
handler = ops.create_onednn_mm(torch.randn(576, 1536), 32)
x = torch.randn(1600, 576)
ops.onednn_mm(handler, x[:1], None)
before, _ = malloc_stats()
for m in range(2, 1600, 2):  # 800 token counts, as a soak's prefill chunks and batches vary
    ops.onednn_mm(handler, x[:m], None)
after, _ = malloc_stats()
print((after - before) / 2**20)
"""


def test_cpu_workers_bound_onednn_s_kernel_cache_when_told_to():
    assert engine_env(EngineConfig(onednn_primitive_cache_capacity=128), "0")[
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in engine_env(EngineConfig(), "0")  # oneDNN's
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in engine_env(
        EngineConfig(device="cuda", onednn_primitive_cache_capacity=128), "0")


def _heap_growth_mb(env: dict[str, str]) -> float:
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return float(run.stdout.split()[-1])


def test_the_bound_keeps_a_linear_layer_s_heap_flat_where_onednn_s_default_grows():
    pytest.importorskip("vllm")
    import os

    base = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    bounded = _heap_growth_mb({**base, **{
        k: v for k, v in engine_env(EngineConfig(onednn_primitive_cache_capacity=128), "").items()
        if k == "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}})
    default = _heap_growth_mb(base)
    assert default > 150  # ~0.28 MB kept per token count, up to 1,024 of them
    assert bounded < 60  # 128 kernels at most
