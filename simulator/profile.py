"""Cost profiles: how long a prefill, a decode step and a KV transfer take on the simulated fleet.

A profile is the conductor's own ``CostProfile`` (``conductor.cost_model``), from one of two
sources. ``analytic``: a 14B-class dense model on one H100 SXM per instance, derived below from
FLOPs, HBM bandwidth and KV bytes per token (the figures of DESIGN.md). Or a JSON file written by
``baton profile`` (measured on a real engine): ``prefill`` (``PrefillCostModel`` fields),
``transfer`` (``TransferModel`` fields), ``decode`` (``DecodeCostModel`` fields),
``kv_bytes_per_token``, ``block_size_tokens``, and optionally ``model``, ``device`` and the
samples; keys ``CostProfile`` does not know are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conductor.cost_model import (
    CostProfile,
    DecodeCostModel,
    LinkCost,
    PrefillCostModel,
    TransferModel,
    kv_bytes_per_token,
)
from protos.errors import BatonError


class ProfileError(BatonError):
    """The profile is neither ``analytic`` nor a readable ``baton profile`` JSON file."""


class AnalyticGpu(BaseModel):
    """The inputs of the analytic profile. Defaults: a 14B-class dense model (40 layers, d_model
    5120, 8 KV heads of dim 128, bf16: 160 KiB of KV per token) on one H100 SXM per instance
    (989 TFLOPS dense bf16, 3.35 TB/s HBM), 8 GPUs to a node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_params: float = Field(14e9, gt=0, description="Model parameters.")
    num_layers: int = Field(40, gt=0, description="Transformer layers.")
    d_model: int = Field(5120, gt=0, description="Hidden size (query heads × head dim).")
    num_kv_heads: int = Field(8, gt=0, description="KV heads (GQA).")
    head_dim: int = Field(128, gt=0, description="Head dimension.")
    dtype_bytes: int = Field(2, gt=0, description="Bytes per weight and per KV element (bf16).")
    peak_flops: float = Field(989e12, gt=0, description="Dense bf16 FLOP/s of one GPU.")
    prefill_mfu: float = Field(0.5, gt=0, le=1, description="Share of peak FLOP/s a prefill reaches.")
    hbm_bytes_per_s: float = Field(3.35e12, gt=0, description="HBM bandwidth of one GPU (bytes/s).")
    hbm_efficiency: float = Field(0.8, gt=0, le=1, description="Share of HBM bandwidth a step reaches.")
    pcie_bytes_per_s: float = Field(50e9, gt=0, description="Host DRAM to GPU, PCIe 5 x16 (64 GB/s "
                                    "peak) at ~80% (bytes/s).")
    rdma_bytes_per_s: float = Field(40e9, gt=0, description="Node to node, one 400 Gbps NIC per GPU "
                                    "(50 GB/s) at ~80% (bytes/s).")
    disk_bytes_per_s: float = Field(5e9, gt=0, description="NVMe Gen4 (~7 GB/s) read (bytes/s).")

    def profile(self) -> CostProfile:
        """Prefill: ``2·params`` FLOPs per token for the linear layers; attention ``4·layers·d_model``
        FLOPs per (query, key) pair, ``u²/2`` pairs among new tokens (causal) and ``u·c`` over the
        cached prefix; all at ``prefill_mfu`` of peak; the intercept is one read of the weights.
        Decode step: weights read once per step, the KV of every context token read once, plus the
        linear-layer FLOPs of each sequence."""
        flops_per_ms = self.peak_flops * self.prefill_mfu / 1000.0
        weight_bytes = self.num_params * self.dtype_bytes
        step_bytes_per_ms = self.hbm_bytes_per_s * self.hbm_efficiency / 1000.0
        pair_flops = 4.0 * self.num_layers * self.d_model
        kv_bytes = kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)
        prefill = PrefillCostModel(
            intercept_ms=weight_bytes / (self.hbm_bytes_per_s / 1000.0),
            per_token_ms=2.0 * self.num_params / flops_per_ms,
            per_token_sq_ms=pair_flops / 2.0 / flops_per_ms,
            per_token_cached_ms=pair_flops / flops_per_ms,
        )
        decode = DecodeCostModel(
            step_ms_base=weight_bytes / step_bytes_per_ms,
            step_ms_per_seq=2.0 * self.num_params / flops_per_ms,
            step_ms_per_kv_token=kv_bytes / step_bytes_per_ms,
        )
        transfer = TransferModel(
            same_node=LinkCost(bytes_per_s=self.pcie_bytes_per_s, setup_ms=0.1),
            remote_host=LinkCost(bytes_per_s=self.rdma_bytes_per_s, setup_ms=0.5),
            remote_disk=LinkCost(bytes_per_s=self.disk_bytes_per_s, setup_ms=1.0),
        )
        return CostProfile(
            model=f"analytic: {self.num_params / 1e9:g}B dense, {self.num_layers} layers, "
                  f"{self.num_kv_heads} KV heads x {self.head_dim}, {self.dtype_bytes}-byte KV",
            device=f"cuda (analytic): {self.peak_flops / 1e12:g} TFLOPS at {self.prefill_mfu:g} MFU, "
                   f"{self.hbm_bytes_per_s / 1e12:g} TB/s HBM at {self.hbm_efficiency:g}",
            block_size_tokens=16, kv_bytes_per_token=kv_bytes, prefill=prefill, decode=decode,
            transfer=transfer,
        )


ANALYTIC_DEVICE_KV_BYTES = 40e9
"""KV cache of one analytic instance: 80 GB HBM × 0.9 utilization, less 28 GB of bf16 weights and
~4 GB of activations (bytes): about 244k tokens of the analytic model."""


def load_profile(spec: str) -> CostProfile:
    """``"analytic"`` or the path of a ``baton profile`` JSON file."""
    if spec == "analytic":
        return AnalyticGpu().profile()
    path = Path(spec)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"cannot read profile {path}: {e}; pass 'analytic' or a file from "
                           "'baton profile'") from e
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {path} must hold a JSON object")
    required = ("prefill", "transfer", "decode", "kv_bytes_per_token", "block_size_tokens")
    missing = [f for f in required if f not in raw]
    if missing:
        raise ProfileError(f"profile {path} lacks {', '.join(missing)}; 'baton profile' writes all of "
                           f"{', '.join(required)}")
    known = {f: raw[f] for f in CostProfile.model_fields if f in raw}
    known.setdefault("model", "unknown")
    known.setdefault("device", "unknown")
    try:
        return CostProfile(**known)
    except ValidationError as e:
        raise ProfileError(f"profile {path} is malformed: {e}") from e
