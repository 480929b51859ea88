"""``baton bench itl``: what loading other requests' KV costs the sequences a decode engine is
already streaming.

One live local cluster per configuration (as ``baton serve`` starts it: SmolLM2, one prefill
and one decode instance), the configuration as shipped (``engine.async_kv_transfers`` on) and
the synchronous baseline (off), one after the other in the same run (``--order`` alternates
them; ``--repeats`` runs each more than once, in ABBA order). In each:

1. **Warm-up.** ``pool`` prompts of ``prompt_tokens`` tokens each are prefilled once, so their
   KV is in the store's host tier. The pool is larger than the decode engine's own KV cache
   (``pool_size``), so by the time a prompt comes round again the decode engine has evicted it
   from its prefix cache and must load it from the host tier.
2. **Idle.** ``streams`` long sampled generations stream from the decode engine; for
   ``idle_s`` seconds nothing else runs. Their inter-token gaps are the idle ITL.
3. **Loaded.** The same streams, while ``load_clients`` clients send the pool's prompts round
   and round, each request generating a fixed ``LOAD_TOKENS`` tokens, one after another (as
   fast as the cluster takes them). For ``loaded_s`` seconds the decode engine loads their KV
   while it steps the streams. Their inter-token gaps are the loaded ITL.

4. **Busy, the control** (run between 2 and 3): the same clients and request shape, cycling
   through ``BUSY_POOL`` prompts that stay in the decode engine's own prefix cache, so the
   decode engine does the same work (long contexts decoding beside the streams) without loading
   anything. On a CPU, decoding beside 3,000-token contexts slows every step far more than
   loading them does: ``ratio_vs_busy`` (loaded p99 / busy p99) is the loads' own cost.

A gap is the time between two consecutive streamed deltas of one stream; it belongs to the
phase both of its ends fall in. Reported per configuration: ITL p50/p99 idle and loaded, their
ratio (loaded p99 / idle p99), the longest gap, the loads (loaded requests whose decode loaded
their prompt from the store), loads per second, the connector's load GB/s (bytes copied / time
copying), and the decode engine's mean batch size under load. A run with fewer than
``MIN_LOADS_PER_S`` loads a second says it was too light. The target: the shipped
configuration's ratio at most ``TARGET_RATIO``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import grpc
import msgspec

from bench.peers_client import reason_kind
from bench.stats import percentile
from cluster.config import ClusterConfig
from cluster.serve import BatonServer
from gateway.client import build_request
from protos.baton.v1 import inference_pb2_grpc as pb_grpc

LOAD_TOKENS = 16
"""Tokens each loaded request asks for (a real decode, not a one-token shortcut; greedy, on a
random prompt, so an early end-of-sequence is rare, and the mean generated is reported)."""
MIN_LOADS_PER_S = 10.0
TARGET_RATIO = 1.1
STREAM_PROMPT_TOKENS = 64
STREAM_MAX_TOKENS = 1024
BUSY_POOL = 3
"""Prompts of the control phase: few enough to stay in the decode engine's own prefix cache."""


class ItlRun(msgspec.Struct):
    async_kv_transfers: bool
    idle_itl_p50_ms: float
    idle_itl_p99_ms: float
    loaded_itl_p50_ms: float
    loaded_itl_p99_ms: float
    ratio: float
    """loaded_itl_p99_ms / idle_itl_p99_ms."""
    idle_max_gap_ms: float
    loaded_max_gap_ms: float
    idle_gaps: int
    loaded_gaps: int
    loads: int
    """Loaded requests in the loaded phase whose decode loaded their prompt's KV from the store."""
    loads_per_s: float
    load_gbps: float
    """Bytes the decode engine's connector copied in / the time it spent copying (10^9 B/s)."""
    loaded_ttft_p50_ms: float
    loaded_tokens_generated_mean: float
    """Tokens the loaded requests generated (LOAD_TOKENS unless one ended on its EOS)."""
    decode_batch_size: float
    """The decode engine's mean number of running sequences, sampled in the loaded phase."""
    busy_itl_p50_ms: float
    busy_itl_p99_ms: float
    ratio_vs_busy: float
    """loaded_itl_p99_ms / busy_itl_p99_ms: the loads' own cost, the same work done either way."""
    busy_requests_per_s: float
    busy_loads: int
    """Requests of the control phase whose decode loaded from the store (its first round)."""
    busy_decode_batch_size: float
    too_light: bool
    loaded_counters: dict[str, int] = {}
    """The decode engine's KV connector over the loaded phase (``ConnectorCounters`` deltas,
    blocks): looked up in the store, hit, loaded, saved, failed to load (recomputed)."""
    loaded_placements: dict[str, int] = {}
    """The loaded phase's requests by where their prefill ran ('co-located' on the decode
    instance, or 'prefill pool') and the kind of the conductor's reason (its first clause, numbers
    as N): whether the decode engine loaded KV a prefill instance handed off, or took the
    request itself."""


class ItlReport(msgspec.Struct):
    model: str
    streams: int
    prompt_tokens: int
    pool: int
    load_clients: int
    idle_s: float
    loaded_s: float
    order: list[str]
    runs: list[ItlRun]
    shipped: dict
    sync: dict
    ok: bool



def pool_size(config: ClusterConfig, prompt_tokens: int) -> int:
    """Prompts enough that the decode engine's own KV cache cannot keep them all: a prompt has
    been evicted (LRU) by the time it comes round again."""
    from cluster.local import kv_block_bytes
    from engine.builder import dtype_bytes, effective_dtype
    from engine.models import prepare_model

    model = prepare_model(config.engine.model)
    per_token = kv_block_bytes(model, 1, dtype_bytes(effective_dtype(config.engine, model)))
    capacity_tokens = config.engine.kv_cache_gib * (1 << 30) / per_token
    return int(capacity_tokens // prompt_tokens) + 6 + BUSY_POOL


class _Gaps:
    """Every stream's delta arrival times, split into the phases' windows afterwards."""

    def __init__(self) -> None:
        self.streams: list[list[float]] = []

    def window(self, start: float, end: float) -> list[float]:
        gaps = []
        for times in self.streams:
            for before, after in itertools.pairwise(times):
                if start <= before and after < end:
                    gaps.append((after - before) * 1000.0)
        return gaps


async def _stream_forever(stub, rng: random.Random, gaps: _Gaps, stop: asyncio.Event) -> None:
    """One long sampled generation after another, recording when each delta arrives."""
    while not stop.is_set():
        prompt = [rng.randrange(100, 30_000) for _ in range(STREAM_PROMPT_TOKENS)]
        request = build_request(token_ids=prompt, max_tokens=STREAM_MAX_TOKENS, temperature=0.8,
                                seed=rng.randrange(1 << 30))
        times: list[float] = []
        gaps.streams.append(times)
        call = stub.Generate(request, timeout=600)
        try:
            async for response in call:
                if response.HasField("delta"):
                    times.append(time.perf_counter())
                if stop.is_set():
                    call.cancel()
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise


class _LoadOutcome(msgspec.Struct):
    sent_at: float
    ttft_ms: float
    loaded_tokens: int
    completion_tokens: int
    placed: str = ""
    """'co-located: <reason kind>' or 'prefill pool: <reason kind>' (``placement_kind``)."""


def placement_kind(prefill: str, decode: str, reason: str) -> str:
    """Where a request's prefill ran (on its decode instance or in the prefill pool) and the kind
    of the conductor's reason (its first clause, numbers replaced by N)."""
    where = "co-located" if prefill and prefill == decode else "prefill pool"
    return f"{where}: {reason_kind(reason)}"


async def _load_forever(stub, prompts: list[list[int]], turn: itertools.count,
                        outcomes: list[_LoadOutcome], stop: asyncio.Event) -> None:
    while not stop.is_set():
        prompt = prompts[next(turn) % len(prompts)]
        sent_at = time.perf_counter()
        request = build_request(token_ids=prompt, max_tokens=LOAD_TOKENS, temperature=0.0)
        final = None
        async for response in stub.Generate(request, timeout=600):
            if response.HasField("final"):
                final = response.final
        if final is not None:
            usage = final.usage
            placement = final.placement
            outcomes.append(_LoadOutcome(sent_at, usage.ttft_ms, usage.loaded_tokens,
                                         usage.completion_tokens, placement_kind(
                                             placement.prefill, placement.decode,
                                             placement.reason)))


async def _decode_counters(server: BatonServer):
    cluster = server.cluster
    return await cluster.actor(cluster.decode_ids[0]).connector_counters.remote()


async def _sample_batch(server: BatonServer, samples: list[int], stop: asyncio.Event) -> None:
    decode = server.cluster.actor(server.cluster.decode_ids[0])
    while not stop.is_set():
        samples.append((await decode.stats.remote()).num_running_reqs)
        await asyncio.sleep(0.25)


async def measure(config: ClusterConfig, streams: int, prompts: list[list[int]],
                  load_clients: int, idle_s: float, loaded_s: float, seed: int,
                  progress: Callable[[str], None]) -> ItlRun:
    label = "async" if config.engine.async_kv_transfers else "sync"
    server = BatonServer(config, progress=lambda m: progress(f"[{label}] {m}"))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            progress(f"[{label}] warm-up: {len(prompts)} prompts of {len(prompts[0])} tokens "
                     "into the host tier")
            for prompt in prompts:
                async for _ in stub.Generate(build_request(token_ids=prompt, max_tokens=1,
                                                           temperature=0.0), timeout=600):
                    pass
            rng = random.Random(seed)
            gaps, stop_streams = _Gaps(), asyncio.Event()
            stream_tasks = [asyncio.create_task(_stream_forever(stub, random.Random(
                rng.randrange(1 << 30)), gaps, stop_streams)) for _ in range(streams)]
            while sum(len(t) >= 8 for t in gaps.streams) < streams:  # every stream decoding
                await asyncio.sleep(0.1)
            idle_start = time.perf_counter()
            await asyncio.sleep(idle_s)
            idle_end = time.perf_counter()

            async def clients(pool: list[list[int]], seconds: float, name: str):
                """``load_clients`` clients cycling through ``pool``; what the window saw."""
                progress(f"[{label}] {name} phase: {load_clients} clients, {len(pool)} prompts")
                outcomes: list[_LoadOutcome] = []
                stop, batch, turn = asyncio.Event(), [], itertools.count()
                tasks = [asyncio.create_task(_load_forever(stub, pool, turn, outcomes, stop))
                         for _ in range(load_clients)]
                await asyncio.sleep(3.0)  # the clients ramp up
                before = await _decode_counters(server)
                start = time.perf_counter()
                sampler = asyncio.create_task(_sample_batch(server, batch, stop))
                await asyncio.sleep(seconds)
                end = time.perf_counter()
                after = await _decode_counters(server)
                stop.set()
                await asyncio.gather(*tasks, sampler, return_exceptions=True)
                return (start, end, [o for o in outcomes if start <= o.sent_at < end], batch,
                        before, after)

            # the control: the same work, its KV in the decode engine's own prefix cache
            resident = prompts[:BUSY_POOL]
            busy_start, busy_end, busy_outcomes, busy_batch, _b, _a = await clients(
                resident, loaded_s, "busy (no loads)")
            loaded_start, loaded_end, in_window, batch, before, after = await clients(
                prompts[BUSY_POOL:], loaded_s, "loaded")
            stop_streams.set()
            for task in stream_tasks:
                task.cancel()
            await asyncio.gather(*stream_tasks, return_exceptions=True)
    finally:
        await server.stop()
    idle, loaded = gaps.window(idle_start, idle_end), gaps.window(loaded_start, loaded_end)
    busy = gaps.window(busy_start, busy_end)
    loads = [o for o in in_window if o.loaded_tokens >= len(prompts[0]) // 2]
    busy_loads = [o for o in busy_outcomes if o.loaded_tokens >= len(prompts[0]) // 2]
    seconds = after.load_seconds - before.load_seconds
    gbps = (after.loaded_bytes - before.loaded_bytes) / seconds / 1e9 if seconds > 0 else 0.0
    idle_p99, loaded_p99 = percentile(idle, 0.99), percentile(loaded, 0.99)
    busy_p99 = percentile(busy, 0.99)
    run = ItlRun(
        async_kv_transfers=config.engine.async_kv_transfers,
        idle_itl_p50_ms=round(percentile(idle, 0.5), 2), idle_itl_p99_ms=round(idle_p99, 2),
        loaded_itl_p50_ms=round(percentile(loaded, 0.5), 2),
        loaded_itl_p99_ms=round(loaded_p99, 2),
        ratio=round(loaded_p99 / idle_p99, 3) if idle_p99 else 0.0,
        idle_max_gap_ms=round(max(idle, default=0.0), 2),
        loaded_max_gap_ms=round(max(loaded, default=0.0), 2),
        idle_gaps=len(idle), loaded_gaps=len(loaded), loads=len(loads),
        loads_per_s=round(len(loads) / loaded_s, 2), load_gbps=round(gbps, 3),
        loaded_ttft_p50_ms=round(percentile([o.ttft_ms for o in in_window], 0.5), 1),
        loaded_tokens_generated_mean=round(statistics.fmean(
            o.completion_tokens for o in in_window), 2) if in_window else 0.0,
        decode_batch_size=round(statistics.fmean(batch), 2) if batch else 0.0,
        busy_itl_p50_ms=round(percentile(busy, 0.5), 2), busy_itl_p99_ms=round(busy_p99, 2),
        ratio_vs_busy=round(loaded_p99 / busy_p99, 3) if busy_p99 else 0.0,
        busy_requests_per_s=round(len(busy_outcomes) / loaded_s, 2),
        busy_loads=len(busy_loads),
        busy_decode_batch_size=round(statistics.fmean(busy_batch), 2) if busy_batch else 0.0,
        too_light=len(loads) / loaded_s < MIN_LOADS_PER_S,
        loaded_counters={name: getattr(after, name) - getattr(before, name) for name in (
            "lookups_blocks", "hits_blocks", "loaded_blocks", "saved_blocks",
            "failed_load_blocks")},
        loaded_placements=dict(collections.Counter(o.placed for o in in_window).most_common()))
    progress(f"[{label}] ITL p99 idle {run.idle_itl_p99_ms:.1f} ms, loaded "
             f"{run.loaded_itl_p99_ms:.1f} ms (x{run.ratio:.2f}; the same work without loads "
             f"{run.busy_itl_p99_ms:.1f} ms: x{run.ratio_vs_busy:.2f}); {run.loads} loads "
             f"({run.loads_per_s:.1f}/s, {run.load_gbps:.2f} GB/s), batch "
             f"{run.decode_batch_size:.1f}" + ("; TOO LIGHT" if run.too_light else ""))
    return run


_SUMMARY_KEYS = ("idle_itl_p50_ms", "idle_itl_p99_ms", "loaded_itl_p50_ms", "loaded_itl_p99_ms",
                 "ratio", "loaded_max_gap_ms", "loads", "loads_per_s", "load_gbps",
                 "loaded_ttft_p50_ms", "decode_batch_size", "busy_itl_p50_ms",
                 "busy_itl_p99_ms", "ratio_vs_busy", "busy_requests_per_s",
                 "busy_decode_batch_size")


def summary(runs: list[ItlRun]) -> dict:
    """The median of each figure over ``runs`` (one run: its figures), and whether any was too
    light."""
    out = {key: round(statistics.median(getattr(r, key) for r in runs), 3)
           for key in _SUMMARY_KEYS}
    out["too_light"] = any(r.too_light for r in runs)
    out["runs"] = len(runs)
    return out


def make_prompts(seed: int, count: int, tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30_000) for _ in range(tokens)] for _ in range(count)]


async def run_itl(config: ClusterConfig, streams: int = 8, prompt_tokens: int = 3000,
                  pool: int | None = None, load_clients: int = 16, idle_s: float = 15.0,
                  loaded_s: float = 30.0, order: str = "async,sync", repeats: int = 1,
                  seed: int = 0, progress: Callable[[str], None] = lambda _m: None) -> ItlReport:
    first = [part.strip() for part in order.split(",") if part.strip()]
    if sorted(first) != ["async", "sync"]:
        raise ValueError(f"--order must name async and sync once each, got {order!r}")
    sequence = list(itertools.islice(itertools.cycle([first, first[::-1]]), repeats))
    labels = [label for pair in sequence for label in pair]
    count = pool if pool is not None else pool_size(config, prompt_tokens)
    prompts = make_prompts(seed, count, prompt_tokens)
    runs: list[ItlRun] = []
    for label in labels:
        engine = config.engine.model_copy(update={"async_kv_transfers": label == "async"})
        runs.append(await measure(config.model_copy(update={"engine": engine}), streams,
                                  prompts, load_clients, idle_s, loaded_s, seed, progress))
    shipped = summary([r for r in runs if r.async_kv_transfers])
    sync = summary([r for r in runs if not r.async_kv_transfers])
    ok = shipped["ratio"] <= TARGET_RATIO and not shipped["too_light"]
    return ItlReport(config.engine.model, streams, prompt_tokens, count, load_clients, idle_s,
                     loaded_s, labels, runs, shipped, sync, ok)


def main(config: ClusterConfig, json_path: Path | None, progress: Callable[[str], None],
         **options) -> ItlReport:
    report = asyncio.run(run_itl(config, progress=progress, **options))
    data = {**report.shipped, "sync": report.sync,
            "ratio_vs_sync_loaded_p99": round(report.shipped["loaded_itl_p99_ms"]
                                              / report.sync["loaded_itl_p99_ms"], 3)
            if report.sync["loaded_itl_p99_ms"] else None,
            "target_ratio": TARGET_RATIO, "ok": report.ok,
            "configuration": {k: v for k, v in msgspec.to_builtins(report).items()
                              if k not in ("runs", "shipped", "sync", "ok")},
            "runs": msgspec.to_builtins(report.runs)}
    print(json.dumps({k: data[k] for k in (*_SUMMARY_KEYS, "ratio_vs_sync_loaded_p99", "ok")}
                     | {"sync": {k: report.sync[k] for k in _SUMMARY_KEYS}}, indent=1))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2) + "\n")
    return report

