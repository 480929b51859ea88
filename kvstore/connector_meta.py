"""What the connector's halves and the rest of Baton exchange: the per-request parameters vLLM
carries in (``request_transfer_params``) and out (``request_transfer``), the metadata the
scheduler half hands the worker half each step (``BatonConnectorMetadata``: ``LoadSpec``,
``SaveSpec``) and the worker half's news back (``BatonWorkerMetadata``), and the per-engine
totals both halves add to (``connector_stats``). Plain data: no store calls, no tensors.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvstore.client import PendingSlots
from kvstore.keys import BlockKey
from protos.wire import CachedByTier, EngineRequest


@dataclass
class ConnectorStats:
    """Counters one engine's connector keeps; read by the worker that hosts the engine."""

    lookups_blocks: int = 0
    hits_blocks: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    """Wall time spent copying loaded blocks into the engine's KV cache (s)."""
    failed_load_blocks: int = 0
    """Promised blocks whose arena was gone by the time they were copied (recomputed)."""
    dropped_save_blocks: int = 0
    """Blocks not saved because the store was gone (between its death and its return)."""
    hashed_prompts: int = 0
    """Prompts the connector hashed itself: the request carried no block keys under its scheme."""
    crash_mid_save: bool = False
    """Drill hook (``baton chaos``, armed by ``EngineWorker.crash_mid_save``): the next save
    with two or more blocks copies half of them into their reserved slots and then kills the
    process, as a crash in the middle of a KV transfer would: slots reserved, nothing committed."""


_STATS: dict[str, ConnectorStats] = {}


def connector_stats(engine_id: str) -> ConnectorStats:
    """The per-engine totals of the connector built for ``engine_id`` in this process (the two
    halves of one engine's connector add to the same totals). What the connector did for one
    request travels with that request instead (``request_transfer``)."""
    return _STATS.setdefault(engine_id, ConnectorStats())


_KV_SPANS: dict[str, list[tuple[int, int]]] = {}


def kv_cache_spans(engine_id: str) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of the KV cache storage the connector built for ``engine_id`` in
    this process was given (empty before vLLM registers its caches): where a memory report
    looks for the cache's resident pages."""
    return _KV_SPANS.get(engine_id, [])


def record_kv_cache(engine_id: str, tensors: list) -> None:
    _KV_SPANS[engine_id] = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                            for t in tensors]


class SaveLedger:
    """The saves one engine's connector has handed off and not yet finished writing, and the
    blocks each request got stored: the prefill worker waits on it before its result says the
    prompt is in the store (``pending``, then ``take_stored``). Thread-safe: the saving thread
    writes it, the worker's event loop reads it."""

    KEEP_STORED = 4096
    """Requests whose stored-block counts are kept for a reader (the oldest go first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: set[Future] = set()
        self._stored: OrderedDict[str, int] = OrderedDict()

    def started(self, job: Future) -> None:
        with self._lock:
            self._jobs.add(job)
        job.add_done_callback(self._finished)

    def _finished(self, job: Future) -> None:
        with self._lock:
            self._jobs.discard(job)

    def add_stored(self, request_id: str, num_blocks: int) -> None:
        """``request_id`` is the engine's own id of the request: vLLM makes it the caller's id
        with a suffix (``<id>-<8 characters>``); ``take_stored`` takes the caller's."""
        with self._lock:
            head, _, suffix = request_id.rpartition("-")
            external = head if head and len(suffix) == 8 else request_id
            for key in {request_id, external}:
                self._stored[key] = self._stored.pop(key, 0) + num_blocks
            while len(self._stored) > self.KEEP_STORED:
                self._stored.popitem(last=False)

    def pending(self) -> list[Future]:
        """The save jobs not finished yet: once they are, every block handed off so far is
        written and its commit sent (``StoreClient.unsettled_commits`` then says answered)."""
        with self._lock:
            return list(self._jobs)

    def take_stored(self, request_id: str) -> int:
        with self._lock:
            return self._stored.pop(request_id, 0)


_LEDGERS: dict[str, SaveLedger] = {}


def save_ledger(engine_id: str) -> SaveLedger:
    """The ``SaveLedger`` of the connector built for ``engine_id`` in this process."""
    return _LEDGERS.setdefault(engine_id, SaveLedger())


class StepGate:
    """Holds an engine's background KV saves until the step that handed them off has delivered
    its outputs. A save handed off in ``wait_for_save`` (after the forward pass) used to start
    at once on the saving thread, which shares the engine's core on a CPU engine: it took the
    core from the rest of the step (sampling, the scheduler's update, the outputs), and a warm
    prompt's first token came out ~10-20 ms later (per-hop timings of a co-located decode
    engine, docs/benchmarks.md). Only on a decode engine, whose outputs are its clients'
    tokens (``saves_after_outputs``); a prefill engine's save is its hand-off and starts at
    once. ``close`` when a save is handed off; the engine's runner
    ``open``s it once the step's outputs are on their way; a save waits for that at most
    ``SAVE_HOLD_MAX_S`` (an engine driven without the runner loses no more)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def is_open(self) -> bool:
        return self._open.is_set()

    def wait(self, timeout_s: float) -> bool:
        """True when opened within ``timeout_s`` (at once when open)."""
        return self._open.wait(timeout_s)


SAVE_HOLD_MAX_S = 0.05
"""The longest a handed-off save waits for its step's outputs (``StepGate``)."""

_STEP_GATES: dict[str, StepGate] = {}


def step_gate(engine_id: str) -> StepGate:
    """The ``StepGate`` of the engine ``engine_id`` in this process (its connector closes it,
    its runner opens it)."""
    return _STEP_GATES.setdefault(engine_id, StepGate())


def engine_step_gate(engine_args) -> StepGate | None:
    """The ``StepGate`` of the Baton connector ``engine_args`` (vLLM's) configure, else None."""
    transfer = getattr(engine_args, "kv_transfer_config", None)
    if transfer is None or transfer.kv_connector != "BatonConnector":
        return None
    return step_gate(str((transfer.kv_connector_extra_config or {}).get("engine_id", "")))


PARAMS_KEY = "baton"
"""Baton's entry in a request's vLLM ``kv_transfer_params`` (``SamplingParams.extra_args``)."""


def request_transfer_params(request: EngineRequest) -> dict[str, Any] | None:
    """What the connector needs of ``request`` beyond its tokens, as vLLM carries it per request
    (``SamplingParams.extra_args["kv_transfer_params"]`` becomes ``Request.kv_transfer_params``):
    the prompt's block keys hashed at the gateway, whether to look its blocks up in the
    store at all and to save them there, and the token offset its salt applies from
    (``cache_salt_offset``: the connector keys what it hashes itself, its output blocks, under
    the same segments). None when there is nothing to carry."""
    carried: dict[str, Any] = {}
    blocks = request.blocks
    if blocks is not None:
        carried.update(model_id=blocks.model_id, kv_layout=blocks.kv_layout,
                       block_size=blocks.block_size_tokens, keys=blocks.keys)
    if not request.store_lookup:
        carried["lookup"] = False
    if not request.store_save:
        carried["save"] = False
    if request.cache_salt_offset:
        carried["cache_salt_offset"] = request.cache_salt_offset
    return {PARAMS_KEY: carried} if carried else None


@dataclass(frozen=True)
class RequestTransfer:
    """What the connector did for one request, as vLLM returns it with the request's last
    output (``request_finished``'s kv_transfer_params become ``RequestOutput.kv_transfer_params``)."""

    num_loaded_tokens: int = 0
    """Prompt tokens whose KV was loaded from the store instead of computed."""
    num_stored_blocks: int = 0
    """Prompt blocks the store granted this request to write, and the connector wrote."""
    num_disk_tokens: int = 0
    """Of ``num_loaded_tokens``, those whose blocks the store brought back from its disk tier
    to answer this request's lookup."""

    def cached_by_tier(self, num_cached_tokens: int, num_pulled_tokens: int) -> CachedByTier:
        """The request's ``num_cached_tokens`` (vLLM's: its device prefix cache and what the
        connector loaded) by tier: loaded = host + disk + pulled, where the pulled tokens
        (``num_pulled_tokens``: the blocks pulled into this node's host tier before the
        request ran) are loaded from host, and device is the rest. Each part is capped by what
        is left, so the four add up to ``num_cached_tokens`` exactly."""
        cached = max(num_cached_tokens, 0)
        loaded = min(max(self.num_loaded_tokens, 0), cached)
        disk = min(max(self.num_disk_tokens, 0), loaded)
        pulled = min(max(num_pulled_tokens, 0), loaded - disk)
        return CachedByTier(device=cached - loaded, host=loaded - disk - pulled, disk=disk,
                            pulled=pulled)


def request_transfer(output: Any) -> RequestTransfer:
    """The ``RequestTransfer`` a finished vLLM ``RequestOutput`` carries (zeros without one)."""
    params = getattr(output, "kv_transfer_params", None)
    done = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(done, dict):
        return RequestTransfer()
    return RequestTransfer(int(done.get("loaded_tokens", 0)), int(done.get("stored_blocks", 0)),
                           int(done.get("disk_tokens", 0)))


@dataclass
class LoadSpec:
    request_id: str
    block_ids: list[int]
    slots: list[int]
    keys: list[BlockKey]
    arena_path: str
    """The arena ``slots`` index (the store that pinned them)."""
    unpin_also: list[BlockKey] = field(default_factory=list)
    """Blocks the lookup pinned that are not loaded (cached locally already, or past what the
    engine must compute itself): unpinned with ``keys``, in one call."""
    on_step: bool = True
    """Copied on the step, before its forward pass (a load cheap enough, or the synchronous
    baseline); else asynchronously, reported by ``get_finished`` once landed."""


@dataclass
class SaveSpec:
    """Blocks to write: ``keys[i]`` (chained after ``parents[i]``) is in the engine's block
    ``block_ids[i]``. With asynchronous transfers the worker half asks the store for their
    slots off the step (``granted`` None); the synchronous baseline asked before the forward
    pass (``granted``: one slot per key once answered, None where the store holds the block
    already or has no room) and the worker half waits for the answer after it."""

    request_id: str
    block_ids: list[int]
    keys: list[BlockKey]
    granted: PendingSlots | None = None
    parents: list[BlockKey | None] = field(default_factory=list)


@dataclass
class BatonConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class BatonWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker half tells the scheduler half after a step (vLLM hands it to
    ``update_connector_output``): requests whose loads failed (their KV is recomputed), and
    blocks the store granted but that were not written, by request."""

    failed_loads: set[str] = field(default_factory=set)
    dropped_blocks: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: "BatonWorkerMetadata") -> "BatonWorkerMetadata":
        dropped = dict(self.dropped_blocks)
        for request_id, n in other.dropped_blocks.items():
            dropped[request_id] = dropped.get(request_id, 0) + n
        return BatonWorkerMetadata(self.failed_loads | other.failed_loads, dropped)
