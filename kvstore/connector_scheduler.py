"""The scheduler half of ``BatonConnector``: it decides, and moves no bytes.

Per request it keeps the prompt's block keys (carried from the gateway, else hashed here) and
what was pinned, loaded and saved for it.

Loads (``get_num_new_matched_tokens``): with asynchronous transfers (the default) the lookups of
an engine step's new requests go to the store in one call, sent without waiting; a request
whose answer has not arrived yet is asked again on a later step (vLLM skips it meanwhile), so
the scheduler thread never waits on the store while other sequences step (when nothing steps,
it waits: that costs no one). A hit is loaded asynchronously: the request waits for its KV
(``WAITING_FOR_REMOTE_KVS``) while the others keep decoding, until the worker half reports the
copy finished. ``update_state_after_alloc`` turns the pin into a ``LoadSpec`` for the worker
half, which releases it once copied. The synchronous baseline (``async_transfers`` off) asks
the store and waits, and has the worker half copy before the forward pass.

Saves (``build_connector_meta``): each step's newly computed prompt blocks become ``SaveSpec``s
(a decode engine's, by default, one ``SaveSpec`` once the whole prompt is computed:
``engine.decode_saves``); the worker half reserves, copies and commits them off the step. When a request finishes, the
full blocks its output completed are saved too (an agent's next step, prompt = this prompt +
reply + tool result, loads the reply's KV instead of recomputing it); ``request_finished`` then
holds the request's blocks until the worker half reports them written. Blocks the store held at
the request's lookup are never saved again.

A mixin of ``BatonConnector``, which sets the attributes declared below in its ``__init__``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.client import PendingRuns, PendingSlots, StoreClient
from kvstore.connector_meta import (
    PARAMS_KEY,
    BatonConnectorMetadata,
    BatonWorkerMetadata,
    ConnectorStats,
    LoadSpec,
    SaveSpec,
)
from kvstore.keys import (
    BlockKey,
    KeyExtras,
    continue_keys,
    first_salted_block,
    prompt_block_keys,
    unpack_keys,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connector")

LOOKUP_WAIT_FRACTION = 0.05
"""While other sequences step, a new request's lookup answer is waited for at most this
fraction of a step (capped by ``LOOKUP_WAIT_MAX_S``): normally answered within it (a local
round trip), it saves the request a whole step; else it is asked again next step. The
defaults of ``engine.kv_lookup_wait_step_fraction`` / ``kv_lookup_wait_max_ms``, which the
connector's extra config carries."""
LOOKUP_WAIT_MAX_S = 0.003
SYNC_LOAD_FRACTION = 0.1
"""A load whose copy takes at most this fraction of a step is copied on the step (the running
sequences wait that long, once); a longer one is loaded asynchronously. The default of
``engine.kv_sync_load_step_fraction``."""
ASSUMED_COPY_BYTES_PER_S = 2e9
"""The copy speed assumed until the engine has measured its own."""
STEP_EWMA = 0.2  # one logger for the connector, whichever half logs


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
    save: bool = True
    """False: none of its blocks is written to the store (``EngineRequest.store_save``)."""
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0
    pinned: list[BlockKey] = field(default_factory=list)
    pinned_slots: list[int] = field(default_factory=list)
    pinned_arena: str = ""
    first_load_block: int = 0
    num_loaded_tokens: int = 0
    num_disk_tokens: int = 0
    """Of ``num_loaded_tokens``, those in blocks the store brought back from disk for it."""
    promoted_blocks: set[int] = field(default_factory=set)
    """Prompt block positions the store promoted from disk to answer this request's lookups
    (kept across lookups: asked again, it finds them in host memory)."""
    pinned_disk_tokens: int = 0
    """Of the pinned blocks' tokens to load, those in ``promoted_blocks``."""
    reservations: list[PendingSlots] = field(default_factory=list)
    """Every save reservation made for the request (answered by the time it finishes)."""
    num_dropped_blocks: int = 0
    """Granted blocks the worker half could not write (its news of steps before the last)."""
    lookup_sent: PendingRuns | None = None
    """The store's answer to this request's lookup (asynchronous transfers), until used."""
    lookup_index: int = 0
    """This request's place in ``lookup_sent`` (one call answers a step's new requests)."""
    unpin_also: list[BlockKey] = field(default_factory=list)
    """Pinned by the lookup, not loaded: unpinned with the pinned blocks."""
    known_stored: int = 0
    """Leading prompt blocks the store held at the lookup: never saved again."""
    load_on_step: bool = True
    """The pinned blocks are copied on the step, before its forward pass (not asynchronously)."""
    has_saves: bool = False
    """A ``SaveSpec`` was handed to the worker half: it reports when the blocks are written."""

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
    _async: bool
    _lookups_unsent: list[_RequestState]
    _final_saves: list[SaveSpec]
    _save_whole_prompts: bool = False
    """A decode engine's ``engine.decode_saves: per_prompt``: a prompt's blocks are saved in one
    ``SaveSpec`` once the whole prompt is computed, not step by step."""
    _releases: dict[str, list[BlockKey]]
    _stepping: bool
    """The last step scheduled work: a wait on the store now would hold running sequences."""
    _step_s: float
    """How long the engine's steps take (an exponential average of the last ones), in s."""
    _last_meta_at: float

    def _state(self, request: "Request") -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = request.prompt_token_ids or []
            carried = _carried(request)
            state = _RequestState(keys=self._prompt_keys(request, prompt),
                                  num_prompt_tokens=len(prompt),
                                  lookup=carried.get("lookup", True) is not False,
                                  save=carried.get("save", True) is not False)
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
        return prompt_block_keys(prompt, self._block_size, self._key_extras(request))

    def _key_extras(self, request: "Request") -> KeyExtras:
        """The store's key scheme for ``request``: this engine's, with the request's salt from
        the offset it carries (``kvstore.keys``: segmented salts; vLLM's own cache keeps the
        whole-prompt salt)."""
        offset = _carried(request).get("cache_salt_offset", 0)
        return KeyExtras(model_id=self._model_id, cache_salt=request.cache_salt or "",
                         kv_layout=self._kv_layout,
                         salt_from_block=first_salted_block(int(offset), self._block_size))

    def _unpin_keys(self, keys: list[BlockKey], arena_path: str) -> None:
        """Unpin ``keys``: with asynchronous transfers, together with the step's other unpins
        (sent once the step is scheduled, ``build_connector_meta``)."""
        if not self._async:
            self._store.release(keys, arena_path)
        elif keys:
            self._releases.setdefault(arena_path, []).extend(keys)

    def _send_unpins(self) -> None:
        releases, self._releases = self._releases, {}
        for arena_path, keys in releases.items():
            self._store.release(keys, arena_path)

    def _unpin(self, state: _RequestState) -> None:
        self._unpin_keys(state.pinned + state.unpin_also, state.pinned_arena)
        state.unpin_also = []
        state.pinned, state.pinned_slots, state.pinned_arena = [], [], ""

    def on_new_request(self, request: "Request") -> None:
        if not self._async:
            return
        state = self._state(request)
        if self._loads and state.lookup and state.keys:
            self._lookups_unsent.append(state)

    def _send_lookups(self) -> None:
        """One store call for every lookup not yet sent (an engine step's new requests)."""
        unsent, self._lookups_unsent = self._lookups_unsent, []
        states = list({id(st): st for st in unsent if st.lookup_sent is None}.values())
        if not states:
            return
        pending = self._store.acquire_many_later([st.keys for st in states])
        for index, st in enumerate(states):
            st.lookup_sent, st.lookup_index = pending, index

    def _looked_up(self, state: _RequestState) -> tuple[list[int], str] | None:
        """The slots of the run the store holds from the prompt's first block, pinned, and
        their arena (the blocks it promoted from disk for them go to ``state.promoted_blocks``);
        None while the answer is on its way (asynchronous transfers). The synchronous baseline
        asks and waits."""
        if not self._async:
            held = self._store.acquire(state.keys)
            state.promoted_blocks.update(held.promoted)
            return held.slots, held.arena_path
        if state.lookup_sent is None:  # asked again after a preemption, or never sent
            self._lookups_unsent.append(state)
        self._send_lookups()
        pending = state.lookup_sent
        if self._stepping and not pending.ready(min(self._lookup_wait_fraction * self._step_s,
                                                    self._lookup_wait_max_s)):
            return None  # vLLM asks again next step; the others step meanwhile
        answer = pending.result()[state.lookup_index]
        state.lookup_sent = None
        state.promoted_blocks.update(answer.promoted)
        return answer.slots, answer.arena_path

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        if not self._loads or not state.lookup or not state.keys:
            return 0, False
        self._unpin(state)  # a request that was not scheduled last time asks again
        looked_up = self._looked_up(state)
        if looked_up is None:
            return None, False
        slots, arena_path = looked_up
        first_block = num_computed_tokens // self._block_size
        candidates = state.keys[first_block:]
        self.stats.lookups_blocks += len(candidates)
        state.known_stored = max(state.known_stored, len(slots))
        hits = max(0, len(slots) - first_block)
        self.stats.hits_blocks += hits
        # vLLM must compute at least the last prompt token itself.
        covered = min((first_block + hits) * self._block_size, state.num_prompt_tokens)
        load_end = min(covered, state.num_prompt_tokens - 1)
        num_external = load_end - num_computed_tokens
        if num_external <= 0:
            self._unpin_keys(state.keys[: len(slots)], arena_path)
            return 0, False
        num_blocks = -(-num_external // self._block_size)
        # keep the pins of the blocks to load; the rest (locally cached, or not needed) go back
        # with them, once loaded (one unpin for the request)
        keep = slice(first_block, first_block + num_blocks)
        state.unpin_also = state.keys[: first_block] + state.keys[keep.stop : len(slots)]
        state.pinned, state.pinned_slots = state.keys[keep], slots[keep]
        state.pinned_arena = arena_path
        state.first_load_block = first_block
        state.pinned_disk_tokens = self._disk_tokens(state, num_computed_tokens, load_end)
        state.load_on_step = not self._async or self._cheap_on_step(num_blocks)
        return num_external, not state.load_on_step

    def _disk_tokens(self, state: _RequestState, start_token: int, end_token: int) -> int:
        """Tokens in ``[start_token, end_token)`` (what is loaded) whose blocks the store
        promoted from disk for the request."""
        size = self._block_size
        return sum(max(0, min(end_token, (i + 1) * size) - max(start_token, i * size))
                   for i in state.promoted_blocks)

    def _cheap_on_step(self, num_blocks: int) -> bool:
        """Whether copying ``num_blocks`` blocks on the step (before its forward pass) costs the
        running sequences less than ``SYNC_LOAD_FRACTION`` of a step. Such a load is copied on
        the step: an asynchronous load costs its own request two steps (copied during one,
        scheduled on the next). Nothing running: always on the step (it holds no one)."""
        if not self._stepping:
            return True
        copied = self.stats.loaded_bytes
        speed = copied / self.stats.load_seconds if copied and self.stats.load_seconds else (
            ASSUMED_COPY_BYTES_PER_S)
        arena = self._store.arena  # one slot holds one block of every layer
        nbytes = num_blocks * (arena.slot_bytes if arena is not None else 0)
        return nbytes / speed <= self._sync_load_fraction * self._step_s

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
                unpin_also=state.unpin_also,
                on_step=state.load_on_step,
            )
        )
        state.unpin_also = []
        state.num_loaded_tokens = num_external_tokens
        state.num_disk_tokens = min(state.pinned_disk_tokens, num_external_tokens)
        # the worker half releases them now
        state.pinned, state.pinned_slots, state.pinned_arena = [], [], ""

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        self._send_lookups()
        self._send_unpins()
        now = time.monotonic()
        if self._stepping and self._last_meta_at:  # the step just ended: how long steps take
            self._step_s += STEP_EWMA * (now - self._last_meta_at - self._step_s)
        self._last_meta_at = now
        self._stepping = scheduler_output.total_num_scheduled_tokens > 0
        meta = BatonConnectorMetadata(loads=self._loads_ready, saves=self._final_saves)
        self._loads_ready, self._final_saves = [], []
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
            if not state.save:
                continue
            done_tokens = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            done_tokens = min(done_tokens, state.num_prompt_tokens)
            if self._save_whole_prompts and done_tokens < state.num_prompt_tokens:
                continue  # one save when the whole prompt is computed
            # full blocks once computed; the partial tail once the whole prompt is
            full_blocks = -(-done_tokens // self._block_size) if (
                done_tokens == state.num_prompt_tokens) else done_tokens // self._block_size
            full_blocks = min(full_blocks, len(state.keys), len(state.block_ids))
            first = max(state.saved_blocks, min(state.known_stored, full_blocks))
            if full_blocks <= first:
                continue
            keys = state.keys[first:full_blocks]
            parents = [state.keys[i - 1] if i > 0 else None for i in range(first, full_blocks)]
            granted = None
            if not self._async:  # answered during the forward pass; waited for after it
                granted = self._store.reserve_later(keys, parents)
                state.reservations.append(granted)
            state.saved_blocks = full_blocks
            state.has_saves = True
            meta.saves.append(SaveSpec(req_id, state.block_ids[first:full_blocks], keys,
                                       granted, parents))
        return meta

    def _output_saves(self, request: "Request", state: _RequestState,
                      block_ids: list[int]) -> SaveSpec | None:
        """The full blocks the request's output completed (beyond its prompt's full blocks),
        to save once it finishes; None when there are none."""
        first = state.num_prompt_tokens // self._block_size
        last = min(request.num_computed_tokens // self._block_size, len(block_ids))
        if last <= first or first > len(state.keys):
            return None
        tokens = request.all_token_ids[first * self._block_size: last * self._block_size]
        keys = continue_keys(state.keys[:first], tokens, self._block_size,
                             self._key_extras(request))
        parents = [state.keys[first - 1] if first > 0 else None, *keys[:-1]]
        granted = self._store.reserve_later(keys, parents) if not self._async else None
        if granted is not None:
            state.reservations.append(granted)
        return SaveSpec(request.request_id, list(block_ids[first:last]), keys, granted, parents)

    def update_connector_output(self, connector_output: Any) -> None:
        news = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(news, BatonWorkerMetadata):
            return
        for request_id in news.failed_loads:  # a failed load fails in a step before the last
            state = self._requests.get(request_id)
            if state is not None:
                state.num_loaded_tokens = state.num_disk_tokens = 0
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
        self._lookups_unsent = [st for st in self._lookups_unsent if st is not state]
        if state.lookup_sent is not None:  # answered or not, its pins go back
            self._send_lookups()
            answer = state.lookup_sent.result()[state.lookup_index]
            self._unpin_keys(state.keys[: len(answer.slots)], answer.arena_path)
            state.lookup_sent = None
        self._send_unpins()  # finished between steps, maybe the last: not left for the next
        if self._saves and state.save and request.num_output_tokens > 0:
            output = self._output_saves(request, state, block_ids)
            if output is not None:
                self._final_saves.append(output)
                state.has_saves = True
        # the worker half tells when the blocks are written (``get_finished``): vLLM holds them
        return state.has_saves, {PARAMS_KEY: {"loaded_tokens": state.num_loaded_tokens,
                                              "stored_blocks": state.num_stored_blocks(),
                                              "disk_tokens": state.num_disk_tokens}}
