"""``baton profile``: measure the real engine and the transfer paths, fit the conductor's cost model.

Prefill: one in-process vLLM engine (the cluster's model and engine config, prefix caching on).
For each point (uncached tokens, cached tokens) it first runs the cached prefix (so the engine's
prefix cache holds it), then times the prompt prefix + uncached suffix to its first token (the
median of three prompts). The fit uses a grid of points up to 3/4 of the largest prompt; the
error is reported on points it never saw (``prefill_points``): off the grid in both coordinates
(interpolation) and longer than any fitted prompt (extrapolation, up to the largest prompt).

Decode: batches of 1..16 concurrent sequences, each over a context of 64..1,536 tokens (batch
size and context varied independently, so the model's two terms can be told apart), generate 32
tokens each; the median inter-token time per point is fitted to ``DecodeCostModel`` on two
thirds of the points and its error reported on the other third (``decode_points``).

Transfer: Baton's own transfer engine (``bench.kvstore``'s fair measurements: fresh processes,
disk reads with the page cache dropped) moves KV-block batches over the same-node shared memory,
TCP and disk paths; the measured bandwidths fill ``TransferModel``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Callable, NamedTuple

import numpy as np

from conductor.cost_model import (
    CostProfile,
    DecodeCostModel,
    DecodeSample,
    LinkCost,
    PrefillCostModel,
    PrefillSample,
    TransferModel,
    kv_bytes_per_token,
)
from engine.builder import build_engine_args, dtype_bytes, effective_dtype
from engine.config import EngineConfig
from engine.models import PreparedModel
from engine.runner import EngineRunner
from protos.wire import EngineRequest, SamplingOptions

UNCACHED_GRID = (64, 256, 512, 1024, 2048)
CACHED_GRID = (0, 512, 1024, 2048)
"""The fitted prefill grid (points up to ``FIT_LIMIT_FRAC`` of the largest prompt)."""
OFF_GRID_UNCACHED = (128, 384, 768, 1536)
OFF_GRID_CACHED = (0, 256, 768, 1536)
"""Held-out prefill points between the grid's (uncached 0 stays: a cold prompt off the grid)."""
FIT_LIMIT_FRAC = 0.75
LONGER_TOTAL_FRACS = (0.875, 1.0)
LONGER_UNCACHED_FRACS = (1.0, 0.5, 0.125)
"""Held-out prefill points longer than any fitted one: prompts of these fractions of the
largest prompt, with these fractions of them uncached."""
DECODE_BATCHES = (1, 4, 8, 16)
DECODE_CONTEXTS = (64, 512, 1536)
"""Context tokens per sequence at the start of a decode point."""
DECODE_MAX_BATCH_TOKENS = 8_192
"""Largest batch × context measured (its prefill comes first: a bound on the profile's time)."""
DECODE_NEW_TOKENS = 32


class PrefillPoints(NamedTuple):
    """(uncached, cached) token points: fitted, and held out off the grid and longer."""

    fit: list[tuple[int, int]]
    off_grid: list[tuple[int, int]]
    longer: list[tuple[int, int]]


def prefill_points(max_len: int, max_tokens: int, block_size: int) -> PrefillPoints:
    """The prefill points for prompts of at most ``max_tokens`` (and under the context window
    ``max_len``): the grid up to ``FIT_LIMIT_FRAC`` of ``max_tokens`` to fit; off-grid points
    in the same range and points longer than every fitted one to hold out. Cached counts are
    whole blocks (only full blocks are cached)."""
    max_tokens = min(max_tokens, max_len - 2)  # a prompt and its first token fit the window

    def fits(u: int, c: int, limit: int) -> bool:
        return u + c <= limit and u + c + 1 < max_len

    limit = int(max_tokens * FIT_LIMIT_FRAC)
    fit = [(u, c) for c in CACHED_GRID for u in UNCACHED_GRID if fits(u, c, limit)]
    off_grid = [(u, c) for c in OFF_GRID_CACHED for u in OFF_GRID_UNCACHED
                if fits(u, c, limit) and (u, c) not in fit]
    longest_fit = max((u + c for u, c in fit), default=0)
    longer = []
    for total_frac in LONGER_TOTAL_FRACS:
        total = int(max_tokens * total_frac)
        for uncached_frac in LONGER_UNCACHED_FRACS:
            cached = int(total * (1 - uncached_frac)) // block_size * block_size
            point = (total - cached, cached)
            if total > longest_fit and fits(*point, max_tokens) and point not in longer:
                longer.append(point)
    return PrefillPoints(fit, off_grid, longer)


def decode_points(max_len: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(fitted, held out) decode points (batch size, context tokens per sequence): every batch
    size with every context under ``DECODE_MAX_BATCH_TOKENS`` and the context window; a diagonal
    third held out (batch index + context index = 1 mod 3), so both sets span both axes."""
    fit, held_out = [], []
    for i, batch in enumerate(DECODE_BATCHES):
        for j, context in enumerate(DECODE_CONTEXTS):
            if batch * context <= DECODE_MAX_BATCH_TOKENS and context + DECODE_NEW_TOKENS < max_len:
                (held_out if (i + j) % 3 == 1 else fit).append((batch, context))
    return fit, held_out


def error_pct(errors: list[float]) -> dict[str, float]:
    """{"median", "p90"} of absolute percentage errors, rounded to 0.01."""
    return {"median": round(float(np.median(errors)), 2), "p90": round(float(np.percentile(errors, 90)), 2)}


def prefill_errors(model: PrefillCostModel, samples: list[PrefillSample]) -> list[float]:
    return [abs(model.t_prefill_ms(s.uncached_tokens, s.cached_tokens) - s.prefill_ms) / s.prefill_ms * 100
            for s in samples if s.prefill_ms > 0]


def held_out_prefill_error(model: PrefillCostModel, off_grid: list[PrefillSample],
                           longer: list[PrefillSample]) -> dict[str, float]:
    """The fitted model's error on the held-out prefills: all of them ("median", "p90"), and
    each kind apart ("median_off_grid", "p90_off_grid", "median_longer", "p90_longer")."""
    result = error_pct(prefill_errors(model, off_grid + longer))
    for name, samples in (("off_grid", off_grid), ("longer", longer)):
        errors = prefill_errors(model, samples)
        if errors:
            result.update({f"{k}_{name}": v for k, v in error_pct(errors).items()})
    return result


def held_out_decode_error(model: DecodeCostModel, samples: list[tuple[int, int, float]]) -> dict[str, float]:
    """The fitted decode model's error on held-out (num_seqs, context_tokens, step_ms) points."""
    return error_pct([abs(model.t_step_ms(n, ctx) - ms) / ms * 100 for n, ctx, ms in samples if ms > 0])


def _prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 30_000) for _ in range(num_tokens)]


async def _first_token_ms(runner: EngineRunner, request_id: str, tokens: list[int]) -> tuple[float, int]:
    request = EngineRequest(request_id, tuple(tokens), SamplingOptions(max_tokens=1, temperature=0.0))
    started = time.perf_counter()
    cached = 0
    async for output in runner.generate(request):
        cached = output.num_cached_tokens or cached
    return (time.perf_counter() - started) * 1000.0, cached


async def measure_prefill(runner: EngineRunner, points: PrefillPoints, seed: int,
                          progress: Callable[[str], None],
                          repeats: int = 3) -> dict[str, list[PrefillSample]]:
    """One sample per point of each kind ("fit", "off_grid", "longer"), each prompt new."""
    rng = random.Random(seed)
    await _first_token_ms(runner, "warmup", _prompt(rng, 256))
    samples: dict[str, list[PrefillSample]] = {}
    for kind, kind_points in points._asdict().items():
        samples[kind] = []
        for n, (uncached, cached) in enumerate(kind_points):
            progress(f"prefill {kind} point {n + 1}/{len(kind_points)}: "
                     f"{uncached} new over {cached} cached tokens")
            times, found = [], cached
            for k in range(repeats):  # the median of a few, so a noisy neighbour does not decide
                prefix = _prompt(rng, cached)
                if cached:
                    await _first_token_ms(runner, f"prefix-{kind}-{n}-{k}", prefix)
                ms, hit = await _first_token_ms(runner, f"point-{kind}-{n}-{k}", prefix + _prompt(rng, uncached))
                times.append(ms)
                found = min(found, hit)
            samples[kind].append(PrefillSample(uncached_tokens=uncached + cached - found,
                                               cached_tokens=found, prefill_ms=statistics.median(times)))
    return samples


async def measure_decode(runner: EngineRunner, points: list[tuple[int, int]], seed: int,
                         progress: Callable[[str], None]) -> list[tuple[int, int, float]]:
    """(num_seqs, context_tokens, step_ms) per (batch size, context per sequence) point: the
    median inter-token time, over the batch's mean context (start + half the new tokens)."""
    rng = random.Random(seed + 1)
    samples = []
    for n, (batch, context) in enumerate(points):
        progress(f"decode point {n + 1}/{len(points)}: batch of {batch} over {context} tokens each")
        requests = [EngineRequest(f"dec-{n}-{i}", tuple(_prompt(rng, context)),
                                  SamplingOptions(max_tokens=DECODE_NEW_TOKENS, temperature=0.0,
                                                  ignore_eos=True))
                    for i in range(batch)]

        async def one(request: EngineRequest) -> list[float]:
            stamps = []
            async for _ in runner.generate(request):
                stamps.append(time.perf_counter())
            return [(b - a) * 1000.0 for a, b in zip(stamps[1:], stamps[2:])]  # skip the prefill

        gaps = sorted(g for per in await asyncio.gather(*(one(r) for r in requests)) for g in per)
        samples.append((batch, batch * (context + DECODE_NEW_TOKENS // 2), gaps[len(gaps) // 2]))
    return samples


def measure_transfer(block_bytes: int, progress: Callable[[str], None]) -> TransferModel:
    from bench.kvstore import run_benchmark

    progress("transfer: shared memory, TCP and disk (page cache dropped), fresh processes")
    results = {r.path: r for r in run_benchmark(block_bytes=block_bytes, num_blocks=32, rounds=3,
                                                paths=("shm", "tcp", "disk-read"), runs=3)}
    defaults = TransferModel()

    def link(path: str, default: LinkCost) -> LinkCost:
        r = results.get(path)
        return LinkCost(bytes_per_s=r.gbps * 1e9, setup_ms=default.setup_ms) if r and r.gbps > 0 else default

    return TransferModel(same_node=link("shm", defaults.same_node),
                         remote_host=link("tcp", defaults.remote_host),
                         remote_disk=link("disk-read", defaults.remote_disk))


def profile(engine: EngineConfig, model: PreparedModel, block_size: int, seed: int = 0,
            progress: Callable[[str], None] = print, with_transfer: bool = True,
            max_tokens: int = 4096) -> CostProfile:
    """Run every measurement and fit; returns the profile (the caller saves it)."""
    progress("starting the engine")
    runner = EngineRunner(build_engine_args(engine, model, "plain", "profile", None))
    try:
        max_len = min(engine.max_model_len_tokens or model.max_model_len, model.max_model_len)
        prefill_samples = asyncio.run(measure_prefill(
            runner, prefill_points(max_len, max_tokens, block_size), seed, progress))
        decode_fit, decode_held_out = decode_points(max_len)
        decode_samples = asyncio.run(measure_decode(runner, decode_fit + decode_held_out, seed, progress))
    finally:
        runner.shutdown()
    prefill = PrefillCostModel.fit(prefill_samples["fit"])
    prefill_error = held_out_prefill_error(prefill, prefill_samples["off_grid"], prefill_samples["longer"])
    decode = DecodeCostModel.fit(decode_samples[:len(decode_fit)])
    decode_error = held_out_decode_error(decode, decode_samples[len(decode_fit):])
    dtype = effective_dtype(engine, model)
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype_bytes(dtype))
    transfer = measure_transfer(per_token * block_size, progress) if with_transfer else TransferModel()
    return CostProfile(
        model=model.name, device=f"{engine.device} ({dtype})", block_size_tokens=block_size,
        kv_bytes_per_token=per_token, prefill=prefill, decode=decode,
        transfer=transfer, prefill_error_pct=prefill_error, decode_error_pct=decode_error,
        samples=[s for kind in ("fit", "off_grid", "longer") for s in prefill_samples[kind]],
        num_fitted_samples=len(prefill_samples["fit"]),
        decode_samples=[DecodeSample(num_seqs=n, context_tokens=c, step_ms=ms) for n, c, ms in decode_samples],
        num_fitted_decode_samples=len(decode_fit),
    )
