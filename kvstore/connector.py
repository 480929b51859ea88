"""Baton's vLLM KV connector: prompt KV blocks in and out of the node's host tier.

Roles (``kv_transfer_config.kv_role``):

- ``kv_producer``: every prompt block a step completes that is not yet in the store is written
  into a host-tier slot.
- ``kv_consumer``: before scheduling a new request, the longest run of its full prompt blocks
  that the store holds (beyond vLLM's own prefix cache) is pinned and copied into the engine's
  paged KV cache, so the engine computes only the rest.
- ``kv_both`` (prefill and decode engines): both, so a prefix another instance computed is
  loaded, not recomputed, and what this engine computed (a co-located prefill's prompt, the
  blocks a finished request's output completed) can be loaded by the others.

Blocks are named by Baton's chain-hashed keys (``kvstore.keys``), never by vLLM's own hashes,
so a producer and a consumer in different processes agree on them. The keys come hashed from
the gateway with the request (vLLM's per-request ``kv_transfer_params``); a request without
them (an engine driven directly) is hashed here. Full blocks and the prompt's partial tail are
stored.

The scheduler half decides, the worker half moves bytes, and with asynchronous transfers (the
default, ``async_transfers`` in the connector's extra config) neither waits on the engine's
step: an engine step's lookups go to the store in one call sent without waiting, a hit is
loaded by vLLM's asynchronous-load path (the request waits for its KV while the other sequences
keep decoding; the worker half copies it on its loading thread and reports it once landed), and
a step's saves are reserved, copied and committed in one job on the saving thread, vLLM holding
a finished request's blocks until they are written. The prefill worker waits for its saves
(``save_ledger``) and their commits before its result returns, so a decode elsewhere finds the
blocks. The synchronous baseline (``async_transfers`` false) does the lookups, copies and
reservations on the step. A request whose placement expects nothing cached is not looked up.

What the connector did for one request (tokens loaded, blocks stored) is returned by
``request_finished`` and reaches the request's last ``RequestOutput`` (``request_transfer``);
the worker half's news of a step (failed loads, unwritten blocks) reaches the scheduler half
through ``build_connector_worker_meta``. Per-engine totals are ``connector_stats``.

The store node may die and come back as a new process (``kvstore.client``): meanwhile a lookup
is a miss and a save is dropped (``ConnectorStats.dropped_save_blocks``); every pin and every
load names the arena it was granted in, so a load whose arena is no longer mapped fails block by
block (``get_block_ids_with_load_errors``; vLLM recomputes them, ``kv_load_failure_policy``
"recompute") instead of reading another store's bytes.

This module holds the class vLLM loads (``kv_connector_module_path="kvstore.connector"``,
``kv_connector="BatonConnector"``) and re-exports what other rooms import from it. The pieces
live beside it: the types the halves exchange and the per-engine totals in
``kvstore.connector_meta``, the scheduler half in ``kvstore.connector_scheduler``, the worker
half in ``kvstore.connector_worker``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from kvstore.client import shared_store_client
from kvstore.connector_meta import (
    PARAMS_KEY,
    BatonConnectorMetadata,
    BatonWorkerMetadata,
    ConnectorStats,
    LoadSpec,
    RequestTransfer,
    SaveSpec,
    connector_stats,
    request_transfer,
    request_transfer_params,
    save_ledger,
    step_gate,
)
from kvstore.connector_scheduler import (
    LOOKUP_WAIT_FRACTION,
    LOOKUP_WAIT_MAX_S,
    SYNC_LOAD_FRACTION,
    ConnectorSchedulerHalf,
    _RequestState,
)
from kvstore.connector_worker import ConnectorWorkerHalf, _Transfers
from kvstore.keys import BlockKey, kv_layout_tag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "PARAMS_KEY",
    "BatonConnector",
    "BatonConnectorMetadata",
    "BatonWorkerMetadata",
    "ConnectorStats",
    "LoadSpec",
    "RequestTransfer",
    "SaveSpec",
    "connector_stats",
    "kv_layout_tag",
    "request_transfer",
    "request_transfer_params",
    "save_ledger",
    "step_gate",
    "_RequestState",
]


class BatonConnector(ConnectorSchedulerHalf, ConnectorWorkerHalf, KVConnectorBase_V1):
    """Both halves of one engine's connector; vLLM builds one per role (scheduler, worker) and
    calls each half's methods on its own instance. The state both halves use is set here."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = cfg.kv_connector_extra_config or {}
        self._block_size = vllm_config.cache_config.block_size
        self._num_gpu_blocks = kv_cache_config.num_blocks if kv_cache_config else None
        self._engine_id = str(extra["engine_id"])
        self._model_id = str(extra["model_id"])
        self._kv_layout = kv_layout_tag(str(vllm_config.model_config.dtype), self._block_size)
        self._saves = cfg.kv_role in ("kv_producer", "kv_both")
        self._loads = cfg.kv_role in ("kv_consumer", "kv_both")
        self._async = bool(extra.get("async_transfers", True))
        self._save_whole_prompts = bool(extra.get("save_whole_prompts", False))
        self._sync_load_fraction = float(extra.get("sync_load_step_fraction", SYNC_LOAD_FRACTION))
        self._lookup_wait_fraction = float(extra.get("lookup_wait_step_fraction", LOOKUP_WAIT_FRACTION))
        self._lookup_wait_max_s = float(extra.get("lookup_wait_max_s", LOOKUP_WAIT_MAX_S))
        self._store = shared_store_client(extra["store_actor"], extra["namespace"])
        self.stats = connector_stats(self._engine_id)
        # scheduler half
        self._requests: dict[str, _RequestState] = {}
        self._loads_ready: list[LoadSpec] = []
        self._lookups_unsent: list[_RequestState] = []
        self._final_saves: list[SaveSpec] = []
        self._releases: dict[str, list[BlockKey]] = {}
        self._stepping = False
        self._step_s = 0.05
        self._last_meta_at = 0.0
        # worker half
        self._layers: list[torch.Tensor] = []
        self._device = torch.device("cpu")
        self._arena_layers: torch.Tensor | None = None
        self._arena_layers_path = ""
        self._load_errors: set[int] = set()
        self._step = BatonWorkerMetadata()  # this step's news for the scheduler half
        self._ledger = save_ledger(self._engine_id)
        self._step_gate = step_gate(self._engine_id)
        self._saves_after_outputs = bool(extra.get("saves_after_outputs", False))
        self._transfers = _Transfers()
        self._arena_lock = threading.Lock()
        self._threads = {}
        self._copiers = {}
