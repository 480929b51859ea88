"""Send a ``bench.peers_workloads`` workload to an OpenAI-compatible server and summarise it.

Requests are streaming ``/v1/completions`` (temperature 0, ``ignore_eos`` so every stack
generates the same number of tokens, usage on the last chunk). Each agent runs its script: a
step is sent after the previous step's answers and its think time; a fan-out step's siblings
go together. Every chunk carrying text is timestamped (``time.perf_counter``).

Metrics reuse ``bench.serve.compute_metrics`` (``vllm bench serve``'s names and meanings), plus
the hit ratio against the workload's ceiling, the fan-out siblings' TTFT and, where the stack is
Baton, its placement reasons.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec
import numpy as np

from bench.peers_workloads import AgentScript, PeerRequest, Workload
from bench.serve import RequestRecord, compute_metrics


class PeerRecord(msgspec.Struct):
    """What the client saw of one request."""

    request_id: str
    agent: int
    step: int
    fanout_index: int
    sent_s: float
    delta_times_s: list[float] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = -1
    """-1: the stack's usage carried no ``prompt_tokens_details``."""
    completion_tokens: int = 0
    placement: dict = msgspec.field(default_factory=dict)
    """Baton's ``baton.placement`` of the final chunk (empty elsewhere)."""
    loaded_tokens: int = 0
    error: str = ""


async def send_one(client: httpx.AsyncClient, url: str, model: str, request: PeerRequest,
                   timeout_s: float) -> PeerRecord:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    record = PeerRecord(request.request_id, request.agent, request.step, request.fanout_index,
                        time.perf_counter())
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error']}"
                    return record
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    record.delta_times_s.append(time.perf_counter())
                if chunk.get("baton"):
                    record.placement = chunk["baton"].get("placement") or {}
                    record.loaded_tokens = chunk["baton"].get("loaded_tokens") or 0
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens", 0)
                    record.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details")
                    if details is not None:
                        record.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    if not record.delta_times_s:
        record.error = record.error or "no token arrived"
    return record


async def run_workload(base_url: str, model: str, workload: Workload,
                       timeout_s: float = 600.0) -> tuple[list[PeerRecord], float]:
    """Run every agent's script against ``base_url`` (``http://host:port``); return the
    records and the duration (first release to last answer, s)."""
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        start = time.perf_counter()

        async def agent(script: AgentScript) -> list[PeerRecord]:
            out: list[PeerRecord] = []
            await asyncio.sleep(max(0.0, start + script.start_s - time.perf_counter()))
            for step in script.steps:
                await asyncio.sleep(step.think_s)
                out += await asyncio.gather(*(send_one(client, url, model, r, timeout_s)
                                              for r in step.requests))
            return out

        per_agent = await asyncio.gather(*(agent(a) for a in workload.agents))
        return [r for records in per_agent for r in records], time.perf_counter() - start


def summarise(records: Sequence[PeerRecord], duration_s: float, ceiling_hit_ratio: float,
              percentiles: Sequence[float] = (50.0, 90.0, 99.0)) -> dict[str, Any]:
    """``compute_metrics``' report plus ``hit_ratio_vs_ceiling``, ``reports_cached_tokens``,
    ``fanout`` (the siblings' TTFT), ``by_step`` (``step_stats``) and ``placement_reasons``
    (counts; Baton only)."""
    as_serve = [RequestRecord(i, r.sent_s, r.delta_times_s, r.prompt_tokens,
                              max(0, r.cached_tokens), r.completion_tokens,
                              r.placement.get("prefill", ""), r.placement.get("decode", ""),
                              r.error)
                for i, r in enumerate(records)]
    report = compute_metrics(as_serve, duration_s, percentiles)
    ok = [r for r in records if not r.error]
    report["reports_cached_tokens"] = bool(ok) and all(r.cached_tokens >= 0 for r in ok)
    report["ceiling_hit_ratio"] = ceiling_hit_ratio
    report["hit_ratio_vs_ceiling"] = (report["hit_ratio"] / ceiling_hit_ratio
                                      if ceiling_hit_ratio and report["reports_cached_tokens"] else None)
    report["fanout"] = fanout_stats(ok)
    report["by_step"] = step_stats(ok)
    report["placement_reasons"] = dict(Counter(reason_kind(r.placement.get("reason", ""))
                                               for r in ok if r.placement).most_common())
    report["first_error"] = next((r.error for r in records if r.error), "")
    return report


def reason_kind(reason: str) -> str:
    """A placement reason's first clause with its numbers replaced by N: the decision's kind
    (``colocated: no prefill pool``, ``colocated: uncached suffix N tokens < ...``)."""
    return re.sub(r"\d+(\.\d+)?", "N", reason.split(";", 1)[0]).strip() or "?"


def fanout_stats(records: Sequence[PeerRecord]) -> dict[str, float] | None:
    """The fan-out siblings' TTFT (ms): mean, p90, max, and the mean spread within a group
    (slowest sibling less fastest). None when the workload has no fan-out."""
    groups: dict[tuple[int, int], list[float]] = {}
    for r in records:
        if r.fanout_index >= 0:
            groups.setdefault((r.agent, r.step), []).append(r.delta_times_s[0] - r.sent_s)
    if not groups:
        return None
    ttfts = [t for g in groups.values() for t in g]
    return {"num_siblings": len(ttfts),
            "mean_ttft_ms": float(np.mean(ttfts)) * 1000,
            "p90_ttft_ms": float(np.percentile(ttfts, 90)) * 1000,
            "max_ttft_ms": float(np.max(ttfts)) * 1000,
            "mean_spread_ms": float(np.mean([max(g) - min(g) for g in groups.values()])) * 1000}


def step_label(step: int, fanout: bool) -> str:
    return f"step {step} (fan-out)" if fanout else f"step {step}"


def step_stats(records: Sequence[PeerRecord]) -> dict[str, dict[str, float | int | None]]:
    """Per step of the agents' scripts (``step N``, ``step N (fan-out)``), in step order: how
    many requests, their mean TTFT (ms), how far apart the agents sent it (``arrival_spread_ms``:
    last send less first; the closed loop makes each stack's spread its own, and a burst of
    steps sent together queues on any stack), and the mean queue the placement priced
    (``mean_queue_ms``; None where the stack reports no placement). Where a figure is lost,
    this says in which step and whether it came with a burst."""
    steps: dict[tuple[int, bool], list[PeerRecord]] = {}
    for r in records:
        steps.setdefault((r.step, r.fanout_index >= 0), []).append(r)
    out: dict[str, dict[str, float | int | None]] = {}
    for (step, fanout), group in sorted(steps.items()):
        sent = [r.sent_s for r in group]
        queued = [r.placement["queue_ms"] for r in group
                  if isinstance(r.placement.get("queue_ms"), (int, float))]
        out[step_label(step, fanout)] = {
            "count": len(group),
            "mean_ttft_ms": float(np.mean([r.delta_times_s[0] - r.sent_s for r in group])) * 1000,
            "arrival_spread_ms": (max(sent) - min(sent)) * 1000,
            "mean_queue_ms": float(np.mean(queued)) if len(queued) == len(group) else None,
        }
    return out
