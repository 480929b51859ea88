"""``baton bench soak``: a bounded soak of agent traffic, watching for what grows.

Starts a whole local cluster (as ``baton serve`` does) and runs ``sessions`` agents for
``duration_s``: each agent's prompt is its history (a shared system trunk, then every earlier
step's user turn and answer), growing by a step after a think time drawn from a long-tailed
(log-normal) distribution, and starting over as a new session once it would pass
``max_history_tokens``. Every step names its session (``session_id``: its blocks are leased in
the store), and an agent closes a session (``DELETE /v1/sessions/{id}``) when it starts the next
one and when the run ends. Some steps are cancelled by the client after their first tokens (gRPC)
and some are HTTP streams the client disconnects from; the rest complete.

Every ``sample_every_s`` it samples what could leak: the resident memory and open file
descriptors of every process of the cluster (this one and its descendants: Ray, the engines, the
store node, Redis), the store node's used, pinned and leased blocks, the Redis keys, the
conductor's indexed blocks, booked requests and live sessions. ``growth`` reports each series' slope per hour over the
run's second half (after warm-up; a least-squares line) beside its first, last and peak values,
and ``live`` what the live data explains (the store's used blocks bound what Redis and the index
may hold). After the load the books must be empty, nothing pinned (``bench.leaks``), no block
leased and no session live.

Resident memory is also sampled per role of process (``bench.peers_cpu.role_of``: engine,
frontend, conductor, store, ray, redis, other) and per kind, as the kernel counts it in
``/proc/<pid>/status``: ``anon`` (the process's own heap), ``file`` (mapped files: libraries,
model weights) and ``shmem`` (shared memory it touched: the store's host-tier arena, which the
store node and every engine that copies blocks in or out map, so a page appears in each of their
RSS once they touched it). ``rss_growth_by_role`` gives each role and kind's slope over the
second half, so growth can be told apart: a heap that keeps growing, or arena pages touched for
the first time (bounded by the host tier's size times its mappers).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Callable

import grpc
import httpx
import msgspec

from bench.leaks import leaks
from cluster.config import ClusterConfig
from cluster.serve import BatonServer
from gateway.client import build_request
from protos.baton.v1 import inference_pb2_grpc as pb_grpc

CANCEL_SHARE = 0.1
"""Steps the client cancels after their first tokens (gRPC)."""
DISCONNECT_SHARE = 0.1
"""Steps sent over HTTP, streamed, that the client drops after the first chunk."""


class Sample(msgspec.Struct):
    at_s: float
    rss_mb: float
    open_fds: int
    processes: int
    store_used_blocks: int
    store_pinned_blocks: int
    redis_keys: int
    indexed_blocks: int
    booked_requests: int
    store_leased_blocks: int = 0
    """Blocks the store holds under the agents' session leases."""
    live_sessions: int = 0
    """Sessions the conductor's table holds."""
    rss_mb_by_role: dict[str, dict[str, float]] = {}
    """Resident MB per role of process and kind (``anon``, ``file``, ``shmem``; module docstring)."""
    engine_memory: dict[str, float] = {}
    """The engine workers' own memory reports (``worker.memory.EngineMemory``), summed over
    the engines: KV cache resident MB, glibc heap in use and kept free, Python objects."""


class Growth(msgspec.Struct):
    first: float
    last: float
    peak: float
    per_hour: float
    """Least-squares slope over the run's second half, per hour."""


class SoakReport(msgspec.Struct):
    duration_s: float
    sessions: int
    steps: dict[str, int]
    """completed, cancelled, disconnected, failed (and "failed <why>": the gRPC status, HTTP
    status or client error of each failed step), sessions_closed, session_close_failed."""
    samples: list[Sample]
    growth: dict[str, Growth]
    leaks: dict[str, int]
    ok: bool
    rss_growth_by_role: dict[str, dict[str, Growth]] = {}
    """``growth_of``'s figures for each role's resident MB of each kind."""
    engine_memory_growth: dict[str, Growth] = {}
    """``growth_of``'s figures for each series of ``Sample.engine_memory``."""


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of ``(seconds, value)`` points, per hour (0 for fewer than 2)."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread * 3600.0


def growth_of(samples: list[Sample]) -> dict[str, Growth]:
    """Each sampled series' first, last and peak value and its slope over the second half."""
    half = samples[len(samples) // 2:]
    fields = [name for name in Sample.__struct_fields__
              if name not in ("at_s", "rss_mb_by_role", "engine_memory")]
    return {name: _growth([(s.at_s, float(getattr(s, name))) for s in samples], len(half))
            for name in fields}


def _growth(points: list[tuple[float, float]], num_second_half: int) -> Growth:
    values = [v for _, v in points]
    return Growth(values[0], values[-1], max(values),
                  round(slope_per_hour(points[len(points) - num_second_half:]), 1))


def rss_growth_by_role(samples: list[Sample]) -> dict[str, dict[str, Growth]]:
    """``growth_of`` for each role's resident MB of each kind (a role or kind missing from a
    sample counts 0 there: its processes had not started or had ended)."""
    roles = sorted({role for s in samples for role in s.rss_mb_by_role})
    kinds = sorted({kind for s in samples for by_kind in s.rss_mb_by_role.values() for kind in by_kind})
    num_half = len(samples) - len(samples) // 2
    return {role: {kind: _growth([(s.at_s, s.rss_mb_by_role.get(role, {}).get(kind, 0.0))
                                  for s in samples], num_half) for kind in kinds}
            for role in roles}


def engine_memory_growth(samples: list[Sample]) -> dict[str, Growth]:
    """``growth_of`` for each series of the engines' memory reports (a sample without one,
    an engine that did not answer, is left out)."""
    reported = [s for s in samples if s.engine_memory]
    names = sorted({name for s in reported for name in s.engine_memory})
    num_half = len(reported) - len(reported) // 2
    return {name: _growth([(s.at_s, s.engine_memory.get(name, 0.0)) for s in reported], num_half)
            for name in names} if reported else {}


async def _engine_memory(cluster) -> dict[str, float]:
    """The engines' memory reports summed ({} when one does not answer: the sample would mix
    engines)."""
    ids = cluster.prefill_ids + cluster.decode_ids
    try:
        reports = await asyncio.wait_for(
            asyncio.gather(*(cluster.actor(i).memory.remote() for i in ids)), 30)
    except Exception:  # noqa: BLE001 - an engine busy past the wait or gone
        return {}
    totals: dict[str, float] = {}
    for report in reports:
        for name, value in msgspec.structs.asdict(report).items():
            totals[name] = round(totals.get(name, 0.0) + value, 1)
    return totals


RSS_KINDS = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}


def rss_kinds_mb(status_text: str) -> dict[str, float]:
    """A process's resident MB by kind from its ``/proc/<pid>/status`` text (kB lines)."""
    out = {kind: 0.0 for kind in RSS_KINDS.values()}
    for line in status_text.splitlines():
        fields = line.split()
        kind = RSS_KINDS.get(fields[0]) if len(fields) >= 2 else None
        if kind is not None:
            out[kind] = int(fields[1]) / 1024.0
    return out


class _Processes:
    """The resident memory and open descriptors of this process and its descendants."""

    def __init__(self) -> None:
        import psutil

        self._root = psutil.Process()

    def sample(self) -> tuple[float, int, int, dict[str, dict[str, float]]]:
        """Total RSS MB, open fds, processes, and resident MB by role and kind."""
        import psutil

        from bench.peers_cpu import role_of

        rss, fds, count = 0, 0, 0
        by_role: dict[str, dict[str, float]] = {}
        for process in [self._root, *self._root.children(recursive=True)]:
            try:
                rss += process.memory_info().rss
                fds += process.num_fds()
                role = role_of(process.name(), " ".join(process.cmdline()))
                kinds = rss_kinds_mb(Path(f"/proc/{process.pid}/status").read_text())
                count += 1
            except (psutil.Error, OSError):
                continue
            into = by_role.setdefault(role, {kind: 0.0 for kind in kinds})
            for kind, mb in kinds.items():
                into[kind] = round(into[kind] + mb, 1)
        return rss / 2**20, fds, count, by_role


async def _sample(server: BatonServer, processes: _Processes, started: float) -> Sample:
    import redis.asyncio as aioredis

    cluster = server.cluster
    store = await cluster.store.stats.remote()
    books = await cluster.conductor.status.remote()
    client = aioredis.from_url(cluster.redis_url)
    try:
        redis_keys = await client.dbsize()
    finally:
        await client.aclose()
    rss_mb, fds, count, by_role = processes.sample()
    live = await cluster.conductor.live_sessions.remote()
    engines = await _engine_memory(cluster)
    return Sample(round(time.monotonic() - started, 1), round(rss_mb, 1), fds, count,
                  store.used_blocks, store.pinned_blocks, redis_keys,
                  sum(books.indexed_blocks.values()),
                  books.num_in_flight_prefills + books.num_in_flight_decodes,
                  store.leased_blocks, live, by_role, engines)


async def _grpc_step(stub, prompt: list[int], max_tokens: int, cancel: bool,
                     session_id: str = "") -> tuple[str, list[int]]:
    request = build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0)
    request.session_id = session_id
    call = stub.Generate(request, timeout=120)
    answer: list[int] = []
    try:
        async for response in call:
            if response.HasField("delta"):
                answer.extend(response.delta.token_ids)
                if cancel:
                    call.cancel()
                    return "cancelled", answer
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and cancel:
            return "cancelled", answer
        return f"failed {e.code().name}", answer
    return "completed", answer


async def _http_disconnect(http: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                           session_id: str = "") -> str:
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0}
    if session_id:
        body["session_id"] = session_id
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"failed HTTP {response.status_code}"
            async for _chunk in response.aiter_bytes():
                return "disconnected"  # leave after the first chunk: the client goes away
    except httpx.HTTPError as e:
        return f"failed {type(e).__name__}"
    return "failed with no chunk"


async def _close(http: httpx.AsyncClient, session_id: str, steps: dict[str, int]) -> None:
    """End a session through the HTTP front, as an agent framework would when a task is done."""
    try:
        response = await http.delete(f"/v1/sessions/{session_id}")
        outcome = "sessions_closed" if response.status_code == 200 else "session_close_failed"
    except httpx.HTTPError:
        outcome = "session_close_failed"
    steps[outcome] = steps.get(outcome, 0) + 1


async def _agent(stub, http, rng: random.Random, trunk: list[int], deadline: float,
                 max_tokens: int, max_history_tokens: int, steps: dict[str, int],
                 name: str = "agent") -> None:
    """One agent: steps of a session over a growing history; when it would pass
    ``max_history_tokens`` the agent closes the session and starts a new one (same trunk)."""
    history = list(trunk)
    number = 0
    session_id = f"{name}-{number}"
    while time.monotonic() < deadline:
        history += [rng.randrange(100, 30_000) for _ in range(rng.randrange(16, 96))]
        if len(history) + max_tokens > max_history_tokens:
            await _close(http, session_id, steps)
            number += 1
            session_id = f"{name}-{number}"
            history = list(trunk) + history[len(trunk):][-64:]  # a new session, same trunk
        draw = rng.random()
        if draw < DISCONNECT_SHARE:
            outcome, answer = await _http_disconnect(http, history, max_tokens, session_id), []
        else:
            outcome, answer = await _grpc_step(stub, history, max_tokens,
                                               cancel=draw < DISCONNECT_SHARE + CANCEL_SHARE,
                                               session_id=session_id)
        steps[outcome] = steps.get(outcome, 0) + 1
        if outcome.startswith("failed "):  # and the total, beside each reason's count
            steps["failed"] = steps.get("failed", 0) + 1
        history += answer
        await asyncio.sleep(min(30.0, rng.lognormvariate(0.0, 1.0)))  # think time, long-tailed
    await _close(http, session_id, steps)


async def run_soak(config: ClusterConfig, duration_s: float, sessions: int = 8,
                   sample_every_s: float = 30.0, max_tokens: int = 16,
                   max_history_tokens: int = 3_000, seed: int = 0,
                   progress: Callable[[str], None] = lambda _m: None) -> SoakReport:
    server = BatonServer(config, progress=progress)
    await server.start()
    rng = random.Random(seed)
    trunk = [rng.randrange(100, 30_000) for _ in range(512)]
    steps: dict[str, int] = {}
    samples: list[Sample] = []
    processes = _Processes()
    try:
        started = time.monotonic()
        deadline = started + duration_s
        async with grpc.aio.insecure_channel(server.target) as channel, httpx.AsyncClient(
                base_url=server.http_url.removesuffix("/v1"), timeout=120) as http:
            stub = pb_grpc.InferenceStub(channel)

            async def sampler() -> None:
                while True:
                    samples.append(await _sample(server, processes, started))
                    last = samples[-1]
                    progress(f"{last.at_s:.0f} s: RSS {last.rss_mb:,.0f} MB, {last.open_fds} fds, "
                             f"{last.redis_keys} Redis keys, {last.indexed_blocks} indexed blocks, "
                             f"{last.store_pinned_blocks} pinned; steps {steps}")
                    if time.monotonic() >= deadline:
                        return
                    await asyncio.sleep(min(sample_every_s, max(0.0, deadline - time.monotonic())))

            await asyncio.gather(sampler(), *(
                _agent(stub, http, random.Random(rng.random()), trunk, deadline, max_tokens,
                       max_history_tokens, steps, f"agent{i}") for i in range(sessions)))
        left = await leaks(server)
        # every agent closed its last session: no lease and no session may be left
        left["leased_blocks"] = (await server.cluster.store.stats.remote()).leased_blocks
        left["live_sessions"] = await server.cluster.conductor.live_sessions.remote()
    finally:
        await server.stop()
    growth = growth_of(samples)
    ok = (not any(left.values()) and steps.get("failed", 0) == 0
          and steps.get("session_close_failed", 0) == 0)
    return SoakReport(round(duration_s, 1), sessions, steps, samples, growth, left, ok,
                      rss_growth_by_role(samples), engine_memory_growth(samples))


def main(config: ClusterConfig, duration_s: float, sessions: int, sample_every_s: float,
         json_path: Path | None, seed: int, progress: Callable[[str], None]) -> SoakReport:
    report = asyncio.run(run_soak(config, duration_s, sessions, sample_every_s, seed=seed,
                                  progress=progress))
    print(json.dumps({"steps": report.steps, "leaks": report.leaks, "ok": report.ok,
                      "growth_per_hour": {k: g.per_hour for k, g in report.growth.items()},
                      "rss_mb_growth_per_hour_by_role": {
                          role: {kind: g.per_hour for kind, g in kinds.items()}
                          for role, kinds in report.rss_growth_by_role.items()},
                      "engine_memory": {name: {"first": g.first, "last": g.last,
                                               "per_hour": g.per_hour}
                                        for name, g in report.engine_memory_growth.items()}},
                     indent=1))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(msgspec.to_builtins(report), indent=2) + "\n")
    return report
