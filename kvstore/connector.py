"""Baton's vLLM KV connector: prompt KV blocks in and out of the node's host tier.

Roles (``kv_transfer_config.kv_role``):

- ``kv_producer``: every prompt block a step completes that is not yet in the store is written
  into a host-tier slot (two-phase: reserve before the forward pass, copy and commit after it).
- ``kv_consumer`` (decode): before scheduling a new request, the longest run of its full prompt
  blocks that the store holds (beyond vLLM's own prefix cache) is pinned and copied into the
  engine's paged KV cache, so the engine computes only the rest.
- ``kv_both`` (prefill): both, so a prefix another instance computed is loaded, not recomputed.

Blocks are named by Baton's chain-hashed keys (``kvstore.keys``), never by vLLM's own hashes,
so a producer and a consumer in different processes agree on them. The keys come hashed from
the gateway with the request (vLLM's per-request ``kv_transfer_params``); a request without
them (an engine driven directly) is hashed here. Full blocks and the prompt's partial tail are
stored.

The scheduler half decides, the worker half moves bytes. Loads: the scheduler half pins the
blocks it promises to vLLM (``get_num_new_matched_tokens``, the one store call a request waits
for); the pin travels with the connector metadata to the worker half, which copies the blocks
and releases the pin without waiting. Pins of requests that never got to load are released by
the scheduler half. Saves: the scheduler half reserves a step's slots without waiting
(``build_connector_meta``); the worker half takes the answer after the forward pass, copies,
and commits without waiting (the prefill worker waits for its commits before its result
returns, so a decode elsewhere finds the blocks). A request whose placement expects nothing
cached is not looked up at all.

What the connector did for one request (tokens loaded, blocks stored) is returned by
``request_finished`` and reaches the request's last ``RequestOutput`` (``request_transfer``);
the worker half's news of a step (failed loads, unwritten blocks) reaches the scheduler half
through ``build_connector_worker_meta``. Per-engine totals are ``connector_stats``.

The store node may die and come back as a new process (``kvstore.client``): meanwhile a lookup
is a miss and a save is dropped (``ConnectorStats.dropped_save_blocks``); every pin and every
load names the arena it was granted in, so a load whose arena is no longer mapped fails block by
block (``get_block_ids_with_load_errors``; vLLM recomputes them, ``kv_load_failure_policy``
"recompute") instead of reading another store's bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvstore.client import PendingSlots, shared_store_client
from kvstore.keys import BlockKey, KeyExtras, kv_layout_tag, prompt_block_keys, unpack_keys
from protos.wire import EngineRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


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


log = logging.getLogger(__name__)
_STATS: dict[str, ConnectorStats] = {}


def connector_stats(engine_id: str) -> ConnectorStats:
    """The per-engine totals of the connector built for ``engine_id`` in this process (the two
    halves of one engine's connector add to the same totals). What the connector did for one
    request travels with that request instead (``request_transfer``)."""
    return _STATS.setdefault(engine_id, ConnectorStats())


PARAMS_KEY = "baton"
"""Baton's entry in a request's vLLM ``kv_transfer_params`` (``SamplingParams.extra_args``)."""


def request_transfer_params(request: EngineRequest) -> dict[str, Any] | None:
    """What the connector needs of ``request`` beyond its tokens, as vLLM carries it per request
    (``SamplingParams.extra_args["kv_transfer_params"]`` becomes ``Request.kv_transfer_params``):
    the prompt's block keys hashed at the gateway, and whether to look its blocks up in the
    store at all. None when there is nothing to carry."""
    carried: dict[str, Any] = {}
    blocks = request.blocks
    if blocks is not None:
        carried.update(model_id=blocks.model_id, kv_layout=blocks.kv_layout,
                       block_size=blocks.block_size_tokens, keys=blocks.keys)
    if not request.store_lookup:
        carried["lookup"] = False
    return {PARAMS_KEY: carried} if carried else None


@dataclass(frozen=True)
class RequestTransfer:
    """What the connector did for one request, as vLLM returns it with the request's last
    output (``request_finished``'s kv_transfer_params become ``RequestOutput.kv_transfer_params``)."""

    num_loaded_tokens: int = 0
    """Prompt tokens whose KV was loaded from the store instead of computed."""
    num_stored_blocks: int = 0
    """Prompt blocks the store granted this request to write, and the connector wrote."""


def request_transfer(output: Any) -> RequestTransfer:
    """The ``RequestTransfer`` a finished vLLM ``RequestOutput`` carries (zeros without one)."""
    params = getattr(output, "kv_transfer_params", None)
    done = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(done, dict):
        return RequestTransfer()
    return RequestTransfer(int(done.get("loaded_tokens", 0)), int(done.get("stored_blocks", 0)))


def _carried(request: "Request") -> dict[str, Any]:
    params = request.kv_transfer_params
    carried = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    return carried if isinstance(carried, dict) else {}


@dataclass
class LoadSpec:
    request_id: str
    block_ids: list[int]
    slots: list[int]
    keys: list[BlockKey]
    arena_path: str
    """The arena ``slots`` index (the store that pinned them)."""


@dataclass
class SaveSpec:
    """Blocks to write this step: the scheduler half asked the store for their slots before
    the forward pass (``granted``: one per key once answered, None where the store holds the
    block already or has no room); the worker half waits for the answer after it."""

    request_id: str
    block_ids: list[int]
    keys: list[BlockKey]
    granted: PendingSlots


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


@dataclass
class _RequestState:
    """``keys`` name the prompt's blocks in order: every full block, then the partial tail
    block if the prompt does not end on a block boundary."""

    keys: list[BlockKey]
    num_prompt_tokens: int
    lookup: bool = True
    """False: the placement expects nothing cached, so the store is not asked (a round trip)."""
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0
    pinned: list[BlockKey] = field(default_factory=list)
    pinned_slots: list[int] = field(default_factory=list)
    pinned_arena: str = ""
    first_load_block: int = 0
    num_loaded_tokens: int = 0
    reservations: list[PendingSlots] = field(default_factory=list)
    """Every save reservation made for the request (answered by the time it finishes)."""
    num_dropped_blocks: int = 0
    """Granted blocks the worker half could not write (its news of steps before the last)."""

    def num_stored_blocks(self) -> int:
        granted = (r.result() for r in self.reservations)
        return sum(sum(s is not None for s in g.slots) for g in granted if g.arena_path) - (
            self.num_dropped_blocks)


class BatonConnector(KVConnectorBase_V1):
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
        self._store = shared_store_client(extra["store_actor"], extra["namespace"])
        self.stats = connector_stats(self._engine_id)
        # scheduler half
        self._requests: dict[str, _RequestState] = {}
        self._loads_ready: list[LoadSpec] = []
        # worker half
        self._layers: list[torch.Tensor] = []
        self._device = torch.device("cpu")
        self._arena_layers: torch.Tensor | None = None
        self._arena_layers_path = ""
        self._load_errors: set[int] = set()
        self._step = BatonWorkerMetadata()  # this step's news for the scheduler half

    # ---------------------------------------------------------------- scheduler half

    def _state(self, request: "Request") -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = request.prompt_token_ids or []
            state = _RequestState(keys=self._prompt_keys(request, prompt),
                                  num_prompt_tokens=len(prompt),
                                  lookup=_carried(request).get("lookup", True) is not False)
            self._requests[request.request_id] = state
        return state

    def _prompt_keys(self, request: "Request", prompt: list[int]) -> list[BlockKey]:
        """The keys the request carries from the gateway when they were made under this
        engine's scheme and name every block of this prompt; else the prompt hashed here (an
        engine driven directly, or a gateway on another scheme)."""
        carried = _carried(request)
        if carried.get("keys") is not None:
            scheme = (carried.get("model_id"), carried.get("kv_layout"), carried.get("block_size"))
            keys = unpack_keys(carried["keys"])
            if scheme == (self._model_id, self._kv_layout, self._block_size) and (
                    len(keys) == -(-len(prompt) // self._block_size)):
                return keys
            log.warning("request %s carries block keys of another scheme (%s) than this engine's "
                        "(%s); hashing its prompt here", request.request_id, scheme,
                        (self._model_id, self._kv_layout, self._block_size))
        self.stats.hashed_prompts += 1
        extras = KeyExtras(model_id=self._model_id, cache_salt=request.cache_salt or "",
                           kv_layout=self._kv_layout)
        return prompt_block_keys(prompt, self._block_size, extras)

    def _unpin(self, state: _RequestState) -> None:
        self._store.release(state.pinned, state.pinned_arena)
        state.pinned, state.pinned_slots, state.pinned_arena = [], [], ""

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        if not self._loads or not state.lookup:
            return 0, False
        self._unpin(state)  # a request that was not scheduled last time asks again
        first_block = num_computed_tokens // self._block_size
        candidates = state.keys[first_block:]
        self.stats.lookups_blocks += len(candidates)
        if not candidates:
            return 0, False
        held = self._store.acquire(candidates)
        slots = held.slots
        self.stats.hits_blocks += len(slots)
        # vLLM must compute at least the last prompt token itself.
        covered = min((first_block + len(slots)) * self._block_size, state.num_prompt_tokens)
        load_end = min(covered, state.num_prompt_tokens - 1)
        num_external = load_end - num_computed_tokens
        if num_external <= 0:
            self._store.release(candidates[: len(slots)], held.arena_path)
            return 0, False
        num_blocks = -(-num_external // self._block_size)
        self._store.release(candidates[num_blocks : len(slots)], held.arena_path)
        state.pinned, state.pinned_slots = candidates[:num_blocks], slots[:num_blocks]
        state.pinned_arena = held.arena_path
        state.first_load_block = first_block
        return num_external, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or not state.pinned:
            return
        if num_external_tokens == 0:
            self._unpin(state)
            return
        block_ids = blocks.get_block_ids()[0]
        start = state.first_load_block
        self._loads_ready.append(
            LoadSpec(
                request_id=request.request_id,
                block_ids=block_ids[start : start + len(state.pinned)],
                slots=state.pinned_slots,
                keys=state.pinned,
                arena_path=state.pinned_arena,
            )
        )
        state.num_loaded_tokens = num_external_tokens
        # the worker half releases them now
        state.pinned, state.pinned_slots, state.pinned_arena = [], [], ""

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = BatonConnectorMetadata(loads=self._loads_ready)
        self._loads_ready = []
        if not self._saves:
            return meta
        computed: dict[str, int] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new_req.req_id)
            if state is not None:
                state.block_ids = list(new_req.block_ids[0])
                computed[new_req.req_id] = new_req.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, num_computed in computed.items():
            state = self._requests[req_id]
            done_tokens = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            done_tokens = min(done_tokens, state.num_prompt_tokens)
            # full blocks once computed; the partial tail once the whole prompt is
            full_blocks = -(-done_tokens // self._block_size) if (
                done_tokens == state.num_prompt_tokens) else done_tokens // self._block_size
            full_blocks = min(full_blocks, len(state.keys), len(state.block_ids))
            if full_blocks <= state.saved_blocks:
                continue
            first = state.saved_blocks
            keys = state.keys[first:full_blocks]
            parents = [state.keys[i - 1] if i > 0 else None for i in range(first, full_blocks)]
            # answered during the forward pass; the worker half waits for it after
            granted = self._store.reserve_later(keys, parents)
            state.saved_blocks = full_blocks
            state.reservations.append(granted)
            meta.saves.append(SaveSpec(req_id, state.block_ids[first:full_blocks], keys, granted))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        news = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(news, BatonWorkerMetadata):
            return
        for request_id in news.failed_loads:  # a failed load fails in a step before the last
            state = self._requests.get(request_id)
            if state is not None:
                state.num_loaded_tokens = 0
        for request_id, n in news.dropped_blocks.items():
            state = self._requests.get(request_id)
            if state is not None:  # (after its last step the request has reported already)
                state.num_dropped_blocks += n

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Returns what the connector did for the request, which vLLM hands back with its last
        output (``request_transfer`` reads it)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        if state.pinned:
            self._unpin(state)
        return False, {PARAMS_KEY: {"loaded_tokens": state.num_loaded_tokens,
                                    "stored_blocks": state.num_stored_blocks()}}

    # ---------------------------------------------------------------- worker half

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
