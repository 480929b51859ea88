"""``baton bench serve``: replay a Mooncake-format trace against a live gateway and measure it as
``vllm bench serve`` does.

A trace has no text, only one ``hash_id`` per 512-token prompt block, and an id names its block and
everything before it. Each id is expanded into a fixed pseudo-random run of token ids seeded by the
id (``block_token_ids``), so requests sharing leading ids send identical token prefixes and a
prefix cache can reuse them; ``token_scale`` shrinks the 512 tokens of a block (16: 32 tokens per
id) so a CPU engine can serve the trace. Requests are sent over gRPC at the trace's arrival times
times ``time_scale``; every token delta's arrival is timestamped on the stream.

Metrics (``compute_metrics``) follow vLLM's ``benchmarks/serve.py`` and keep its result names:
TTFT is the first delta's arrival less the send time, E2EL the last delta's, ITL every gap
between consecutive deltas, TPOT ``(E2EL - TTFT) / (output tokens - 1)`` for requests with more
than one output token (0 for goodput otherwise), goodput the completed requests meeting every
given SLO per second of benchmark duration. Baton adds the measured prefix-cache hit ratio
(``cached_tokens / prompt_tokens`` from each request's usage) and the failures by gRPC status.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import grpc
import msgspec
import numpy as np

from gateway.client import build_request
from protos.baton.v1 import inference_pb2_grpc as pb_grpc
from protos.errors import BatonError
from simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest, ceiling_hit_ratio, load_trace

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
"""SLO names ``--goodput`` accepts, as vLLM's benchmark does (values in ms)."""


class BenchServeError(BatonError):
    """A bad option or an unreachable target; the message says what to change."""


class ExpansionOptions(msgspec.Struct, frozen=True):
    """How trace records become requests."""

    token_scale: int = 16
    """Divides the trace's 512 tokens per hash id (16: 32 tokens per id) and its prompt lengths."""
    time_scale: float = 1.0
    """Multiplies arrival times: 0.5 sends the trace at twice its rate."""
    output_scale: float = 1.0
    """Divides the trace's output lengths (rounded up)."""
    min_output_tokens: int = 1
    """Least tokens asked of any request, after scaling."""
    max_output_tokens: int | None = 128
    """Most tokens asked of any request, after scaling; None: no cap."""
    max_input_tokens: int | None = None
    """Prompts longer than this (after scaling) are cut to it, keeping their prefix; None: no cap."""
    seed: int = 0
    """Mixed into every block's seed: another seed gives other token ids, same sharing."""
    vocab_low: int = 1_000
    """Token ids are drawn from [vocab_low, vocab_high): clear of special tokens."""
    vocab_high: int = 32_000


class TraceCall(msgspec.Struct, frozen=True):
    """One request to send."""

    index: int
    """Position in the trace (after sorting by arrival)."""
    arrival_s: float
    """Send time from the start of the run (s), already scaled."""
    token_ids: tuple[int, ...]
    max_tokens: int


def tokens_per_block(token_scale: int) -> int:
    if token_scale < 1 or TRACE_BLOCK_TOKENS % token_scale:
        raise BenchServeError(f"--token-scale {token_scale} must divide {TRACE_BLOCK_TOKENS} "
                              "(1, 2, 4, ..., 512)")
    return TRACE_BLOCK_TOKENS // token_scale


def block_token_ids(hash_id: int, num_tokens: int, options: ExpansionOptions) -> list[int]:
    """The token ids of one trace block: a function of the id, the seed and the vocabulary only.
    Seeding with a string hashes it with SHA-512, so the run is the same in every process."""
    rng = random.Random(f"baton-trace:{options.seed}:{hash_id}")
    return [rng.randrange(options.vocab_low, options.vocab_high) for _ in range(num_tokens)]


def expand(requests: Sequence[TraceRequest], options: ExpansionOptions) -> list[TraceCall]:
    """Requests with prompts and send times; ``requests`` in arrival order (as ``load_trace``
    gives them). The prompt is the blocks of its ids in order, cut to
    ``ceil(input_length / token_scale)`` tokens (the last block is partial in the trace too)."""
    if not 0 <= options.vocab_low < options.vocab_high:
        raise BenchServeError("the token id range [vocab_low, vocab_high) is empty")
    if options.time_scale <= 0 or options.output_scale <= 0:
        raise BenchServeError("--time-scale and --output-scale must be positive")
    per_block = tokens_per_block(options.token_scale)
    blocks: dict[int, list[int]] = {}
    calls: list[TraceCall] = []
    for index, request in enumerate(requests):
        num_tokens = math.ceil(request.input_length / options.token_scale)
        if options.max_input_tokens is not None:
            num_tokens = min(num_tokens, options.max_input_tokens)
        token_ids: list[int] = []
        for hash_id in request.hash_ids:
            if len(token_ids) >= num_tokens:
                break
            if hash_id not in blocks:
                blocks[hash_id] = block_token_ids(hash_id, per_block, options)
            token_ids.extend(blocks[hash_id])
        max_tokens = max(options.min_output_tokens,
                         math.ceil(request.output_length / options.output_scale))
        if options.max_output_tokens is not None:
            max_tokens = min(max_tokens, options.max_output_tokens)
        calls.append(TraceCall(index, request.timestamp / 1000.0 * options.time_scale,
                               tuple(token_ids[:num_tokens]), max(1, max_tokens)))
    return calls


def select_requests(requests: Sequence[TraceRequest], max_requests: int | None = None,
                    top_sessions: int | None = None) -> list[TraceRequest]:
    """The slice to replay, in arrival order, re-timed to start at 0.

    ``top_sessions`` keeps only the requests whose first hash id is one of the K most frequent
    first ids (ties: the earlier first appearance): an agent session's requests share that root,
    and the published trace's reuse is within sessions spread over its whole length, so a short
    prefix of it barely reuses anything. ``max_requests`` then takes the first N.
    """
    chosen = list(requests)
    if top_sessions is not None:
        if top_sessions < 1:
            raise BenchServeError("--top-sessions must be at least 1")
        counts = Counter(r.hash_ids[0] for r in chosen)  # insertion order = first appearance
        roots = {root for root, _ in counts.most_common(top_sessions)}
        chosen = [r for r in chosen if r.hash_ids[0] in roots]
    if max_requests is not None:
        if max_requests < 1:
            raise BenchServeError("--max-requests must be at least 1")
        chosen = chosen[:max_requests]
    start_ms = chosen[0].timestamp
    return [msgspec.structs.replace(r, timestamp=r.timestamp - start_ms) for r in chosen]


# --------------------------------------------------------------------------------- measuring


class RequestRecord(msgspec.Struct):
    """What the client saw of one request (``time.perf_counter`` seconds)."""

    index: int
    sent_s: float
    delta_times_s: list[float] = msgspec.field(default_factory=list)
    """Arrival of every token delta on the stream."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_instance: str = ""
    decode_instance: str = ""
    error: str = ""
    """gRPC status name and details; empty when the request succeeded."""

    @property
    def success(self) -> bool:
        return not self.error


def _stats(name: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    """vLLM's summary of one metric, in ms (0 for an empty list, as ``np.mean(values or 0)``)."""
    values = values_s or [0.0]
    out = {
        f"mean_{name}_ms": float(np.mean(values)) * 1000,
        f"median_{name}_ms": float(np.median(values)) * 1000,
        f"std_{name}_ms": float(np.std(values)) * 1000,
    }
    for p in percentiles:
        p_word = str(int(p)) if int(p) == p else str(p)
        out[f"p{p_word}_{name}_ms"] = float(np.percentile(values, p)) * 1000
    return out


def compute_metrics(records: Iterable[RequestRecord], duration_s: float,
                    percentiles: Sequence[float] = (99.0,),
                    goodput_slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """The benchmark's result under vLLM's names, plus ``prompt_tokens``, ``cached_tokens``,
    ``hit_ratio``, ``colocated`` (requests prefilled on their decode instance) and ``errors``
    (failed requests by gRPC status)."""
    ttfts: list[float] = []
    e2els: list[float] = []
    itls: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    completed = failed = total_output = prompt_tokens = cached_tokens = colocated = 0
    errors: Counter[str] = Counter()
    for record in records:
        if not record.success:
            failed += 1
            errors[record.error.split(":", 1)[0]] += 1
            continue
        times = record.delta_times_s
        ttft, latency = times[0] - record.sent_s, times[-1] - record.sent_s
        output_len = record.completion_tokens
        tpot = 0.0
        if output_len > 1:
            tpot = (latency - ttft) / (output_len - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(b - a for a, b in zip(times, times[1:]))
        ttfts.append(ttft)
        e2els.append(latency)
        completed += 1
        total_output += output_len
        prompt_tokens += record.prompt_tokens
        cached_tokens += record.cached_tokens
        colocated += record.prefill_instance == record.decode_instance != ""
    good = None
    if goodput_slos_ms:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        checks = [(per_request[k], v / 1000.0) for k, v in goodput_slos_ms.items()]
        good = sum(all(values[i] <= slo for values, slo in checks) for i in range(completed))
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": failed,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (prompt_tokens + total_output) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats(name, values, percentiles))
    result.update(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                  hit_ratio=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
                  colocated=colocated, errors=dict(sorted(errors.items())))
    return result


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:100"]`` (also comma-separated) → ``{"ttft": 2000.0, "tpot": 100.0}``."""
    slos: dict[str, float] = {}
    for item in (part for raw in items for part in raw.replace(",", " ").split()):
        key, _, value = item.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            raise BenchServeError(f"--goodput expects KEY:MS, got '{item}'") from None
        if key not in GOODPUT_METRICS or slos[key] < 0:
            raise BenchServeError(f"--goodput '{item}': KEY is one of {', '.join(GOODPUT_METRICS)} "
                                  "and MS a non-negative number of milliseconds")
    return slos


# --------------------------------------------------------------------------------- sending


async def _send(stub: pb_grpc.InferenceStub, call: TraceCall, metadata, timeout_s: float,
                cache_salt: str) -> RequestRecord:
    request = build_request(token_ids=call.token_ids, max_tokens=call.max_tokens,
                            cache_salt=cache_salt, request_id=f"trace-{call.index}")
    record = RequestRecord(call.index, time.perf_counter())
    final = None
    try:
        async for response in stub.Generate(request, timeout=timeout_s, metadata=metadata):
            if response.HasField("final"):
                final = response.final
            elif response.delta.token_ids:
                record.delta_times_s.append(time.perf_counter())
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details() or ''}"
        return record
    if final is None or not record.delta_times_s:
        record.error = "INTERNAL: the stream ended without " + (
            "a final message" if final is None else "any token")
        return record
    usage = final.usage
    record.prompt_tokens, record.cached_tokens = usage.prompt_tokens, usage.cached_tokens
    record.completion_tokens = usage.completion_tokens
    record.prefill_instance, record.decode_instance = final.placement.prefill, final.placement.decode
    return record


async def wait_serving(target: str, timeout_s: float) -> None:
    """Return once the gateway's health service says SERVING; ``BenchServeError`` after
    ``timeout_s``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise BenchServeError(f"{target} is not serving after {timeout_s:.0f} s; "
                                      "start it with `baton serve` or check --target")
            await asyncio.sleep(0.5)


async def send_trace(target: str, calls: Sequence[TraceCall], max_concurrency: int | None = None,
                     timeout_s: float = 600.0, cache_salt: str = "", api_key: str = "",
                     progress: Callable[[str], None] = lambda _m: None) -> tuple[list[RequestRecord], float]:
    """Send ``calls`` at their arrival times over one channel; return every record and the
    benchmark duration (first send to last answer, s)."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(call: TraceCall) -> RequestRecord:
        if limit is None:
            return await _send(stub, call, metadata, timeout_s, cache_salt)
        async with limit:
            return await _send(stub, call, metadata, timeout_s, cache_salt)

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        start = time.perf_counter()
        tasks = []
        for call in calls:
            delay = start + call.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(call)))
        progress(f"sent {len(tasks)} requests in {time.perf_counter() - start:.1f} s; waiting")
        records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - start


async def bench_serve(trace: Path, target: str, options: ExpansionOptions,
                      max_requests: int | None = None, max_concurrency: int | None = None,
                      top_sessions: int | None = None, goodput_slos_ms: dict[str, float] | None = None,
                      percentiles: Sequence[float] = (99.0,), timeout_s: float = 600.0,
                      cache_salt: str = "", api_key: str = "", wait_ready_s: float = 60.0,
                      progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Load, select (``select_requests``), expand and send a trace; the report ``compute_metrics``
    gives plus ``config`` (what was run)."""
    requests = select_requests(load_trace(trace), max_requests, top_sessions)
    calls = expand(requests, options)
    await wait_serving(target, wait_ready_s)
    progress(f"replaying {len(calls)} requests over {calls[-1].arrival_s:.1f} s against {target}")
    records, duration_s = await send_trace(target, calls, max_concurrency, timeout_s, cache_salt,
                                           api_key, progress)
    report = compute_metrics(records, duration_s, percentiles, goodput_slos_ms)
    report["config"] = {
        "trace": str(trace), "target": target, "num_requests": len(calls),
        "max_requests": max_requests, "top_sessions": top_sessions, "max_concurrency": max_concurrency,
        "trace_hit_ceiling": ceiling_hit_ratio(requests),
        "goodput_slos_ms": goodput_slos_ms or {}, "percentiles": list(percentiles),
        "tokens_per_hash_id": tokens_per_block(options.token_scale),
        "sent_prompt_tokens": sum(len(c.token_ids) for c in calls),
        "requested_output_tokens": sum(c.max_tokens for c in calls),
        **msgspec.structs.asdict(options),
    }
    return report


def format_report(report: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The report as ``vllm bench serve`` prints it, plus Baton's cache lines."""
    lines = [f"{title:=^50}"]

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        lines.append(f"{label:<40} {value:{fmt}}" if value is not None else f"{label:<40} n/a")

    row("Successful requests:", report["completed"], "d")
    row("Failed requests:", report["failed"], "d")
    row("Benchmark duration (s):", report["duration"])
    row("Total input tokens:", report["total_input_tokens"], "d")
    row("Total generated tokens:", report["total_output_tokens"], "d")
    row("Request throughput (req/s):", report["request_throughput"])
    if report["request_goodput"] is not None:
        row("Request goodput (req/s):", report["request_goodput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    row("Prefix cache hit ratio (cached/prompt):", report["hit_ratio"], ".3f")
    for name, header in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                         ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{header:-^50}")
        for key, value in report.items():
            if key.endswith(f"_{name}_ms") and not key.startswith("std_"):
                stat = key.split("_", 1)[0]
                label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
                row(f"{label} {name.upper()} (ms):", value)
    if report["errors"]:
        lines.append(f"errors: {report['errors']}")
    lines.append("=" * 50)
    return "\n".join(lines)


def serve_command(trace: Path, target: str, options: ExpansionOptions, max_requests: int | None,
                  top_sessions: int | None, max_concurrency: int | None, goodput: Sequence[str], percentiles: str,
                  timeout_s: float, cache_salt: str, api_key: str, json_path: Path | None,
                  echo: Callable[[str], None]) -> dict[str, Any]:
    """What ``baton bench serve`` does once its options are parsed: run, print, write the JSON.
    Raises ``BatonError`` (``BenchServeError``, ``TraceError``) for anything the user can fix."""
    import json

    try:
        selected = [float(p) for p in percentiles.replace(",", " ").split()]
    except ValueError:
        raise BenchServeError(f"--percentiles expects numbers like '50,90,99', got '{percentiles}'") from None
    report = asyncio.run(bench_serve(
        trace, target, options, max_requests, max_concurrency, top_sessions, parse_goodput(goodput), selected,
        timeout_s, cache_salt, api_key, progress=echo))
    print(format_report(report))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        echo(f"wrote {json_path}")
    return report
