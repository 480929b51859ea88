"""The conductor actor: the deciding core as a Ray actor.

A Ray async actor around ``ConductorState``. It binds the ZMQ socket every engine publishes its
KV events to (vLLM's ``KVEventsConfig``: the conductor binds, engines connect, topic = instance
id), subscribes to each store node's tier events, repairs sequence gaps by replay (or drops what
the stream said when replay cannot), polls worker load, makes requests that share a prefix being
prefilled right now wait (bounded) for it, and answers ``place``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import ray
import zmq
import zmq.asyncio

from conductor.calibration import CostCalibration, PredictionError
from conductor.config import ConductorConfig
from conductor.kv_feed import KvEventFeed
from conductor.kv_index import StreamGap
from conductor.policy import PolicyConfig, PrefixHit
from conductor.sessions import SessionCounters, SessionView
from conductor.state import CoalesceWait, ConductorState, PlacementCounters
from kvstore.keys import BlockKey
from protos.errors import InvalidRequest, NoWorkerReady
from protos.wire import (
    ClusterLoad,
    KeyScheme,
    KvFeedBatch,
    Placement,
    PlacementRequest,
    Registration,
    SessionEnd,
    SoftPin,
    StoreRow,
)

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0


class ConductorStatus(msgspec.Struct, frozen=True):
    """What ``baton status`` and the tests read from the conductor."""

    policy: str
    counters: PlacementCounters
    indexed_blocks: dict[str, int]
    num_resyncs: int
    num_untranslatable_blocks: int
    num_in_flight_prefills: int
    num_in_flight_decodes: int
    events_received: int
    events_dropped_for_test: int
    num_replayed_batches: int
    """Lost event batches recovered from their source's replay buffer."""
    last_seq_by_source: dict[str, int]
    """The last event batch applied from each stream (-1: none yet)."""


class PrefixHits(msgspec.Struct, frozen=True):
    """What the KV index holds of one prompt's blocks (``Conductor.prefix_hits``)."""

    num_blocks: int
    """Block keys asked about."""
    hits_by_instance: dict[str, PrefixHit]
    """Per instance with a non-empty leading run of them: that run by fastest tier."""


class Conductor:
    """Owns the placement state and the event streams that keep its KV index current."""

    def __init__(self, config: ConductorConfig, namespace: str, policy_config: PolicyConfig,
                 events_host: str = "127.0.0.1") -> None:
        logging.basicConfig(level=logging.INFO)
        self._config = config
        self._namespace = namespace
        calibration = (CostCalibration(policy_config.prefill_cost, policy_config.decode_cost,
                                       fitted=config.profile_path is not None)
                       if config.calibrate_cost_model else None)
        self.state = ConductorState(config.policy, policy_config, calibration=calibration)
        self._last_stats: dict = {}
        self._instance_handles: dict = {}
        """Actor handles of the instances the load refresh asks, looked up once each (a lookup
        is a GCS round trip; every 0.5 s per instance it was most of an idle conductor's
        calls); dropped when a call fails, so a replaced actor is looked up again."""
        self._store_actors: dict[str, str] = {}
        self._soft_pins: dict[str, list[bytes]] = {}  # operator-pinned prefix name → block keys
        if events_host == "auto":  # on a Ray cluster: this node's address, reachable from others
            events_host = ray.util.get_node_ip_address()
        self._ctx = zmq.asyncio.Context()
        self._engine_sub = self._ctx.socket(zmq.SUB)
        self._engine_sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._engine_sub.setsockopt(zmq.LINGER, 0)
        self._engine_sub.bind(f"tcp://{events_host}:0")
        self._events_endpoint = self._engine_sub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._store_sub = self._ctx.socket(zmq.SUB)
        self._store_sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._store_sub.setsockopt(zmq.LINGER, 0)
        self._replay_endpoints: dict[str, str] = {}
        self._store_topics: dict[bytes, str] = {}
        self._store_endpoints: dict[str, str] = {}  # node → where its current process publishes
        self._prefill_events: dict[str, asyncio.Event] = {}
        self._pool_waits: list[tuple[CoalesceWait, asyncio.Event]] = []
        """Coalesced requests waiting for their blocks to reach a store (``_wait_for_pool``)."""
        self._tasks: list[asyncio.Task] = []
        self._events_received = 0
        self._drop_next: dict[str, int] = {}
        self._events_dropped = 0
        self._replayed = 0
        self._key_scheme: KeyScheme | None = None
        self.kv_feed = KvEventFeed()
        """Every engine batch received, for the engine contract's SubscribeKvEvents."""

    def events_endpoint(self) -> str:
        """Where engines publish KV events (``KVEventsConfig.endpoint``)."""
        return self._events_endpoint

    def _start_tasks(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._engine_events()), loop.create_task(self._store_events()),
                           loop.create_task(self._refresh_forever()),
                           loop.create_task(self._sessions_forever())]

    # ------------------------------------------------------------------ membership

    async def register(self, joining: Registration) -> None:
        """Add an instance (not ready until ``mark_ready``); re-registering resets its index."""
        self._start_tasks()
        self.state.register(joining.instance_id, joining.role, joining.node_id, joining.model_id,
                            joining.kv_layout, joining.saves_prompts)
        self._key_scheme = KeyScheme(joining.model_id, joining.kv_layout,
                                     self.state.config.block_size_tokens,
                                     self.state.config.kv_bytes_per_token)
        if joining.replay_endpoint:
            self._replay_endpoints[joining.instance_id] = joining.replay_endpoint
        self.state.observe_warmup(joining.warmup_prefills)

    async def add_store_node(self, node_id: str, events_endpoint: str, replay_endpoint: str = "",
                             actor_name: str = "") -> None:
        """Subscribe to a store node's tier events (the node binds, the conductor connects).
        Adding a node already known at the same endpoint does nothing (every worker on a node
        announces its store); at another endpoint it is a new process of that node: see
        ``replace_store_node``."""
        self._start_tasks()
        if actor_name:
            self._store_actors[node_id] = actor_name
        known = self._store_endpoints.get(node_id)
        if known == events_endpoint:
            return
        if known is not None:
            await self.replace_store_node(node_id, events_endpoint, replay_endpoint, actor_name)
            return
        self._store_topics[f"baton.store.{node_id}".encode()] = node_id
        self.state.index.add_node(node_id)
        self._connect_store(node_id, events_endpoint, replay_endpoint)
        if self._soft_pins and actor_name:
            await self._push_soft_pins({node_id: actor_name})

    async def store_node_lost(self, node_id: str) -> None:
        """A store node's process is gone: forget every block the index had on it (its host
        tier went with it) and stop listening to it. Placement goes on by load alone there
        until ``replace_store_node``."""
        self.state.index.clear_node(node_id)
        endpoint = self._store_endpoints.pop(node_id, None)
        if endpoint is not None:
            self._disconnect_store(endpoint)
        log.warning("store node %s lost: its index entries are dropped", node_id)

    async def replace_store_node(self, node_id: str, events_endpoint: str,
                                 replay_endpoint: str = "", actor_name: str = "") -> None:
        """A new process of store node ``node_id`` publishes at ``events_endpoint``: drop what
        the old one said, listen to the new one from its first batch (``add_node``: batches
        the subscription missed while connecting are a gap from 0, replayed), and give it the
        operators' soft pins."""
        await self.store_node_lost(node_id)
        if actor_name:
            self._store_actors[node_id] = actor_name
        self._store_topics[f"baton.store.{node_id}".encode()] = node_id
        self.state.index.add_node(node_id)
        self._connect_store(node_id, events_endpoint, replay_endpoint)
        if self._soft_pins and actor_name:
            await self._push_soft_pins({node_id: actor_name})
        log.info("store node %s replaced: listening at %s", node_id, events_endpoint)

    def _connect_store(self, node_id: str, events_endpoint: str, replay_endpoint: str) -> None:
        if replay_endpoint:
            self._replay_endpoints[node_id] = replay_endpoint
        self._store_endpoints[node_id] = events_endpoint
        self._store_sub.connect(events_endpoint)

    def _disconnect_store(self, endpoint: str) -> None:
        try:
            self._store_sub.disconnect(endpoint)
        except zmq.ZMQError:
            pass  # never connected, or already gone

    # ------------------------------------------------------------------ operator pins

    async def pin_prefix(self, name: str, token_ids: list[int], cache_salt: str = "",
                         cache_salt_offset: int = 0) -> SoftPin:
        """Soft-pin a prompt prefix (a system prompt) on every store node, now and on nodes that
        join later: its blocks are evicted from host memory last. Pinning a name again replaces
        its prefix. The keys are the store's: ``cache_salt`` from token ``cache_salt_offset`` on
        (segmented salts, ``kvstore.keys``); a public trunk that tenants' requests salt only
        after it is pinned with no salt."""
        from kvstore.keys import KeyExtras, block_keys, first_salted_block

        scheme = self._key_scheme
        if scheme is None:
            raise NoWorkerReady("no engine has registered yet, so the block keys are unknown; "
                                "pin once `baton status` shows a ready instance")
        if not 0 <= cache_salt_offset <= len(token_ids):
            raise InvalidRequest(f"cache_salt_offset must be from 0 to the prefix's "
                                 f"{len(token_ids)} tokens, got {cache_salt_offset}")
        keys = block_keys(token_ids, scheme.block_size_tokens,
                          KeyExtras(scheme.model_id, cache_salt, "", scheme.kv_layout,
                                    first_salted_block(cache_salt_offset,
                                                       scheme.block_size_tokens)))
        if not keys:
            raise InvalidRequest(f"the prefix has {len(token_ids)} tokens, less than one block "
                                 f"({scheme.block_size_tokens}): nothing to pin")
        self._soft_pins[name] = [bytes(k) for k in keys]
        present = await self._push_soft_pins(self._store_actors)
        return SoftPin(name, len(keys), len(token_ids), present)

    async def unpin_prefix(self, name: str) -> SoftPin:
        if name not in self._soft_pins:
            raise InvalidRequest(f"no pinned prefix named {name!r}; pinned: "
                                 f"{', '.join(sorted(self._soft_pins)) or 'none'}")
        keys = self._soft_pins.pop(name)
        await self._push_soft_pins(self._store_actors)
        return SoftPin(name, len(keys), 0, {})

    async def _push_soft_pins(self, stores: dict[str, str]) -> dict[str, int]:
        """Send the whole pinned set to ``stores`` (node → actor name); node → blocks present."""
        keys = sorted({k for prefix in self._soft_pins.values() for k in prefix})
        present = {}
        for node_id, actor_name in sorted(stores.items()):
            try:
                store = ray.get_actor(actor_name, namespace=self._namespace)
                present[node_id] = await asyncio.wait_for(
                    store.set_soft_pins.remote([BlockKey(k) for k in keys]), timeout=10)
            except Exception as exc:  # noqa: BLE001 - a node going away keeps no pins anyway
                log.warning("could not send soft pins to store node %s: %s", node_id, exc)
        return present

    async def key_scheme(self) -> KeyScheme | None:
        """Block-key parameters of the served engines (None until one has registered)."""
        return self._key_scheme

    async def report_failure(self, instance_id: str, error: str) -> None:
        """A router saw ``instance_id`` die (its actor is gone): stop placing on it at once
        rather than at the next stats poll. It comes back only if it answers a poll again."""
        if self.state.role_of(instance_id) is not None and self.state.is_instance_ready(instance_id):
            log.warning("instance %s failed (%s): no more placements on it", instance_id, error)
            self.state.set_ready(instance_id, False)

    async def mark_ready(self, instance_id: str) -> None:
        self.state.set_ready(instance_id, True)

    async def remove(self, instance_id: str) -> None:
        self.state.remove(instance_id)

    async def is_ready(self) -> bool:
        """True when a decode instance can take work, and a prefill instance too unless the
        cluster serves co-located (no prefill pool; see ``ConductorState.is_ready``)."""
        return self.state.is_ready()

    # ------------------------------------------------------------------ requests

    async def place(self, request: PlacementRequest) -> Placement:
        """Placement for one request. Raises ``NoWorkerReady`` when a pool has no ready instance
        and ``Overloaded`` (before any prefill work) when the request would miss its SLOs.

        A request whose next blocks an in-flight prefill is computing waits for it (bounded by
        ``coalesce_max_wait_ms``) only when waiting and then prefilling the rest is predicted to
        beat placing it now (``ConductorState.coalesce_wait``); the reason says which won. Where
        the prefill's engine computes one prompt at a time (``coalesce_in_queue``), it waits
        there instead: placed at once, queued right behind it (``ConductorState.place_behind``)."""
        note = ""
        if self._config.coalesce:
            wait = self.state.coalesce_wait(request, self._config.coalesce_min_blocks,
                                            self._config.coalesce_duplicate_weight)
            behind = (self.state.place_behind(request, wait, self._config.coalesce_elsewhere)
                      if wait is not None and wait.wins and self._config.coalesce_in_queue else None)
            if behind is not None:
                self.state.counters.coalesced += 1
                return behind
            if wait is not None and wait.wins:
                started = time.monotonic()
                self.state.hold(wait)
                try:
                    waited = await self._wait_for(wait.owner)
                finally:
                    self.state.release(wait)
                note = (f"{'coalesced' if waited else 'timed out'} after "
                        f"{(time.monotonic() - started) * 1000.0:.0f} ms ({wait.describe()}); ")
                if waited and self._config.coalesce_elsewhere:
                    note += await self._wait_for_pool(wait)
            elif wait is not None:
                self.state.counters.coalesce_declined += 1
                note = f"not coalesced ({wait.describe()}); "
        placement = self.state.place(request)
        if placement.pulled_from:
            placement = msgspec.structs.replace(
                placement, pulled_from_node=self.state.node_of(placement.pulled_from))
        if note:
            placement = msgspec.structs.replace(placement, reason=note + placement.reason)
        return placement

    async def _wait_for_pool(self, wait: CoalesceWait) -> str:
        """After coalescing, wait (``ConductorState.pool_wait_ms``) for the owner's blocks to
        reach its node's store, so that this request may load them on another instance rather
        than queue behind the waiters already placed on the owner's; what it says is added to
        the placement's reason ('' when it did not wait)."""
        bound_ms = self.state.pool_wait_ms(wait)
        if bound_ms <= 0.0:
            return ""
        started = time.monotonic()
        event = asyncio.Event()
        self._pool_waits.append((wait, event))
        try:
            await asyncio.wait_for(event.wait(), bound_ms / 1000.0)
            held = True
        except asyncio.TimeoutError:
            held = False
        finally:
            self._pool_waits.remove((wait, event))
        waited_ms = (time.monotonic() - started) * 1000.0
        self.state.counters.pool_waits += 1
        self.state.counters.pooled += held
        return (f"{'pooled' if held else 'not pooled'} after {waited_ms:.0f} ms "
                f"(the owner's queue {bound_ms:.1f} ms); ")

    def _wake_pool_waits(self) -> None:
        """Store events arrived: wake the requests waiting for blocks the store now holds."""
        for wait, event in self._pool_waits:
            if not event.is_set() and self.state.pool_holds(wait):
                event.set()

    async def _wait_for(self, owner: str) -> bool:
        """Wait for ``owner``'s prefill to end; False when it did not within the bound."""
        event = self._prefill_events.setdefault(owner, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), self._config.coalesce_max_wait_ms / 1000.0)
            self.state.counters.coalesced += 1
            return True
        except asyncio.TimeoutError:
            log.info("coalescing: prefill %s did not finish within %.0f ms; placing without it",
                     owner, self._config.coalesce_max_wait_ms)
            return False

    async def cost_model_error(self) -> dict[str, PredictionError | None]:
        """The calibrated models' errors ("prefill", "decode") on requests each was not fitted on
        (None: not calibrating, or nothing measured yet): what ``baton status`` is to show."""
        calibration = self.state.calibration
        if calibration is None:
            return {"prefill": None, "decode": None, "decode_per_request": None, "mixed_step": None,
                    "decode_per_request_all_steps": None}
        return {"prefill": calibration.prefill_error(), "decode": calibration.decode_error(),
                "decode_per_request": calibration.decode_request_error(),
                "mixed_step": calibration.mixed_step_error(),
                "decode_per_request_all_steps": calibration.request_all_steps_error()}

    async def prefill_done(self, request_id: str, num_cached_tokens: int | None,
                           prefill_ms: float | None = None) -> None:
        """The router reports a finished (or failed: None) prefill, and how long it took
        (``PrefillResult.prefill_ms``; None: not measured) for the cost model's calibration."""
        self.state.prefill_done(request_id, num_cached_tokens, prefill_ms)
        event = self._prefill_events.pop(request_id, None)
        if event is not None:
            event.set()

    async def finished(self, request_id: str, handoff_ms: float | None = None) -> None:
        """The router reports the end of a request, however it ended, and how long its KV
        hand-off took when it was disaggregated (``ConductorState.finished``)."""
        self.state.finished(request_id, handoff_ms)
        event = self._prefill_events.pop(request_id, None)
        if event is not None:
            event.set()

    async def status(self) -> ConductorStatus:
        index = self.state.index
        prefills, decodes = self.state.num_in_flight()
        return ConductorStatus(
            self._config.policy, self.state.counters, index.num_blocks(), index.num_resyncs,
            index.num_untranslatable_blocks, prefills, decodes, self._events_received,
            self._events_dropped, self._replayed, index.last_seqs(),
        )

    async def _store_rows(self) -> list[StoreRow]:
        rows = []
        for node_id, name in sorted(self._store_actors.items()):
            try:
                store = ray.get_actor(name, namespace=self._namespace)
                stats, tiers = await asyncio.wait_for(
                    asyncio.gather(store.stats.remote(), store.tier_counters.remote()), timeout=5)
            except Exception:
                continue
            rows.append(StoreRow(node_id, stats.capacity_blocks, stats.used_blocks,
                                 stats.pinned_blocks, tiers.disk_blocks or 0, stats.evicted_blocks,
                                 tiers))
        return rows

    async def cluster_load(self) -> ClusterLoad:
        """The last stats of every ready instance and the requests in flight (the engine
        contract's GetLoads)."""
        prefills, decodes = self.state.num_in_flight()
        ready = [stats for instance_id, stats in sorted(self._last_stats.items())
                 if self.state.is_instance_ready(instance_id)]
        return ClusterLoad(ready, prefills, decodes)

    async def kv_event_batches(self, after_seq: int, wait_s: float = 1.0,
                               max_batches: int = 256) -> list[KvFeedBatch]:
        """The engines' KV event batches received after ``after_seq`` (``conductor.kv_feed``),
        waiting up to ``wait_s`` seconds for one when there is none yet."""
        self.kv_feed.arm()
        return await self.kv_feed.wait_after(after_seq, wait_s, max_batches)

    async def kv_last_seq(self) -> int:
        """The sequence number of the last engine KV event batch kept (0: none yet); from the
        first call on, batches are kept."""
        self.kv_feed.arm()
        return self.kv_feed.last_seq

    async def prefix_hits(self, block_keys: list[bytes]) -> PrefixHits:
        """The index's view of one prompt (for operators and tests)."""
        return PrefixHits(len(block_keys), self.state.index.prefix_hits(block_keys))

    async def set_admission(self, ttft_slo_ms: float | None, tbt_slo_ms: float | None) -> None:
        """Change the SLOs admission enforces, live (None: no limit)."""
        self.state.config = self.state.config.model_copy(
            update={"ttft_slo_ms": ttft_slo_ms, "tbt_slo_ms": tbt_slo_ms})

    async def set_coalesce(self, enabled: bool) -> None:
        """Turn fan-out coalescing on or off, live."""
        self._config = self._config.model_copy(update={"coalesce": enabled})

    async def drop_next_events(self, source: str, num_batches: int) -> None:
        """Fault injection for tests and drills: discard the next batches from ``source``, as a
        lossy network would, to exercise gap detection and repair."""
        self._drop_next[source] = num_batches

    # ------------------------------------------------------------------ event streams

    async def _engine_events(self) -> None:
        while True:
            topic, seq_bytes, payload = await self._engine_sub.recv_multipart()
            await self._ingest_guarded(topic.decode(), seq_bytes, payload, engine=True)

    async def _store_events(self) -> None:
        while True:
            topic, seq_bytes, payload = await self._store_sub.recv_multipart()
            node_id = self._store_topics.get(topic)
            if node_id is not None:
                await self._ingest_guarded(node_id, seq_bytes, payload, engine=False)

    async def _ingest_guarded(self, source: str, seq_bytes: bytes, payload: bytes, engine: bool) -> None:
        """One bad batch must not stop the stream: it is logged and its source resynced."""
        try:
            await self._ingest(source, seq_bytes, payload, engine)
        except Exception:
            log.exception("failed to apply a KV event batch from %s; resyncing it", source)
            self._clear(source, engine)

    async def _ingest(self, source: str, seq_bytes: bytes, payload: bytes, engine: bool) -> None:
        self._events_received += 1
        if self._drop_next.get(source, 0) > 0:
            self._drop_next[source] -= 1
            self._events_dropped += 1
            return
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        index = self.state.index
        ingest = index.ingest_engine if engine else index.ingest_store
        if engine:
            self.kv_feed.record(source, payload)
        try:
            gap = ingest(source, seq, payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable KV event batch from %s (%s): resyncing it", source, exc)
            self._clear(source, engine)
            return
        if gap is not None:
            await self._repair(gap, engine)
        if not engine and self._pool_waits:
            self._wake_pool_waits()

    def _clear(self, source: str, engine: bool) -> None:
        if engine:
            if source in self.state.index.instance_ids():
                self.state.index.clear_instance(source)
        else:
            self.state.index.clear_node(source)

    async def _repair(self, gap: StreamGap, engine: bool) -> None:
        """Replay the missed batches from the source's buffer; if that fails, drop everything the
        stream said (the index under-reports until the source re-announces, never over-reports)."""
        index = self.state.index
        ingest = index.ingest_engine if engine else index.ingest_store
        endpoint = self._replay_endpoints.get(gap.source)
        batches = await self._replay(endpoint, gap.expected_seq) if endpoint else None
        if not batches or batches[0][0] != gap.expected_seq:
            log.warning("KV events %d..%d from %s lost and not replayable: resyncing its index entries",
                        gap.expected_seq, gap.got_seq - 1, gap.source)
            self._clear(gap.source, engine)
            return
        for seq, payload in batches:
            if engine:
                self.kv_feed.record(gap.source, payload)
            if ingest(gap.source, seq, payload) is not None:
                self._clear(gap.source, engine)
                return
        index.num_resyncs += 1
        self._replayed += len(batches)
        log.info("replayed KV events %d..%d from %s", gap.expected_seq, batches[-1][0], gap.source)

    async def _replay(self, endpoint: str, start_seq: int) -> list[tuple[int, bytes]] | None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        batches: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await sock.poll(remaining * 1000):
                    return None
                _, _topic, seq_bytes, payload = await sock.recv_multipart()  # vLLM's framing
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return batches
                batches.append((seq, payload))
        finally:
            sock.close()

    # ------------------------------------------------------------------ worker load

    # ------------------------------------------------------------------ agent sessions

    async def close_session(self, session_id: str) -> SessionEnd | None:
        """End a session (the client's or an operator's call): forget it and release its lease
        on every store node, so its blocks are ordinary LRU blocks again. None: no live session
        of that id (its leases, if any were left, are released all the same)."""
        session = self.state.sessions.close(session_id)
        released = await self._release_leases(session_id)
        if session is None:
            return None
        return SessionEnd(session_id, session.num_steps, released)

    async def session(self, session_id: str) -> SessionView | None:
        return self.state.sessions.view(session_id)

    async def session_counters(self) -> SessionCounters:
        return self.state.sessions.counters

    async def live_sessions(self) -> int:
        """Sessions the table holds now (those whose TTL lapsed are ended first)."""
        self.state.sessions.expire()
        return len(self.state.sessions)

    async def _release_leases(self, lease_id: str) -> int:
        released = 0
        for node_id, name in sorted(self._store_actors.items()):
            try:
                store = ray.get_actor(name, namespace=self._namespace)
                released += await asyncio.wait_for(store.release_lease.remote(lease_id), timeout=5)
            except Exception as exc:  # noqa: BLE001 - a lost node keeps no leases anyway
                log.warning("could not release lease %s on store node %s: %s", lease_id, node_id, exc)
        return released

    async def _sessions_forever(self) -> None:
        """End the sessions whose TTL lapsed (the store nodes expire their leases themselves),
        and prefetch the blocks of sessions whose next step is due."""
        while True:
            await asyncio.sleep(min(self._config.stats_interval_s, 0.25))
            self.state.sessions.expire()
            if not self._config.session_prefetch:
                continue
            for view in self.state.sessions.due_for_prefetch(self._config.session_prefetch_lead_s):
                try:
                    await self._prefetch(view)
                except Exception as exc:  # noqa: BLE001 - a prefetch only ever saves time
                    log.info("prefetch of session %s failed: %s", view.session_id, exc)

    async def _prefetch(self, view: SessionView) -> None:
        """Bring the session's prefix back to host memory on the node of the instance its last
        step prefilled on (where placement expects its next step): a store ``acquire`` promotes
        the blocks it finds on disk, and the pins are dropped at once."""
        keys = [BlockKey(k) for k in self.state.sessions.prefix(view.session_id)]
        name = self._store_actors.get(self.state.node_of(view.prefill_instance)) if (
            view.prefill_instance and self.state.role_of(view.prefill_instance)) else None
        if not keys or name is None:
            return
        store = ray.get_actor(name, namespace=self._namespace)
        slots = await asyncio.wait_for(store.acquire.remote(keys), timeout=5)
        await asyncio.wait_for(store.release.remote(keys[:len(slots)]), timeout=5)
        self.state.sessions.counters.prefetches += 1
        self.state.sessions.counters.prefetched_blocks += len(slots)

    async def _instance_stats(self, instance_id: str):
        """One instance's ``stats``, through its cached handle; a call that failed other than by
        timing out looks the actor up again and asks once more (a replaced actor under the same
        name answers at once; a slow one is not given a second 5 s)."""
        handle = self._instance_handles.get(instance_id)
        if handle is not None:
            try:
                return await asyncio.wait_for(handle.stats.remote(), timeout=5)
            except asyncio.TimeoutError:
                raise
            except Exception:  # noqa: BLE001 - gone or replaced: look it up again
                self._instance_handles.pop(instance_id, None)
        handle = ray.get_actor(instance_id, namespace=self._namespace)
        stats = await asyncio.wait_for(handle.stats.remote(), timeout=5)
        self._instance_handles[instance_id] = handle
        return stats

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.stats_interval_s)
            instance_ids = self.state.instance_ids()
            for gone in set(self._last_stats) - set(instance_ids):
                del self._last_stats[gone]
            for gone in set(self._instance_handles) - set(instance_ids):
                del self._instance_handles[gone]
            for instance_id in instance_ids:
                try:
                    stats = await self._instance_stats(instance_id)
                except Exception:
                    if self.state.role_of(instance_id) is None:
                        continue  # removed (drained) while we asked
                    if self.state.is_instance_ready(instance_id):
                        log.warning("instance %s stopped answering; marking it not ready", instance_id)
                    self.state.set_ready(instance_id, False)
                    continue
                if self.state.role_of(instance_id) is None:
                    continue  # removed (drained) while we asked
                if not self.state.is_instance_ready(instance_id) and not self.state.was_ever_ready(
                        instance_id):
                    continue  # still starting: mark_ready says when
                self._last_stats[instance_id] = stats
                self.state.set_ready(instance_id, stats.ready)
                self.state.update_load(instance_id, stats.num_waiting_reqs, stats.kv_usage_frac)
                self.state.observe_loads(instance_id, stats.kv_loaded_bytes, stats.kv_load_seconds)
                self.state.observe_decode_steps(stats.decode_steps, instance_id, stats.decode_spans,
                                                stats.mixed_steps)
