"""The worker half of ``BatonConnector``: it moves bytes between the engine's paged KV cache
and the store's host arena, as the scheduler half's metadata for the step says.

``start_load_kv`` copies each ``LoadSpec``'s pinned slots into the engine's blocks before the
forward pass and releases the pins without waiting; a load whose arena is no longer mapped
fails block by block (``get_block_ids_with_load_errors``) and is recomputed. ``wait_for_save``
takes each ``SaveSpec``'s granted slots after the forward pass, copies the blocks into them and
commits without waiting. What went wrong in a step reaches the scheduler half through
``build_connector_worker_meta``.

A mixin of ``BatonConnector``, which sets the attributes declared below in its ``__init__``;
``_get_connector_metadata`` is ``KVConnectorBase_V1``'s.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvstore.client import StoreClient
from kvstore.connector_meta import (
    BatonConnectorMetadata,
    BatonWorkerMetadata,
    ConnectorStats,
    LoadSpec,
)
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

log = logging.getLogger("kvstore.connector")  # one logger for the connector, whichever half logs


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

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
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
        cache's dtype; None when the client no longer maps it (its store is gone)."""
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
        released: dict[str, list[BlockKey]] = {}
        started = time.perf_counter()
        for load in meta.loads:
            arena_layers = self._arena_view(load.arena_path)
            if arena_layers is None:  # pinned by a store that was replaced since: recompute
                self._fail_load(load)
                continue
            slots = torch.tensor(load.slots, dtype=torch.long)
            # the arena is host memory; on GPUs the engine's cache is device memory
            block_ids = torch.tensor(load.block_ids, dtype=torch.long, device=self._device)
            for index, layer in enumerate(self._layers):
                layer[block_ids] = arena_layers[slots, index].to(self._device)
            self.stats.loaded_blocks += len(load.slots)
            self.stats.loaded_bytes += len(load.slots) * sum(layer[0].nbytes for layer in self._layers)
            released.setdefault(load.arena_path, []).extend(load.keys)
        self.stats.load_seconds += time.perf_counter() - started
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
        for save in meta.saves:
            granted = save.granted.result()
            if not granted.arena_path:  # the store is gone
                self.stats.dropped_save_blocks += len(save.keys)
                continue
            written = [(i, s) for i, s in enumerate(granted.slots) if s is not None]
            if not written:
                continue
            keys = [save.keys[i] for i, _ in written]
            arena_path = granted.arena_path
            arena_layers = self._arena_view(arena_path)
            if arena_layers is None:
                self._store.abort(keys, arena_path)
                self._dropped(save.request_id, len(keys))
                continue
            try:
                src = torch.tensor([save.block_ids[i] for i, _ in written], dtype=torch.long,
                                   device=self._device)
                dst = torch.tensor([s for _, s in written], dtype=torch.long)
                for index, layer in enumerate(self._layers):
                    arena_layers[dst, index] = layer[src].to("cpu")
            except BaseException:
                self._store.abort(keys, arena_path)
                raise
            # readable by other processes once answered: the prefill worker waits for that
            # before its result returns (``StoreClient.unsettled_commits``)
            self.stats.saved_blocks += len(written)
            self._store.commit_later(keys, arena_path, self._commit_lost)

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
