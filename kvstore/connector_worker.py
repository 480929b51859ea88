"""The worker half of ``BatonConnector``: it moves bytes between the engine's paged KV cache
and the store's host arena, as the scheduler half's metadata for the step says.

With asynchronous transfers (the default) nothing waits on the engine's step:

- ``start_load_kv`` hands each ``LoadSpec`` to the loading thread, which copies the pinned
  slots into the engine's blocks while the engine steps its other sequences; ``get_finished``
  reports a load once its bytes have landed (never before), and releases its pins. A load whose
  arena is no longer mapped fails block by block (``get_block_ids_with_load_errors``, reported
  with the request) and is recomputed.
- ``wait_for_save`` hands the step's ``SaveSpec``s to the saving thread as one job: one
  reservation for all of them, the copies, one commit carrying each block's XXH3 (hashed once
  here, so the store node never hashes it). The blocks become visible (committed,
  indexed) only once written; a finished request's blocks are held by vLLM until
  ``get_finished`` reports its saves done. Before blocks of a preempted request are reused,
  ``handle_preemptions`` waits for the saves in flight.

A load cheap enough (``LoadSpec.on_step``) and every load of the synchronous baseline
(``async_transfers`` off) is copied before the forward pass: all of a step's such loads from
one arena in one copy (the forward pass waits for all of them anyway), where one copy each
gathered and scattered every layer once per request. The baseline saves after the forward
pass, on the step. What went wrong in a step reaches the scheduler half through
``build_connector_worker_meta``.

A mixin of ``BatonConnector``, which sets the attributes declared below in its ``__init__``;
``_get_connector_metadata`` is ``KVConnectorBase_V1``'s.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvstore.client import StoreClient, StoreSlots
from kvstore.connector_meta import (
    SAVE_HOLD_MAX_S,
    BatonConnectorMetadata,
    BatonWorkerMetadata,
    ConnectorStats,
    LoadSpec,
    SaveLedger,
    SaveSpec,
    StepGate,
    record_kv_cache,
)
from kvstore.keys import BlockKey
from kvstore.kv_copy import BlockCopier
from kvstore.transfer_wire import block_checksum

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

log = logging.getLogger("kvstore.connector")  # one logger for the connector, whichever half logs


def _inference(work: Callable) -> Callable:
    """``work`` run under ``torch.inference_mode`` on a transfer thread, as on the engine's: the
    arena's view may have been made on either (an inference tensor, which may only be written
    in inference mode)."""

    def run(*args):
        with torch.inference_mode():
            return work(*args)

    return run


@dataclass
class _SaveOutcome:
    """What one save job did, applied to the engine's books on the engine's thread."""

    saved_blocks: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Blocks granted (or asked for) but not written, by request."""
    lost_blocks: int = 0
    """Blocks not saved because the store was gone."""


@dataclass
class _Transfers:
    """The worker half's transfers in flight (asynchronous transfers)."""

    loading: dict[str, tuple[Future, LoadSpec]] = field(default_factory=dict)
    saves: list[tuple[Future, set[str]]] = field(default_factory=list)
    open_saves: dict[str, int] = field(default_factory=dict)
    """Save jobs not yet seen finished, per request."""
    saving: set[str] = field(default_factory=set)
    """Requests that had blocks to save, until reported finished sending."""
    finished: set[str] = field(default_factory=set)
    """Of those, the requests vLLM has finished: reported once their saves are done."""


class ConnectorWorkerHalf:
    """The worker half's methods of ``KVConnectorBase_V1``."""

    _num_gpu_blocks: int | None
    _store: StoreClient
    stats: ConnectorStats
    _layers: list[torch.Tensor]
    _device: torch.device
    _arena_layers: torch.Tensor | None
    _arena_layers_path: str
    _load_errors: set[int]
    _step: BatonWorkerMetadata
    _async: bool
    _ledger: SaveLedger
    _step_gate: StepGate
    _saves_after_outputs: bool
    _transfers: _Transfers
    _arena_lock: threading.Lock
    _threads: dict[str, ThreadPoolExecutor]
    _copiers: dict[str, BlockCopier]

    def _copier(self, direction: str) -> BlockCopier:
        """The copier of one thread: 'load' (the loading thread's), 'save' (the saving
        thread's) or 'step' (the engine thread's, for loads on the step). One each, since a
        copier reuses its staging buffers: two threads sharing one could gather into a buffer
        the other's copy still reads (on CUDA)."""
        copier = self._copiers.get(direction)
        if copier is None:
            copier = self._copiers[direction] = BlockCopier(self._layers)
        return copier

    def _thread(self, name: str) -> ThreadPoolExecutor:
        """The one thread that does this engine's loads (or saves), in order."""
        pool = self._threads.get(name)
        if pool is None:
            pool = self._threads[name] = ThreadPoolExecutor(
                1, thread_name_prefix=f"baton-kv-{name}-{self._engine_id}")
        return pool

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        record_kv_cache(self._engine_id, list(kv_caches.values()))
        self._bind_layers(list(kv_caches.values()))

    def _bind_layers(self, tensors: list[torch.Tensor]) -> None:
        """Views of each layer's cache with the block dimension first, and the arena viewed
        as ``[slot, layer, *block_shape]`` in the cache's dtype."""
        layers = [self._blocks_first(t) for t in tensors]
        block_shape = tuple(layers[0].shape[1:])
        dtype = layers[0].dtype
        for layer in layers:
            if tuple(layer.shape[1:]) != block_shape or layer.dtype != dtype:
                raise ValueError(
                    "BatonConnector needs every attention layer to share one KV block shape "
                    f"and dtype; got {tuple(layer.shape[1:])}/{layer.dtype} and "
                    f"{block_shape}/{dtype}"
                )
        per_layer_bytes = layers[0][0].numel() * layers[0].element_size()
        arena = self._store.arena
        if per_layer_bytes * len(layers) != arena.slot_bytes:
            raise ValueError(
                f"the KV store's slots hold {arena.slot_bytes} bytes but one block of this "
                f"engine is {per_layer_bytes * len(layers)} bytes ({len(layers)} layers x "
                f"{per_layer_bytes}); the store was sized for another model or block size"
            )
        self._layers = layers
        self._device = layers[0].device

    def _arena_view(self, arena_path: str) -> torch.Tensor | None:
        """The arena named ``arena_path`` viewed as ``[slot, layer, *block_shape]`` in the
        cache's dtype; None when the client no longer maps it (its store is gone). Called by
        the engine's thread and the transfer threads."""
        with self._arena_lock:
            return self._arena_view_locked(arena_path)

    def _arena_view_locked(self, arena_path: str) -> torch.Tensor | None:
        if arena_path and arena_path == self._arena_layers_path:
            return self._arena_layers
        arena = self._store.arena_for(arena_path)
        if arena is None:
            return None
        layer = self._layers[0]
        if layer[0].numel() * layer.element_size() * len(self._layers) != arena.slot_bytes:
            log.error("KV store arena %s holds slots of %d bytes, not this engine's blocks: "
                      "not using it", arena_path, arena.slot_bytes)
            return None
        # the previous view goes with this assignment, and with it the old mapping
        self._arena_layers = arena.slots.view(layer.dtype).view(
            arena.num_slots, len(self._layers), *layer.shape[1:])
        self._arena_layers_path = arena_path
        return self._arena_layers

    def _blocks_first(self, t: torch.Tensor) -> torch.Tensor:
        if self._num_gpu_blocks is None or t.shape[0] == self._num_gpu_blocks:
            return t
        if t.dim() > 1 and t.shape[1] == self._num_gpu_blocks:
            return t.transpose(0, 1)  # e.g. [2, num_blocks, ...] layouts
        raise ValueError(f"cannot find the block dimension in a KV cache of shape {tuple(t.shape)}")

    def _ensure_layers(self, forward_context: "ForwardContext") -> None:
        if self._layers:
            return
        tensors = []
        for layer in forward_context.no_compile_layers.values():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, list):
                kv = kv[0] if kv else None
            if isinstance(kv, torch.Tensor) and kv.numel() > 0:
                tensors.append(kv)
        self._bind_layers(tensors)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, BatonConnectorMetadata)
        if not meta.loads and not meta.saves:
            return
        self._ensure_layers(forward_context)
        if not meta.loads:
            return
        for load in meta.loads:
            if not load.on_step:  # copied while the engine steps; reported by ``get_finished``
                # one job each: a load is reported as soon as its own bytes have landed
                job = self._thread("load").submit(_inference(self._copy_in), [load])
                self._transfers.loading[load.request_id] = (job, load)
        on_step = [load for load in meta.loads if load.on_step]  # all land before the forward
        if not on_step:
            return
        landed = self._copy_in(on_step, "step")
        released: dict[str, list[BlockKey]] = {}
        for load in on_step:
            if landed[load.request_id]:
                self._loaded(load, released)
            else:  # pinned by a store that was replaced since: recompute
                self._fail_load(load)
        self._release(released)

    def _copy_in(self, loads: list[LoadSpec], thread: str = "load") -> dict[str, bool]:
        """Copy the pinned slots of ``loads`` into the engine's blocks with the copier of the
        calling ``thread`` (``_copier``): one copy per arena for all of them (``BlockCopier``
        gathers and scatters each layer once per chunk, not once per request). Per request,
        whether its bytes landed: False where its arena is gone."""
        by_arena: dict[str, list[LoadSpec]] = {}
        for load in loads:
            by_arena.setdefault(load.arena_path, []).append(load)
        landed: dict[str, bool] = {}
        for arena_path, group in by_arena.items():
            arena_layers = self._arena_view(arena_path)
            if arena_layers is not None:
                started = time.perf_counter()
                self._copier(thread).load(arena_layers,
                                          [slot for load in group for slot in load.slots],
                                          [block for load in group for block in load.block_ids]
                                          ).wait()
                self.stats.load_seconds += time.perf_counter() - started
            landed.update((load.request_id, arena_layers is not None) for load in group)
        return landed

    def _loaded(self, load: LoadSpec, released: dict[str, list[BlockKey]]) -> None:
        self.stats.loaded_blocks += len(load.slots)
        self.stats.loaded_bytes += len(load.slots) * sum(layer[0].nbytes for layer in self._layers)
        released.setdefault(load.arena_path, []).extend(load.keys + load.unpin_also)

    def _release(self, released: dict[str, list[BlockKey]]) -> None:
        for arena_path, keys in released.items():
            self._store.release(keys, arena_path)

    def _fail_load(self, load: LoadSpec) -> None:
        log.warning("request %s: %d KV blocks were pinned in a store that is gone; recomputing "
                    "them", load.request_id, len(load.block_ids))
        self._load_errors.update(load.block_ids)
        self.stats.failed_load_blocks += len(load.block_ids)
        self._step.failed_loads.add(load.request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, BatonConnectorMetadata)
        if not meta.saves:
            return
        requests = {save.request_id for save in meta.saves}
        if not self._async:
            self._apply(self._write(meta.saves))
            self._transfers.saving |= requests  # written: reported finished when vLLM is done
            return
        if self._saves_after_outputs:  # the runner opens it once this step's outputs are out
            self._step_gate.close()
            job = self._thread("save").submit(_inference(self._write_after_step), meta.saves)
        else:  # a prefill engine: the save is its hand-off, the critical path
            job = self._thread("save").submit(_inference(self._write), meta.saves)
        self._ledger.started(job)
        t = self._transfers
        t.saves.append((job, requests))
        t.saving |= requests
        for request_id in requests:
            t.open_saves[request_id] = t.open_saves.get(request_id, 0) + 1

    def _write_after_step(self, saves: list[SaveSpec]) -> _SaveOutcome:
        """``_write`` on the saving thread, once the step that handed ``saves`` off has
        delivered its outputs (``StepGate``: on a CPU engine the copy shares the engine's core,
        and the step's first tokens go first), or after ``SAVE_HOLD_MAX_S``."""
        self._step_gate.wait(SAVE_HOLD_MAX_S)
        return self._write(saves)

    def _write(self, saves: list[SaveSpec]) -> _SaveOutcome:
        """Reserve slots for ``saves`` (one store call for all; the synchronous baseline asked
        before the forward pass), copy the blocks into them and commit them (one call)."""
        outcome = _SaveOutcome()
        if saves[0].granted is None:
            grants = self._store.reserve_many([(save.keys, save.parents) for save in saves])
        else:
            grants = [save.granted.result() for save in saves]
        commits: dict[str, tuple[list[BlockKey], list[int]]] = {}  # arena -> keys, XXH3s
        current = -1  # the save being written: a failure there aborts its own slots
        try:
            for current, (save, granted) in enumerate(zip(saves, grants)):
                written, checksums = self._write_one(save, granted, outcome)
                if written:
                    keys, digests = commits.setdefault(granted.arena_path, ([], []))
                    keys.extend(written)
                    digests.extend(checksums)
                    self._ledger.add_stored(save.request_id, len(written))
        finally:
            # a save that failed aborted its own slots; the ones after it give theirs back
            for save, granted in list(zip(saves, grants))[current + 1:]:
                reserved = [key for key, slot in zip(save.keys, granted.slots) if slot is not None]
                if reserved and granted.arena_path:
                    self._store.abort(reserved, granted.arena_path)
            for arena_path, (keys, checksums) in commits.items():
                # readable by other processes once answered: the prefill worker waits for that
                # before its result returns (``StoreClient.unsettled_commits``)
                self._store.commit_later(keys, arena_path, self._commit_lost, checksums)
        return outcome

    def _write_one(self, save: SaveSpec, granted: StoreSlots,
                   outcome: _SaveOutcome) -> tuple[list[BlockKey], list[int]]:
        """Copy one request's granted blocks into their slots; the keys written and their
        payloads' XXH3s (``transfer_wire.block_checksum``), hashed here once the copy has
        landed: the store node keeps them, so it neither hashes a block at its first serve to
        a peer nor when it demotes it to disk."""
        if not granted.arena_path:  # the store is gone
            outcome.lost_blocks += len(save.keys)
            return [], []
        written = [(i, s) for i, s in enumerate(granted.slots) if s is not None]
        if not written:
            return [], []
        keys = [save.keys[i] for i, _ in written]
        try:
            arena_layers = self._arena_view(granted.arena_path)
            if arena_layers is None:
                self._store.abort(keys, granted.arena_path)
                outcome.dropped[save.request_id] = (outcome.dropped.get(save.request_id, 0)
                                                    + len(keys))
                return [], []
            if self.stats.crash_mid_save and len(written) >= 2:
                self._crash_halfway(arena_layers, save, written)
            self._copier("save").save(arena_layers, [save.block_ids[i] for i, _ in written],
                                      [s for _, s in written]).wait()
            checksums = [block_checksum(arena_layers[s].view(-1).view(torch.uint8).numpy())
                         for _, s in written]
        except BaseException:  # a live process gives its slots back (a dead one's: the store)
            self._store.abort(keys, granted.arena_path)
            raise
        outcome.saved_blocks += len(keys)
        return keys, checksums

    def _crash_halfway(self, arena_layers: torch.Tensor, save: SaveSpec,
                       written: list[tuple[int, int]]) -> None:
        """The drill's crash mid-transfer: half the blocks copied, none committed, then the
        process dies without a word (SIGKILL: no handler, no cleanup runs)."""
        half = written[:len(written) // 2]
        self._copier("save").save(arena_layers, [save.block_ids[i] for i, _ in half],
                                  [s for _, s in half]).wait()
        log.warning("drill: killing this engine's process mid-transfer (%d of %d blocks of %s "
                    "copied, none committed)", len(half), len(written), save.request_id)
        os.kill(os.getpid(), signal.SIGKILL)

    def _apply(self, outcome: _SaveOutcome) -> None:
        self.stats.saved_blocks += outcome.saved_blocks
        self.stats.dropped_save_blocks += outcome.lost_blocks
        for request_id, n in outcome.dropped.items():
            self._dropped(request_id, n)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """A preempted request's blocks are about to be reused: the saves reading them finish
        first."""
        jobs = [job for job, _ in self._transfers.saves]
        if jobs:
            wait_all(jobs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are written, requests whose loads have landed)."""
        if not self._async:
            return self._finished_sending(finished_req_ids), None
        t = self._transfers
        done = [(rid, entry) for rid, entry in t.loading.items() if entry[0].done()]
        released: dict[str, list[BlockKey]] = {}
        for request_id, (job, load) in done:
            del t.loading[request_id]
            try:
                landed = job.result()[request_id]
            except Exception:  # a copy that failed: its blocks are recomputed
                log.exception("request %s: copying %d KV blocks in failed", request_id,
                              len(load.block_ids))
                landed = False
                released.setdefault(load.arena_path, []).extend(load.keys + load.unpin_also)
            if landed:
                self._loaded(load, released)
            else:
                self._fail_load(load)
        self._release(released)
        still = []
        for job, requests in t.saves:
            if not job.done():
                still.append((job, requests))
                continue
            try:
                self._apply(job.result())
            except Exception:
                log.exception("saving KV blocks of %s failed", sorted(requests))
            for request_id in requests:
                t.open_saves[request_id] -= 1
                if not t.open_saves[request_id]:
                    del t.open_saves[request_id]
        t.saves = still
        return self._finished_sending(finished_req_ids), {rid for rid, _ in done} or None

    def _finished_sending(self, finished_req_ids: Iterable[str]) -> set[str] | None:
        """The finished requests with saves (vLLM holds their blocks) whose saves are done."""
        t = self._transfers
        t.finished.update(r for r in finished_req_ids if r in t.saving)
        sending = {r for r in t.finished if r not in t.open_saves}
        t.finished -= sending
        t.saving -= sending
        return sending or None

    def _commit_lost(self, num_blocks: int) -> None:
        """A commit found its store gone: the blocks are dropped (counted for the engine; the
        request that wrote them may have reported them stored already)."""
        self.stats.saved_blocks -= num_blocks
        self.stats.dropped_save_blocks += num_blocks

    def _dropped(self, request_id: str, num_blocks: int) -> None:
        self.stats.dropped_save_blocks += num_blocks
        dropped = self._step.dropped_blocks
        dropped[request_id] = dropped.get(request_id, 0) + num_blocks

    def build_connector_worker_meta(self) -> BatonWorkerMetadata | None:
        news, self._step = self._step, BatonWorkerMetadata()
        return news if news.failed_loads or news.dropped_blocks else None
