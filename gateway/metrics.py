"""Baton's Prometheus metrics: vLLM's meanings under the ``baton_`` prefix.

Recorded where requests pass (the router, in the gateway's process) and, for pool gauges, from
the conductor's ``pool_status`` polled by ``PoolGaugePoller``. Served by the HTTP front's
``/metrics`` (prometheus-client's process registry). ``deploy/grafana/baton-dashboard.json``
uses exactly the names in ``METRIC_NAMES``; a test keeps the two in step.

Prefix-cache counters count tokens, as vLLM's do: a query is a prompt token looked up, a hit a
prompt token not computed. ``tier`` says where the hit came from: ``device`` (the prefill
engine's own cache) or ``host`` (loaded from the node's KV store; a block promoted from the disk
tier counts here, since it is loaded from host memory).
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter, Gauge, Histogram

from protos.wire import Placement, PrefillResult, TokenChunk

log = logging.getLogger(__name__)

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                  1.0, 2.5, 5.0)

TTFT = Histogram("baton_time_to_first_token_seconds",
                 "Time from request arrival at the router to its first token (s).",
                 buckets=_LATENCY_BUCKETS_S)
ITL = Histogram("baton_inter_token_latency_seconds",
                "Time between successive output tokens of a request (s).", buckets=_ITL_BUCKETS_S)
E2E = Histogram("baton_e2e_request_latency_seconds",
                "Time from request arrival to its last token (s).", buckets=_LATENCY_BUCKETS_S)
REQUESTS_RUNNING = Gauge("baton_num_requests_running",
                         "Requests running in the engines of a pool (worker stats).", ["pool"])
REQUESTS_WAITING = Gauge("baton_num_requests_waiting",
                         "Requests waiting in the engines of a pool (worker stats).", ["pool"])
POOL_INSTANCES = Gauge("baton_pool_instances", "Instances in a pool by phase.", ["pool", "phase"])
PREFIX_QUERIES = Counter("baton_prefix_cache_queries",
                         "Prompt tokens looked up in the prefix caches (tokens).")
PREFIX_HITS = Counter("baton_prefix_cache_hits",
                      "Prompt tokens found cached instead of computed, by tier (tokens).", ["tier"])
KV_TRANSFER_BYTES = Counter("baton_kv_transfer_bytes",
                            "KV bytes loaded into an engine from the KV store, by path.", ["path"])
KV_TRANSFER_SECONDS = Counter("baton_kv_transfer_seconds",
                              "Seconds engines spent loading KV from the KV store, by path "
                              "(from the workers' connector counters).", ["path"])
STORE_BLOCKS = Gauge("baton_kv_store_blocks", "Blocks a store node holds, by tier (host, disk; "
                     "host_soft_pinned: of host, those of operator-pinned prefixes; leased: in "
                     "any tier, those a live session or cache_control lease names).",
                     ["node", "tier"])
STORE_LEASED_BYTES = Gauge("baton_kv_store_leased_bytes",
                           "Bytes of blocks a store node holds under live leases (sessions, "
                           "cache_control prefixes).", ["node"])
STORE_EVENTS = Gauge(
    "baton_kv_store_events",
    "Store node counts since it started: host_full_rejected_blocks (arena full of pinned blocks: "
    "not stored, recomputed later), disk_rejected_puts / disk_write_errors (disk tier full or "
    "failing: dropped instead of demoted), disk_corrupt_blocks (failed checksum: recomputed), "
    "pulled_blocks / pull_failures (cross-node transfers), promoted / demoted blocks, "
    "lease_evictions (leases that gave way to a cap, leased blocks evicted anyway).",
    ["node", "event"])
RETRIES = Counter("baton_request_retries",
                  "Requests placed again because their worker died before answering, by reason.",
                  ["reason"])
PLACEMENTS = Counter("baton_placement_decisions",
                     "Placements made, by policy and kind of decision.", ["policy", "reason"])
REJECTIONS = Counter("baton_early_rejections",
                     "Requests rejected before any prefill work, by cause.", ["reason"])
AUTOSCALE_DECISIONS = Counter(
    "baton_autoscale_decisions",
    "Decisions of the autoscaling planner, by pool and action (up, down, hold); from the "
    "conductor's counts, so a conductor restart starts them again.", ["pool", "action"])
AUTOSCALE_TARGET = Gauge("baton_autoscale_target_instances",
                         "The pool size the planner's latest decision asks for.", ["pool"])
AUTOSCALE_ENABLED = Gauge("baton_autoscale_enabled",
                          "1 when the planner's decisions are applied, 0 when it only decides.")
COST_MODEL_ERROR = Gauge(
    "baton_cost_model_error_pct",
    "The conductor's cost model's absolute percentage error on requests it was not fitted on "
    "(model: prefill, decode (per step), handoff, decode_per_request (a finished request's "
    "decode-only steps, summed), mixed_step (a step decoding beside prompt chunks, priced as "
    "placement prices it), decode_per_request_all_steps (every step a finished request decoded "
    "in, summed); stat: median, p90); absent until measured.", ["model", "stat"])
HANDOFF_OVERHEAD = Gauge(
    "baton_kv_handoff_overhead_ms",
    "What the conductor prices a disaggregated KV hand-off at beyond its bytes: the median of "
    "the measured hand-offs less their priced transfer (ms); 0 until measured.")
REQUESTS_FINISHED = Counter("baton_request_success",
                            "Requests that streamed to their end, by finish reason.",
                            ["finished_reason"])

METRIC_NAMES = (
    "baton_time_to_first_token_seconds", "baton_inter_token_latency_seconds",
    "baton_e2e_request_latency_seconds", "baton_num_requests_running", "baton_num_requests_waiting",
    "baton_pool_instances", "baton_prefix_cache_queries_total", "baton_prefix_cache_hits_total",
    "baton_kv_transfer_bytes_total", "baton_kv_transfer_seconds_total",
    "baton_placement_decisions_total",
    "baton_early_rejections_total", "baton_request_success_total",
    "baton_kv_store_blocks", "baton_kv_store_events", "baton_request_retries_total",
    "baton_cost_model_error_pct", "baton_kv_handoff_overhead_ms",
)
"""The series names as exposed (counters gain ``_total``; histograms add ``_bucket`` etc.)."""

TRANSFER_PATH_SHM = "host_shm"
"""The live connector loads from its own node's host arena through shared memory."""


def placement_reason(placement: Placement) -> str:
    """A bounded label for a placement: ``colocated`` (prefill on the decode instance),
    ``pulled`` (a remote prefix pulled), ``cached`` (a local prefix reused) or ``cold``."""
    if placement.prefill_instance == placement.decode_instance:
        return "colocated"
    if placement.pulled_from:
        return "pulled"
    if placement.expected_cached_blocks > 0:
        return "cached"
    return "cold"


def rejection_reason(message: str) -> str:
    return "tbt_slo" if "TBT" in message or "inter-token" in message else "ttft_slo"


class RequestTimer:
    """Times one request through the router and records it when it ends."""

    def __init__(self, received_s: float, kv_bytes_per_token: int = 0) -> None:
        self._received_s = received_s
        self._last_token_s: float | None = None
        self.kv_bytes_per_token = kv_bytes_per_token
        self._placement: Placement | None = None
        self._prefill: PrefillResult | None = None

    def placed(self, placement: Placement, prefill: PrefillResult) -> None:
        self._placement, self._prefill = placement, prefill
        PLACEMENTS.labels(placement.policy, placement_reason(placement)).inc()

    def chunk(self, chunk: TokenChunk, now_s: float) -> None:
        num_tokens = len(chunk.token_ids)
        if num_tokens:
            if self._last_token_s is None:
                TTFT.observe(now_s - self._received_s)
            else:
                gap_s = (now_s - self._last_token_s) / num_tokens
                for _ in range(num_tokens):
                    ITL.observe(gap_s)
            self._last_token_s = now_s
        if chunk.finish_reason is not None:
            E2E.observe(now_s - self._received_s)
            REQUESTS_FINISHED.labels(chunk.finish_reason).inc()
            self._finish_cache(chunk)

    def _finish_cache(self, last: TokenChunk) -> None:
        placement, prefill = self._placement, self._prefill
        if placement is None or prefill is None:
            return
        PREFIX_QUERIES.inc(prefill.num_prompt_tokens)
        if placement.prefill_instance == placement.decode_instance:
            cached, loaded = last.num_cached_tokens, last.num_loaded_tokens
        else:
            cached, loaded = prefill.num_cached_tokens, prefill.num_loaded_tokens
            # the decode engine loading the whole prompt is the prefill→decode hand-off
            KV_TRANSFER_BYTES.labels(TRANSFER_PATH_SHM).inc(
                last.num_loaded_tokens * self.kv_bytes_per_token)
        loaded = min(loaded, cached)
        PREFIX_HITS.labels("device").inc(cached - loaded)
        PREFIX_HITS.labels("host").inc(loaded)
        if loaded:
            KV_TRANSFER_BYTES.labels(TRANSFER_PATH_SHM).inc(loaded * self.kv_bytes_per_token)


_load_seconds_seen: dict[str, float] = {}


def set_pool_gauges(status) -> None:
    """Copy a ``cluster.pools.PoolStatus`` into the pool gauges, and the growth of each
    worker's cumulative KV load time into ``baton_kv_transfer_seconds``."""
    for row in status.instances:
        grown = row.kv_load_seconds - _load_seconds_seen.get(row.instance_id, 0.0)
        _load_seconds_seen[row.instance_id] = row.kv_load_seconds
        if grown > 0:
            KV_TRANSFER_SECONDS.labels(TRANSFER_PATH_SHM).inc(grown)
    for pool in ("prefill", "decode"):
        rows = [r for r in status.instances if r.role == pool]
        REQUESTS_RUNNING.labels(pool).set(sum(r.num_running_reqs for r in rows))
        REQUESTS_WAITING.labels(pool).set(sum(r.num_waiting_reqs for r in rows))
        for phase in ("starting", "ready", "draining", "not_ready"):
            POOL_INSTANCES.labels(pool, phase).set(status.pool_sizes.get(pool, {}).get(phase, 0))
    _set_autoscale(status.autoscale)
    _set_cost_model(status.cost_model)
    for store in status.stores:
        STORE_BLOCKS.labels(store.node_id, "host").set(store.host_used_blocks)
        STORE_BLOCKS.labels(store.node_id, "disk").set(store.disk_used_blocks)
        STORE_BLOCKS.labels(store.node_id, "host_soft_pinned").set(
            store.counters.soft_pinned_blocks)
        if store.counters.leased_blocks is not None:
            STORE_BLOCKS.labels(store.node_id, "leased").set(store.counters.leased_blocks)
            STORE_LEASED_BYTES.labels(store.node_id).set(store.counters.leased_bytes or 0)
        for event, count in store.counters.as_dict().items():
            if event not in ("disk_blocks", "soft_pinned_blocks", "leased_blocks", "leased_bytes"):
                STORE_EVENTS.labels(store.node_id, event).set(count)


def _set_cost_model(cost_model) -> None:
    if cost_model is None:
        return
    for name in ("prefill", "decode", "handoff", "decode_per_request", "mixed_step",
                 "decode_per_request_all_steps"):
        error = getattr(cost_model, name)
        if error is not None:
            COST_MODEL_ERROR.labels(name, "median").set(error.median_pct)
            COST_MODEL_ERROR.labels(name, "p90").set(error.p90_pct)
    HANDOFF_OVERHEAD.set(cost_model.handoff_overhead_ms)


_decisions_seen: dict[str, int] = {}


def _set_autoscale(autoscale) -> None:
    """The planner's decision counts (grown since the last poll) and latest targets."""
    if autoscale is None:
        return
    AUTOSCALE_ENABLED.set(1 if autoscale.enabled else 0)
    for key, total in autoscale.decisions_total.items():
        seen = _decisions_seen.get(key, 0)
        grown = total - seen if total >= seen else total  # fewer: the conductor restarted
        _decisions_seen[key] = total
        if grown > 0:
            pool, action = key.split("/", 1)
            AUTOSCALE_DECISIONS.labels(pool, action).inc(grown)
    for decision in autoscale.last:
        AUTOSCALE_TARGET.labels(decision.pool).set(decision.size_after)


class PoolGaugePoller:
    """Refreshes the pool gauges from the conductor every ``interval_s`` (in the front's loop)."""

    def __init__(self, conductor, interval_s: float = 1.0) -> None:
        self._conductor = conductor
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                set_pool_gauges(await self._conductor.pool_status.remote())
            except Exception as exc:  # the conductor restarting must not stop the front
                log.debug("pool gauges not refreshed: %s", exc)
            await asyncio.sleep(self._interval_s)
