"""``baton profile``: measure the real engine and the transfer paths, fit the conductor's cost model.

Prefill: one in-process vLLM engine (the cluster's model and engine config, prefix caching on).
For each point of a grid of (uncached tokens, cached tokens) it first runs the cached prefix
(so the engine's prefix cache holds it), then times the prompt prefix + uncached suffix to its
first token (the median of three prompts). Every point is measured in two rounds with different
prompts; the fit uses the first round, and the error is reported on the second (held out,
never fitted).

Decode: batches of 1..16 concurrent sequences generate 32 tokens each; the mean inter-token time
per batch size and context is fitted to ``DecodeCostModel``.

Transfer: Baton's own transfer engine (``bench.kvstore``) moves KV-block batches over the
same-node shared memory, TCP and disk paths; the measured bandwidths fill ``TransferModel``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Callable

from conductor.cost_model import (
    CostProfile,
    DecodeCostModel,
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
DECODE_BATCHES = (1, 4, 8, 16)


def _prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 30_000) for _ in range(num_tokens)]


async def _first_token_ms(runner: EngineRunner, request_id: str, tokens: list[int]) -> tuple[float, int]:
    request = EngineRequest(request_id, tuple(tokens), SamplingOptions(max_tokens=1, temperature=0.0))
    started = time.perf_counter()
    cached = 0
    async for output in runner.generate(request):
        cached = output.num_cached_tokens or cached
    return (time.perf_counter() - started) * 1000.0, cached


async def measure_prefill(runner: EngineRunner, max_len: int, block_size: int, seed: int,
                          progress: Callable[[str], None], max_tokens: int,
                          repeats: int = 3) -> list[list[PrefillSample]]:
    """Two rounds of samples over the grid (the second is held out); points whose prompt
    exceeds ``max_tokens`` (or the context window) are skipped."""
    rng = random.Random(seed)
    await _first_token_ms(runner, "warmup", _prompt(rng, 256))
    rounds: list[list[PrefillSample]] = [[], []]
    points = [(u, c) for c in CACHED_GRID for u in UNCACHED_GRID
              if u + c + 1 < max_len and u + c <= max_tokens]
    for r in range(2):
        for n, (uncached, cached) in enumerate(points):
            progress(f"prefill round {r + 1}/2, point {n + 1}/{len(points)}: "
                     f"{uncached} new over {cached} cached tokens")
            times, found = [], cached
            for k in range(repeats):  # the median of a few, so a noisy neighbour does not decide
                prefix = _prompt(rng, cached)
                if cached:
                    await _first_token_ms(runner, f"prefix-{r}-{n}-{k}", prefix)
                ms, hit = await _first_token_ms(runner, f"point-{r}-{n}-{k}", prefix + _prompt(rng, uncached))
                times.append(ms)
                found = min(found, hit)
            rounds[r].append(PrefillSample(uncached_tokens=uncached + cached - found,
                                           cached_tokens=found, prefill_ms=statistics.median(times)))
    return rounds


async def measure_decode(runner: EngineRunner, seed: int,
                         progress: Callable[[str], None]) -> list[tuple[int, int, float]]:
    rng = random.Random(seed + 1)
    samples = []
    for batch in DECODE_BATCHES:
        progress(f"decode: batch of {batch}")
        context = 256
        requests = [EngineRequest(f"dec-{batch}-{i}", tuple(_prompt(rng, context)),
                                  SamplingOptions(max_tokens=32, temperature=0.0, ignore_eos=True))
                    for i in range(batch)]

        async def one(request: EngineRequest) -> list[float]:
            stamps = []
            async for _ in runner.generate(request):
                stamps.append(time.perf_counter())
            return [(b - a) * 1000.0 for a, b in zip(stamps[1:], stamps[2:])]  # skip the prefill

        gaps = [g for per in await asyncio.gather(*(one(r) for r in requests)) for g in per]
        gaps.sort()
        step_ms = gaps[len(gaps) // 2]
        samples.append((batch, batch * (context + 16), step_ms))
    return samples


def measure_transfer(block_bytes: int, progress: Callable[[str], None]) -> TransferModel:
    from bench.kvstore import run_benchmark

    progress("transfer: shared memory, TCP and disk paths")
    results = {r.path: r for r in run_benchmark(block_bytes=block_bytes, num_blocks=32, rounds=3,
                                                paths=("shm", "tcp", "disk"))}
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
        fit_round, held_out = asyncio.run(
            measure_prefill(runner, max_len, block_size, seed, progress, max_tokens))
        decode_samples = asyncio.run(measure_decode(runner, seed, progress))
    finally:
        runner.shutdown()
    prefill = PrefillCostModel.fit(fit_round)
    median, p90 = prefill.prediction_error_pct(held_out)
    dtype = effective_dtype(engine, model)
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype_bytes(dtype))
    transfer = measure_transfer(per_token * block_size, progress) if with_transfer else TransferModel()
    return CostProfile(
        model=model.name, device=f"{engine.device} ({dtype})", block_size_tokens=block_size,
        kv_bytes_per_token=per_token, prefill=prefill, decode=DecodeCostModel.fit(decode_samples),
        transfer=transfer, prefill_error_pct={"median": round(median, 2), "p90": round(p90, 2)},
        samples=fit_round + held_out,
    )
