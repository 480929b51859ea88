"""Decode-only inter-token latency of one peers stack: where a decode step's time goes.

``python -m bench.decode_probe STACK [--sets N]`` starts ``STACK`` (a ``bench.peers_stacks``
name: ``smg-round_robin``, ``baton-0p2d``, ...) as ``baton bench peers`` does, warms it with
one set, then sends ``N`` sets of ``STREAMS`` streaming ``/v1/completions`` at once: each a
``PROMPT_WORDS``-word prompt of common words (the same words to every stack, from the set's
seed), ``MAX_TOKENS`` tokens with ``ignore_eos``, temperature 0. Prefills are over once every
stream has its first token; the gaps between a stream's later tokens (from half a second after
the last stream started) are the decode steps of a batch of ``STREAMS`` / engines, with
nothing else running. It prints the mean, p50 and p90 gap per set. Run it for each stack one
after the other on an otherwise idle box (the peers benchmark's lock:
``flock /tmp/baton-heavy.lock``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

STREAMS = 8
PROMPT_WORDS = 1500
MAX_TOKENS = 150
SETTLE_S = 0.5
"""Gaps are counted from this long after the last stream's first token."""
WORDS = ("time people year way day thing man world life hand part child eye woman place work "
         "week case point number group problem fact water house money story room night car "
         "city river table music paper game light door tree bird stone road sky sun field").split()


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's (name, user + system CPU seconds so far), by pid: its command line's
    first words (Ray names its workers ``ray::Class.method``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile
            continue
        name = " ".join(argv.split()[:3])[:70] or entry.name
        out[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_shares(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
               wall_s: float, top: int = 12) -> list[tuple[str, float]]:
    """The ``top`` processes by CPU used between two ``cpu_seconds`` (% of one core), the
    rest summed as ``(others)``."""
    used = []
    for pid, (name, seconds) in after.items():
        start = before.get(pid, (name, 0.0))[1]
        if seconds > start:
            used.append((f"{pid} {name}", (seconds - start) / wall_s * 100.0))
    used.sort(key=lambda item: -item[1])
    rest = sum(share for _name, share in used[top:])
    return used[:top] + ([("(others)", rest)] if rest else [])


def decode_gaps_ms(streams: list[list[float]], settle_s: float = SETTLE_S) -> list[float]:
    """The gaps (ms) between consecutive token arrivals of each stream, counting only tokens
    that arrived ``settle_s`` after the last stream's first token (every prompt computed by
    then); sorted. A stream with no tokens is an error (ValueError)."""
    if any(not times for times in streams):
        raise ValueError("a stream returned no tokens")
    start = max(times[0] for times in streams) + settle_s
    gaps = []
    for times in streams:
        late = [t for t in times if t > start]
        gaps += [(b - a) * 1000.0 for a, b in zip(late, late[1:])]
    return sorted(gaps)


async def _stream(client, url: str, prompt: str, model: str) -> list[float]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url} answered {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices")
                if choices and choices[0].get("text") is not None:
                    times.append(time.perf_counter())
    return times


async def probe_set(url: str, model: str, seed: int, streams: int = STREAMS) -> list[float]:
    """One set of ``streams`` streams at once; the decode gaps (ms)."""
    import httpx

    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS)) for _ in range(streams)]
    async with httpx.AsyncClient() as client:
        streams = await asyncio.gather(*(_stream(client, url, p, model) for p in prompts))
    return decode_gaps_ms(list(streams))


def main(argv: list[str] | None = None) -> None:
    from bench.peers_stacks import ABLATION_STACKS, DEFAULT_STACKS, Stack
    from engine.models import prepare_model

    stacks = {s.name: s for s in DEFAULT_STACKS + ABLATION_STACKS}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stack", choices=sorted(stacks))
    parser.add_argument("--sets", type=int, default=3, help="measured sets (after one warm-up)")
    parser.add_argument("--streams", type=int, default=STREAMS,
                        help="streams at once (the stack spreads them over its engines)")
    parser.add_argument("--cpu", action="store_true",
                        help="also print each process's share of a core over the measured sets")
    parser.add_argument("--logs", type=Path, default=Path("bench-out/decode-probe-logs"))
    args = parser.parse_args(argv)
    model = prepare_model("smollm2")
    with Stack(stacks[args.stack], model, args.logs) as stack:
        asyncio.run(probe_set(stack.base_url, model.name, 1000, args.streams))  # warm-up
        before, started = cpu_seconds(), time.perf_counter()
        for seed in range(args.sets):
            gaps = asyncio.run(probe_set(stack.base_url, model.name, seed, args.streams))
            print(f"{args.stack} set {seed}: ITL mean {statistics.fmean(gaps):.1f} ms, "
                  f"p50 {gaps[len(gaps) // 2]:.1f}, p90 {gaps[int(len(gaps) * 0.9)]:.1f} "
                  f"({len(gaps)} gaps)", flush=True)
        if args.cpu:
            wall_s = time.perf_counter() - started
            print(f"CPU over the measured sets ({wall_s:.0f} s), % of one core:")
            for name, share in cpu_shares(before, cpu_seconds(), wall_s):
                print(f"  {share:6.1f}  {name}")


if __name__ == "__main__":
    main()
