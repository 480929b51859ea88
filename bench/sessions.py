"""``baton bench sessions``: what session retention buys agent steps after a tool pause.

One live local cluster per configuration (as ``baton serve`` starts it: SmolLM2, one prefill
and one decode instance), retention off (``sessions.enabled: false``: today's behaviour, the
clients still name their sessions) and on, one after the other in the same run (``--order``
alternates them; ``--repeats`` runs each more than once, in ABBA order). Both see the same
workload, from the same seed:

- ``sessions`` agent sessions, each ``steps`` steps long. Every prompt is one shared trunk (a
  system prompt of ``trunk_tokens``), then the session's history: each step appends the last
  reply and a tool result of 128 to 384 tokens. Between steps the agent waits for its tool: a
  think time drawn from a long-tailed (log-normal) distribution with median ``think_s``.
  Sessions start at staggered times.
- Background traffic that churns the caches: ``noise_clients`` clients sending unique prompts
  of ``noise_tokens`` tokens (one generated token each) at about ``noise_rate`` a second each
  (0: back to back), as the rest of a fleet would.
- The caches under pressure: each engine's own KV cache is ``device_blocks`` blocks (less than
  the sessions' working set, so a paused session's blocks leave the device), and the store
  node's host tier is ``host_factor`` times the sessions' working set (so the background
  traffic evicts a paused session's blocks from host memory unless they are leased). No disk
  tier, as shipped.

Reported per configuration, over the session steps (not the background traffic): the hit
ratio (prompt tokens read from cache / prompt tokens), its ``ceiling`` (the infinite-cache hit
ratio of the same steps in the same order: a step can reuse the blocks of every step that
*finished* before it began, as the live system could, and vLLM always computes a prompt's last
token), TTFT mean and p90 of the steps after a pause, recomputed prompt tokens, and the store's
leased bytes (peak) and lease evictions. Targets: with retention, the hit ratio at least
``TARGET_CEILING_SHARE`` of the ceiling, and the post-pause TTFT p90 at most ``TARGET_TTFT_RATIO``
times the retention-off run's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import grpc
import msgspec

from bench.stats import percentile
from cluster.config import ClusterConfig
from cluster.serve import BatonServer
from engine.config import CPU_KV_BLOCK_TOKENS
from gateway.client import build_request
from kvstore.keys import KeyExtras, block_keys
from protos.baton.v1 import inference_pb2_grpc as pb_grpc

TARGET_CEILING_SHARE = 0.95
TARGET_TTFT_RATIO = 0.5
TOOL_TOKENS = (128, 384)
"""Tokens of each tool result (uniform in this range)."""
MAX_THINK_S = 30.0
"""Longest tool pause drawn (the log-normal's tail is cut here)."""
THINK_SIGMA = 0.8
"""Log-normal shape of the pauses: with median 8 s, p90 ≈ 22 s (cut at ``MAX_THINK_S``)."""
VOCAB = (1000, 40000)
"""Token ids the prompts are drawn from (inside SmolLM2's and the tiny model's vocabularies)."""
BLOCK_TOKENS = CPU_KV_BLOCK_TOKENS
"""The CPU engines' KV block unless configured; a run counts in its config's
(``EngineConfig.kv_block_tokens``)."""


class Step(msgspec.Struct):
    session: int
    index: int
    prompt_tokens: int
    cached_tokens: int
    loaded_tokens: int
    ttft_ms: float
    started_s: float
    finished_s: float
    reply_tokens: int
    ceiling_cached_tokens: int = 0
    prefill: str = ""
    """The instance that computed its prompt (the placement's), and the one that decoded it."""
    decode: str = ""
    priced_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The placement's priced TTFT terms: KV transfer, queue, prefill (ms)."""
    reason: str = ""

    @property
    def prefilled_s(self) -> float:
        """When its prompt's KV existed (its first token came back)."""
        return self.started_s + self.ttft_ms / 1000.0


class SessionsRun(msgspec.Struct):
    retention: bool
    steps: int
    hit_ratio: float
    ceiling: float
    share_of_ceiling: float
    ttft_after_pause_mean_ms: float
    ttft_after_pause_p90_ms: float
    ttft_first_step_mean_ms: float
    recomputed_tokens: int
    prompt_tokens: int
    leased_bytes_peak: int
    lease_evictions: int
    noise_requests: int
    prefetches: int
    wall_s: float
    step_log: list[Step]
    label: str = ""
    """off, on, or for ``--prefetch``: disk+prefetch, disk-no-prefetch."""



class Workload(msgspec.Struct, frozen=True):
    """Everything random about a run, drawn once from the seed: both configurations replay it."""

    trunk: list[int]
    tools: list[list[list[int]]]
    """Per session, per step after the first, the tool result appended."""
    thinks: list[list[float]]
    """Per session, the pause before each step after the first (s)."""
    starts: list[float]
    """Per session, when its first step is sent (s after the run starts)."""
    max_tokens: int


def make_workload(seed: int, sessions: int, steps: int, trunk_tokens: int, think_s: float,
                  max_tokens: int) -> Workload:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    trunk = tokens(trunk_tokens)
    tools = [[tokens(rng.randint(*TOOL_TOKENS)) for _ in range(steps)] for _ in range(sessions)]
    thinks = [[min(MAX_THINK_S, rng.lognormvariate(math.log(think_s), THINK_SIGMA))
               for _ in range(steps - 1)] for _ in range(sessions)]
    starts = [rng.uniform(0.0, think_s) for _ in range(sessions)]
    return Workload(trunk, tools, thinks, starts, max_tokens)


def working_set_tokens(workload: Workload) -> int:
    """Tokens of KV the sessions hold at their ends, the trunk counted once (what a cache must
    keep for every step to hit)."""
    total = len(workload.trunk)
    for tools in workload.tools:
        total += sum(len(t) for t in tools) + workload.max_tokens * len(tools)
    return total


def ceiling_tokens(steps: list[Step], prompts: dict[tuple[int, int], list[int]],
                   replies: dict[tuple[int, int], list[int]], block_tokens: int = BLOCK_TOKENS) -> None:
    """Fill each step's ``ceiling_cached_tokens``: the leading full blocks of its prompt that an
    infinite cache would hold for it, and at most all but the prompt's last token (vLLM computes
    it). A block exists once computed: an earlier step's prompt blocks once its prefill was
    done, before this step's own prefill was (a step that arrives while they are computed can
    wait for them, as the conductor's coalescing does), and its reply's blocks once it
    finished, before this step began. ``block_tokens``: the engines' KV block."""
    extras = KeyExtras("bench")
    prompt_keys = {key: block_keys(prompts[key], block_tokens, extras) for key in prompts}
    reply_keys = {key: block_keys(prompts[key] + replies[key], block_tokens, extras)
                  for key in prompts}
    for step in steps:
        me = (step.session, step.index)
        known: set[bytes] = set()
        for earlier in steps:
            key = (earlier.session, earlier.index)
            if key == me:
                continue
            if earlier.finished_s <= step.started_s:
                known.update(reply_keys[key])
            elif earlier.prefilled_s <= step.prefilled_s and earlier.started_s <= step.started_s:
                known.update(prompt_keys[key])
        hit = 0
        for k in prompt_keys[me]:
            if k not in known:
                break
            hit += 1
        step.ceiling_cached_tokens = min(hit * block_tokens,
                                         (step.prompt_tokens - 1) // block_tokens * block_tokens)


async def _one_step(stub, session: int, index: int, prompt: list[int], max_tokens: int,
                    t0: float) -> tuple[Step, list[int]]:
    request = build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0)
    request.session_id = f"agent-{session}"
    sent = time.perf_counter()
    first = None
    reply: list[int] = []
    usage = None
    async for response in stub.Generate(request, timeout=600):
        if response.HasField("delta"):
            if first is None and response.delta.token_ids:
                first = time.perf_counter()
            reply.extend(response.delta.token_ids)
        else:
            usage = response.final.usage
            placement = response.final.placement
    done = time.perf_counter()
    return Step(session, index, len(prompt), usage.cached_tokens, usage.loaded_tokens,
                ((first or done) - sent) * 1000.0, sent - t0, done - t0, len(reply),
                prefill=placement.prefill, decode=placement.decode,
                priced_ms=(round(placement.transfer_ms, 1), round(placement.queue_ms, 1),
                           round(placement.prefill_ms, 1)),
                reason=placement.reason), reply


async def _session(stub, workload: Workload, session: int, t0: float, steps: list[Step],
                   prompts: dict, replies: dict) -> None:
    await asyncio.sleep(workload.starts[session])
    prompt = list(workload.trunk) + workload.tools[session][0]
    for index in range(len(workload.thinks[session]) + 1):
        step, reply = await _one_step(stub, session, index, prompt, workload.max_tokens, t0)
        steps.append(step)
        prompts[(session, index)] = prompt
        replies[(session, index)] = reply
        if index == len(workload.thinks[session]):
            return
        await asyncio.sleep(workload.thinks[session][index])
        prompt = prompt + reply + workload.tools[session][index + 1]


async def _noise(stub, rng: random.Random, tokens: int, rate: float, stop: asyncio.Event,
                 count: list[int]) -> None:
    """Unique prompts, one at a time: back to back (``rate`` 0), else at about ``rate`` a second
    (exponential gaps), so the caches churn without the background work taking every core."""
    while not stop.is_set():
        sent = time.perf_counter()
        prompt = [rng.randrange(*VOCAB) for _ in range(tokens)]
        async for _ in stub.Generate(build_request(token_ids=prompt, max_tokens=1,
                                                   temperature=0.0), timeout=600):
            pass
        count[0] += 1
        if rate > 0:
            gap = rng.expovariate(rate) - (time.perf_counter() - sent)
            if gap > 0:
                try:
                    await asyncio.wait_for(stop.wait(), gap)
                except asyncio.TimeoutError:
                    pass


async def _lease_sampler(server: BatonServer, peak: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            stats = await server.cluster.store.lease_stats.remote()
            peak[0] = max(peak[0], stats.leased_bytes)
        except Exception:  # noqa: BLE001 - a sample missed is a sample missed
            pass
        await asyncio.sleep(0.5)


async def measure(config: ClusterConfig, workload: Workload, noise_clients: int,
                  noise_tokens: int, noise_rate: float, seed: int,
                  progress: Callable[[str], None], label: str = "") -> SessionsRun:
    retention = config.sessions.enabled
    label = label or ("on" if retention else "off")
    server = BatonServer(config, progress=lambda m: progress(f"[{label}] {m}"))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            steps: list[Step] = []
            prompts: dict = {}
            replies: dict = {}
            stop = asyncio.Event()
            noise_count = [0]
            peak = [0]
            rng = random.Random(seed + 1)
            helpers = [asyncio.create_task(_noise(stub, random.Random(rng.randrange(1 << 30)),
                                                  noise_tokens, noise_rate, stop, noise_count))
                       for _ in range(noise_clients)]
            helpers.append(asyncio.create_task(_lease_sampler(server, peak, stop)))
            progress(f"[{label}] {len(workload.tools)} sessions of {len(workload.thinks[0]) + 1} "
                     f"steps, {noise_clients} background clients")
            t0 = time.perf_counter()
            await asyncio.gather(*(_session(stub, workload, s, t0, steps, prompts, replies)
                                   for s in range(len(workload.tools))))
            wall = time.perf_counter() - t0
            stop.set()
            await asyncio.gather(*helpers, return_exceptions=True)
            lease = await server.cluster.store.lease_stats.remote()
            sessions = await server.cluster.conductor.session_counters.remote()
    finally:
        await server.stop()
    ceiling_tokens(steps, prompts, replies, config.engine.kv_block_tokens)
    prompt_total = sum(s.prompt_tokens for s in steps)
    cached = sum(s.cached_tokens for s in steps)
    ceiling = sum(s.ceiling_cached_tokens for s in steps) / prompt_total
    hit = cached / prompt_total
    after = [s.ttft_ms for s in steps if s.index > 0]
    first = [s.ttft_ms for s in steps if s.index == 0]
    run = SessionsRun(
        retention=retention, steps=len(steps), hit_ratio=round(hit, 4), ceiling=round(ceiling, 4),
        share_of_ceiling=round(hit / ceiling, 4) if ceiling else 0.0,
        ttft_after_pause_mean_ms=round(statistics.fmean(after), 1) if after else 0.0,
        ttft_after_pause_p90_ms=round(percentile(after, 0.9), 1),
        ttft_first_step_mean_ms=round(statistics.fmean(first), 1) if first else 0.0,
        recomputed_tokens=prompt_total - cached, prompt_tokens=prompt_total,
        leased_bytes_peak=max(peak[0], lease.leased_bytes), lease_evictions=lease.lease_evictions,
        noise_requests=noise_count[0], prefetches=sessions.prefetches, wall_s=round(wall, 1),
        step_log=sorted(steps, key=lambda s: s.started_s), label=label)
    progress(f"[{label}] hit ratio {run.hit_ratio:.3f} of ceiling {run.ceiling:.3f}; TTFT after a "
             f"pause mean {run.ttft_after_pause_mean_ms:.0f} ms, p90 {run.ttft_after_pause_p90_ms:.0f} ms")
    return run


_SUMMARY_KEYS = ("hit_ratio", "ceiling", "share_of_ceiling", "ttft_after_pause_mean_ms",
                 "ttft_after_pause_p90_ms", "ttft_first_step_mean_ms", "recomputed_tokens",
                 "leased_bytes_peak", "lease_evictions", "noise_requests", "prefetches")


def summary(runs: list[SessionsRun]) -> dict:
    """The mean of each figure over a configuration's runs."""
    out = {}
    for key in _SUMMARY_KEYS:
        values = [getattr(r, key) for r in runs]
        out[key] = round(statistics.fmean(values), 4) if values else 0.0
    return out


def bench_config(config: ClusterConfig, workload: Workload, device_blocks: int,
                 host_factor: float) -> ClusterConfig:
    """The cluster as shipped, with the caches sized to be under pressure (see the module)."""
    from cluster.local import kv_block_bytes
    from engine.builder import dtype_bytes, effective_dtype
    from engine.models import prepare_model

    model = prepare_model(config.engine.model)
    per_token = kv_block_bytes(model, 1, dtype_bytes(effective_dtype(config.engine, model)))
    working = working_set_tokens(workload)
    host = max(1 << 20, int(host_factor * working * per_token))
    longest = max(len(workload.trunk) + sum(len(t) for t in tools)
                  + workload.max_tokens * len(tools) for tools in workload.tools)
    block = config.engine.kv_block_tokens
    max_len = -(-(longest + workload.max_tokens + block) // block) * block
    engine = config.engine.model_copy(update={
        "num_kv_blocks": max(device_blocks, max_len // block + 1),
        "max_model_len_tokens": max_len})
    kv = {"host_capacity_bytes": host, "lease_max_bytes": host, "lease_max_bytes_per_tenant": host}
    return config.model_copy(update={"engine": engine,
                                     "kvstore": config.kvstore.model_copy(update=kv)})


async def run_sessions(config: ClusterConfig, sessions: int = 6, steps: int = 6,
                       trunk_tokens: int = 1024, think_s: float = 8.0, max_tokens: int = 32,
                       noise_clients: int = 1, noise_tokens: int = 512, noise_rate: float = 1.0,
                       device_blocks: int = 192,
                       host_factor: float = 1.0, order: str = "off,on", repeats: int = 1,
                       seed: int = 0, prefetch: bool = False,
                       progress: Callable[[str], None] = lambda _m: None) -> dict:
    first = [part.strip() for part in order.split(",") if part.strip()]
    if sorted(first) != ["off", "on"]:
        raise ValueError(f"--order must name off and on once each, got {order!r}")
    workload = make_workload(seed, sessions, steps, trunk_tokens, think_s, max_tokens)
    base = bench_config(config, workload, device_blocks, host_factor)
    sequence = list(itertools.islice(itertools.cycle([first, first[::-1]]), repeats))
    labels = [label for pair in sequence for label in pair]
    runs: list[SessionsRun] = []
    for label in labels:
        sessions_config = base.sessions.model_copy(update={"enabled": label == "on"})
        runs.append(await measure(base.model_copy(update={"sessions": sessions_config}), workload,
                                  noise_clients, noise_tokens, noise_rate, seed, progress))
    prefetch_report = None
    if prefetch:
        prefetch_report = await _prefetch_pair(base, workload, noise_clients, noise_tokens,
                                               noise_rate, seed, progress, runs)
    off = summary([r for r in runs if r.label == "off"])
    on = summary([r for r in runs if r.label == "on"])
    ttft_ratio = (on["ttft_after_pause_p90_ms"] / off["ttft_after_pause_p90_ms"]
                  if off["ttft_after_pause_p90_ms"] else None)
    ok = (on["share_of_ceiling"] >= TARGET_CEILING_SHARE and ttft_ratio is not None
          and ttft_ratio <= TARGET_TTFT_RATIO)
    return {
        "ceiling": on["ceiling"], "off": off, "on": on,
        "ttft_after_pause_p90_ratio": round(ttft_ratio, 3) if ttft_ratio is not None else None,
        "targets": {"share_of_ceiling": TARGET_CEILING_SHARE, "ttft_p90_ratio": TARGET_TTFT_RATIO},
        "ok": ok,
        "prefetch": prefetch_report,
        "configuration": {
            "model": base.engine.model, "sessions": sessions, "steps": steps,
            "trunk_tokens": trunk_tokens, "think_median_s": think_s, "think_sigma": THINK_SIGMA,
            "max_tokens": max_tokens, "noise_clients": noise_clients,
            "noise_tokens": noise_tokens, "noise_rate_per_s": noise_rate, "device_blocks": base.engine.num_kv_blocks,
            "host_capacity_bytes": base.kvstore.host_capacity_bytes,
            "working_set_tokens": working_set_tokens(workload), "order": labels, "seed": seed},
        "runs": msgspec.to_builtins(runs),
    }


async def _prefetch_pair(base: ClusterConfig, workload: Workload, noise_clients: int,
                         noise_tokens: int, noise_rate: float, seed: int,
                         progress: Callable[[str], None], runs: list[SessionsRun]) -> dict:
    """What the prefetch saves: retention on with a disk tier and a host tier of half the
    sessions' working set (so leased blocks are demoted to disk during their pauses), with the
    conductor's session prefetch on and off."""
    import tempfile

    half = max(1 << 20, base.kvstore.host_capacity_bytes // 2)
    results = {}
    for label, enabled in (("disk+prefetch", True), ("disk-no-prefetch", False)):
        with tempfile.TemporaryDirectory(prefix="baton-sessions-disk-") as disk:
            kv = base.kvstore.model_copy(update={
                "host_capacity_bytes": half, "disk_dir": disk,
                "lease_max_bytes": base.kvstore.host_capacity_bytes,
                "lease_max_bytes_per_tenant": base.kvstore.host_capacity_bytes})
            conductor = base.conductor.model_copy(update={"session_prefetch": enabled})
            sessions_config = base.sessions.model_copy(update={"enabled": True})
            run = await measure(base.model_copy(update={"kvstore": kv, "conductor": conductor,
                                                        "sessions": sessions_config}),
                                workload, noise_clients, noise_tokens, noise_rate, seed, progress,
                                label)
        runs.append(run)
        results[label] = summary([run])
    with_, without = results["disk+prefetch"], results["disk-no-prefetch"]
    return {**results, "host_capacity_bytes": half,
            "saved_ttft_after_pause_mean_ms": round(without["ttft_after_pause_mean_ms"]
                                                    - with_["ttft_after_pause_mean_ms"], 1),
            "saved_ttft_after_pause_p90_ms": round(without["ttft_after_pause_p90_ms"]
                                                   - with_["ttft_after_pause_p90_ms"], 1)}


class SessionsReport(msgspec.Struct):
    ok: bool
    data: dict


def main(config: ClusterConfig, json_path: Path | None, progress: Callable[[str], None],
         **options) -> SessionsReport:
    data = asyncio.run(run_sessions(config, progress=progress, **options))
    print(json.dumps({k: data[k] for k in ("ceiling", "off", "on", "ttft_after_pause_p90_ratio",
                                           "prefetch", "ok")}, indent=1))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2) + "\n")
    return SessionsReport(data["ok"], data)
