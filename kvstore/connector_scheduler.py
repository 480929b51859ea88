"""The scheduler half of ``BatonConnector``: it decides, and moves no bytes.

Per request it keeps the prompt's block keys (carried from the gateway, else hashed here) and
what was pinned, loaded and reserved for it. ``get_num_new_matched_tokens`` pins the store's
run of the prompt's blocks (the one store call a request waits for); ``update_state_after_alloc``
turns the pin into a ``LoadSpec`` for the worker half, which releases it; ``build_connector_meta``
reserves each step's newly computed blocks without waiting (``SaveSpec``);
``update_connector_output`` takes the worker half's news; ``request_finished`` releases a pin
that never loaded and returns what was done for the request.

A mixin of ``BatonConnector``, which sets the attributes declared below in its ``__init__``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.client import PendingSlots, StoreClient
from kvstore.connector_meta import (
    PARAMS_KEY,
    BatonConnectorMetadata,
    BatonWorkerMetadata,
    ConnectorStats,
    LoadSpec,
    SaveSpec,
)
from kvstore.keys import BlockKey, KeyExtras, prompt_block_keys, unpack_keys

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connector")  # one logger for the connector, whichever half logs


def _carried(request: "Request") -> dict[str, Any]:
    params = request.kv_transfer_params
    carried = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    return carried if isinstance(carried, dict) else {}


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


class ConnectorSchedulerHalf:
    """The scheduler half's methods of ``KVConnectorBase_V1``."""

    _block_size: int
    _model_id: str
    _kv_layout: str
    _saves: bool
    _loads: bool
    _store: StoreClient
    stats: ConnectorStats
    _requests: dict[str, _RequestState]
    _loads_ready: list[LoadSpec]

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
