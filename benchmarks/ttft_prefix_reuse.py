"""TTFT of a cold ~2,000-token prompt against the same prompt plus 64 new tokens right after
(warm: its full blocks are cached), through the whole disaggregated path; plus start-up times.

    .venv/bin/python -m benchmarks.ttft_prefix_reuse [--model smollm2] [--repeats 5] [--out bench-out]

Cold and warm requests are interleaved pairs on one running cluster, so the ratio compares
figures measured side by side on the same (noisy, shared) machine. Writes
``OUT/ttft_prefix_reuse.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _prompt(num_tokens: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(num_tokens)]


async def run(model: str, repeats: int, prompt_tokens: int, extra_tokens: int,
              overrides: dict) -> dict:
    from cluster.config import load_config
    from cluster.serve import BatonServer
    from engine.builder import effective_dtype
    from gateway import client

    config = load_config(None, {"engine.model": model, "gateway.port": 0, "http.enabled": False, **overrides})
    server = BatonServer(config, progress=lambda m: print(f"  {m}", flush=True))
    await server.start()
    try:
        pairs = []
        # One throwaway request warms code paths (first-call allocations) out of the figures.
        await client.generate(server.target, token_ids=_prompt(256, seed=999), max_tokens=1)
        for i in range(repeats):
            base = _prompt(prompt_tokens, seed=i)
            warm_prompt = base + _prompt(extra_tokens, seed=1000 + i)
            cold = await client.generate(server.target, token_ids=base, max_tokens=1)
            warm = await client.generate(server.target, token_ids=warm_prompt, max_tokens=1)
            pairs.append({
                "cold_ttft_ms": cold["usage"]["ttft_ms"],
                "warm_ttft_ms": warm["usage"]["ttft_ms"],
                "cold_cached_tokens": cold["usage"]["cached_tokens"],
                "warm_cached_tokens": warm["usage"]["cached_tokens"],
                "warm_loaded_tokens": warm["usage"]["loaded_tokens"],
            })
            print(f"  pair {i + 1}/{repeats}: cold {pairs[-1]['cold_ttft_ms']:.0f} ms, "
                  f"warm {pairs[-1]['warm_ttft_ms']:.0f} ms "
                  f"(cached {pairs[-1]['warm_cached_tokens']})", flush=True)
        cold_med = statistics.median(p["cold_ttft_ms"] for p in pairs)
        warm_med = statistics.median(p["warm_ttft_ms"] for p in pairs)
        return {
            "benchmark": "ttft_prefix_reuse",
            "model": model,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "config_overrides": overrides,
            "dtype": effective_dtype(config.engine, server.cluster.model),
            "prompt_tokens": prompt_tokens,
            "warm_extra_tokens": extra_tokens,
            "repeats": repeats,
            "cold_ttft_ms_median": cold_med,
            "warm_ttft_ms_median": warm_med,
            "cold_over_warm_ratio": cold_med / warm_med,
            "engine_start_s": server.cluster.engine_start_s,
            "serve_start_s": server.start_seconds,
            "pairs": pairs,
        }
    finally:
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--extra-tokens", type=int, default=64)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="cluster config override, as in `baton serve --set`")
    parser.add_argument("--name", default="ttft_prefix_reuse", help="output file stem")
    args = parser.parse_args()
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    started = time.perf_counter()
    result = asyncio.run(run(args.model, args.repeats, args.prompt_tokens, args.extra_tokens, overrides))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.json"
    path.write_text(json.dumps(result, indent=2))
    print()
    print(f"model {result['model']} ({result['dtype']}), {result['prompt_tokens']}-token prompt, "
          f"median of {result['repeats']}, overrides {overrides or 'none'}")
    print(f"  cold TTFT  {result['cold_ttft_ms_median']:8.1f} ms")
    print(f"  warm TTFT  {result['warm_ttft_ms_median']:8.1f} ms   (+{args.extra_tokens} tokens, "
          f"{result['pairs'][0]['warm_cached_tokens']} cached)")
    print(f"  cold/warm  {result['cold_over_warm_ratio']:8.2f}x")
    starts = ", ".join(f"{k} {v:.1f} s" for k, v in result["engine_start_s"].items())
    print(f"  engine start: {starts}; baton serve start to serving: {result['serve_start_s']:.1f} s")
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
