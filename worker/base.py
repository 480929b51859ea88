"""What prefill and decode workers share: building the engine inside a Ray actor, and stats."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque

import msgspec

from engine.builder import EventsWiring, Role, build_engine_args
from engine.config import EngineConfig
from engine.cpu_threads import bind_cores
from engine.models import PreparedModel
from engine.runner import EngineRunner
from kvstore.attach import StoreWiring
from kvstore.redis_server import free_port
from protos.wire import (
    CallCounts,
    ConnectorCounters,
    EngineRequest,
    InstanceStats,
    MeasuredPrefill,
    Registration,
)
from worker.memory import EngineMemory, engine_memory

log = logging.getLogger(__name__)


class ConductorWiring(msgspec.Struct, frozen=True):
    """How a worker joins the conductor: its actor name and where engines publish KV events."""

    actor_name: str
    namespace: str
    events_endpoint: str


RECENT_WINDOW = 64
"""Requests the recent TTFT / ITL medians in ``stats`` are taken over."""


class EngineWorker:
    """Base of the worker actors: one vLLM engine for one role, plus its connector's stats.

    Ray actor classes subclass this; the constructor runs in the actor's own process, where the
    engine environment (``engine.builder.engine_env``) was set through the actor's runtime env.
    With a ``conductor`` the engine publishes KV events to it, and the worker registers itself
    (role, node, KV key layout, replay endpoint) once the engine is up.
    """

    role: Role = "plain"

    def __init__(
        self,
        instance_id: str,
        config: EngineConfig,
        model: PreparedModel,
        store: StoreWiring | None,
        conductor: ConductorWiring | None = None,
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self.instance_id = instance_id
        self.model = model
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self._recent_ttft_ms: deque[float] = deque(maxlen=RECENT_WINDOW)
        self._recent_itl_ms: deque[float] = deque(maxlen=RECENT_WINDOW)
        started = time.perf_counter()
        from kvstore.attach import NodeStoreSpec, ensure_node_store

        if isinstance(store, NodeStoreSpec):  # on a Ray cluster: the store of whichever node we got
            store = ensure_node_store(store, conductor.actor_name if conductor else None)
        self.node_id = store.node_id if store else ""
        self._store = store
        _name_store_holder(instance_id)
        self._store_handle = None  # resolved at the first pull
        self.calls = CallCounts()
        """The remote calls this worker made itself on behalf of requests (its pulls)."""
        events = None
        if conductor is not None:
            import ray

            host = ray.util.get_node_ip_address()
            events = EventsWiring(conductor.events_endpoint, f"tcp://{host}:{free_port(host)}")
        args = build_engine_args(config, model, self.role, instance_id, store, events)
        self.saves_prompts = config.saves_prompts(self.role)
        """Its connector saves the prompts it computes to the store (``Registration``)."""
        if config.device == "cpu":  # vLLM binds only in its multiprocess executor
            cores = bind_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))
            log.info("%s %s: engine threads on cores %s", self.role, instance_id, cores or "any")
        self.runner = EngineRunner(args, max_prefills=config.prefill_gate,
                                   gate_order=config.prefill_gate_order,
                                   admission_headroom=config.admission_headroom(self.role))
        self.warmup_prefills: tuple[MeasuredPrefill, ...] = ()
        if config.warm_up:
            from engine.warmup import warm_up

            _, block_size = self.runner.kv_layout()
            warm_started = time.perf_counter()
            self.warmup_prefills = warm_up(self.runner, self.runner.max_model_len(), block_size)
            log.info("%s %s: warm-up of %d prefills in %.1f s: %s", self.role, instance_id,
                     len(self.warmup_prefills), time.perf_counter() - warm_started,
                     ", ".join(f"{p.uncached_tokens}/{p.cached_tokens} {p.prefill_ms:.0f} ms"
                               for p in self.warmup_prefills))
        self.engine_start_s = time.perf_counter() - started
        if conductor is not None:
            self._register(conductor, store, events)
        log.info("%s %s ready in %.1f s", self.role, instance_id, self.engine_start_s)

    def _register(self, conductor: ConductorWiring, store: StoreWiring | None,
                  events: EventsWiring) -> None:
        import ray

        from kvstore.keys import kv_layout_tag

        dtype, block_size = self.runner.kv_layout()
        handle = ray.get_actor(conductor.actor_name, namespace=conductor.namespace)
        ray.get(handle.register.remote(Registration(
            self.instance_id, self.role, store.node_id if store else "", self.model.name,
            kv_layout_tag(dtype, block_size), events.replay_endpoint, self.warmup_prefills,
            saves_prompts=store is not None and self.saves_prompts,
        )))

    def key_extras(self, request: EngineRequest):
        """The ``KeyExtras`` this engine's connector keys ``request``'s blocks under (its salt
        and where the salt's segment starts)."""
        from kvstore.keys import KeyExtras, first_salted_block, kv_layout_tag

        dtype, block_size = self.runner.kv_layout()
        return KeyExtras(model_id=self.model.name, cache_salt=request.cache_salt,
                         kv_layout=kv_layout_tag(dtype, block_size),
                         salt_from_block=first_salted_block(request.cache_salt_offset, block_size))

    def prompt_keys(self, request: EngineRequest) -> list[bytes]:
        """The store keys of ``request``'s prompt blocks, as this engine's connector names them
        (full blocks, then the partial tail): the ones the request carries from the gateway,
        hashed here only when it carries none under this engine's key scheme."""
        from kvstore.keys import kv_layout_tag, prompt_block_keys, unpack_keys

        dtype, block_size = self.runner.kv_layout()
        blocks = request.blocks
        if blocks is not None and (blocks.model_id, blocks.kv_layout, blocks.block_size_tokens) == (
                self.model.name, kv_layout_tag(dtype, block_size), block_size):
            return unpack_keys(blocks.keys)
        return prompt_block_keys(request.prompt_token_ids, block_size, self.key_extras(request))

    def _store_actor(self):
        """This node's store actor (looked up once; None without a store)."""
        if self._store is None:
            return None
        if self._store_handle is None:
            import ray

            self.calls.count("gcs.get_actor")
            self._store_handle = ray.get_actor(self._store.store_actor,
                                               namespace=self._store.namespace)
        return self._store_handle

    def apply_leases(self, request: EngineRequest, generated: tuple[int, ...] | list[int] = ()
                     ) -> int:
        """Ask this node's store to retain the blocks ``request.leases`` name (a session step's
        prompt and reply, a ``cache_control`` prefix): their whole blocks, leased under each
        lease's id and TTL. Blocks still being written are leased as they land (the store
        remembers the keys). Sent without waiting: a lease never delays a reply. Returns the
        keys named."""
        if not request.leases or self._store is None:
            return 0
        from kvstore.keys import continue_keys

        _, block_size = self.runner.kv_layout()
        prompt_keys = self.prompt_keys(request)[:len(request.prompt_token_ids) // block_size]
        named = 0
        for lease in request.leases:
            keys = prompt_keys[:min(lease.num_tokens, len(request.prompt_token_ids)) // block_size]
            if lease.include_output and generated and len(keys) == len(prompt_keys):
                tokens = (*request.prompt_token_ids, *generated)
                rest = tokens[len(keys) * block_size:]
                keys = [*keys, *continue_keys(keys, rest, block_size, self.key_extras(request))]
            if not keys:
                continue
            try:
                self.calls.count("store.lease", "sent")
                self._store_actor().lease.remote(lease.lease_id, lease.tenant, keys, lease.ttl_s)
            except Exception:  # noqa: BLE001 - a lost store keeps no leases: the KV is recomputed
                self._store_handle = None
                log.warning("could not lease request %s's blocks (%s)", request.request_id,
                            lease.lease_id, exc_info=True)
                continue
            named += len(keys)
        return named

    async def _pull_remote_kv(self, request: EngineRequest) -> int:
        """Bring the prompt's blocks held on ``request.kv_source_node`` (the first
        ``request.kv_source_blocks`` of them, or all) into this node's store over the transfer
        engine, so the connector loads them instead of the engine recomputing them: the store
        executes that plan as given. Returns the blocks pulled; 0 when there is nothing to pull
        or the pull failed (the store logs why and the engine recomputes: a pull never fails a
        request)."""
        source = request.kv_source_node
        if not source or source == self.node_id or self._store is None:
            return 0
        from kvstore.node import NO_TRANSFER, TransferPlan

        keys = self.prompt_keys(request)
        if request.kv_source_blocks is not None:
            keys = keys[:request.kv_source_blocks]
        if not keys:
            return 0
        try:
            self.calls.count("store.execute")
            result = await self._store_actor().execute.remote(TransferPlan(source, tuple(keys)))
        except Exception:  # noqa: BLE001 - the store actor is gone: recompute
            self._store_handle = None  # look it up again next time: it may have been replaced
            log.warning("pull of request %s's KV from node %s failed", request.request_id, source,
                        exc_info=True)
            return 0
        if result.error and result.error != NO_TRANSFER:  # the store warns of that once itself
            log.warning("request %s: pulled %d of %d blocks from %s: %s", request.request_id,
                        result.num_pulled, len(keys) - result.num_local, source, result.error)
        return result.num_pulled

    def call_counts(self) -> CallCounts:
        """Remote calls made in this worker's process on behalf of requests: the worker's own
        and its engine's connector's (the process's store client)."""
        calls = self.calls.snapshot()
        if self._store is not None:
            from kvstore.client import shared_store_client

            calls = calls.plus(shared_store_client(self._store.store_actor,
                                                   self._store.namespace).calls)
        return calls

    def warmup(self) -> tuple[MeasuredPrefill, ...]:
        """The prefills the engine's warm-up timed at start (empty with ``engine.warm_up`` off)."""
        return self.warmup_prefills

    def ready(self) -> float:
        """Seconds the engine took to start; returning at all means the engine is up."""
        return self.engine_start_s

    def stats(self) -> InstanceStats:
        from kvstore.connector import connector_stats

        running, waiting = self.runner.num_running_and_waiting()
        loads = connector_stats(self.instance_id)
        # spans before steps: every step a span names was kept before the span was
        spans = tuple(self.runner.take_decode_spans())
        return InstanceStats(
            instance_id=self.instance_id,
            role=self.role,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_finished_reqs=self.runner.num_finished_reqs,
            ready=self.runner.alive,
            kv_usage_frac=self.runner.kv_usage_frac(),
            kv_loaded_bytes=loads.loaded_bytes,
            kv_load_seconds=loads.load_seconds,
            node_id=self.node_id,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            recent_ttft_ms=statistics.median(self._recent_ttft_ms) if self._recent_ttft_ms else None,
            recent_itl_ms=statistics.median(self._recent_itl_ms) if self._recent_itl_ms else None,
            decode_steps=tuple(self.runner.take_decode_steps()),
            decode_spans=spans,
            mixed_steps=tuple(self.runner.take_mixed_steps()),
        )

    def _record_request(self, num_prompt_tokens: int, num_cached_tokens: int,
                        ttft_ms: float | None, itl_ms: float | None = None) -> None:
        """Account one finished request for ``stats``."""
        self.num_prompt_tokens += num_prompt_tokens
        self.num_cached_tokens += num_cached_tokens
        if ttft_ms is not None:
            self._recent_ttft_ms.append(ttft_ms)
        if itl_ms is not None:
            self._recent_itl_ms.append(itl_ms)

    def connector_counters(self) -> ConnectorCounters:
        """The KV connector's counters (blocks looked up, hit, loaded, saved), since start."""
        from kvstore.connector import connector_stats

        s = connector_stats(self.instance_id)
        return ConnectorCounters(
            lookups_blocks=s.lookups_blocks, hits_blocks=s.hits_blocks,
            loaded_blocks=s.loaded_blocks, saved_blocks=s.saved_blocks,
            failed_load_blocks=s.failed_load_blocks, dropped_save_blocks=s.dropped_save_blocks,
            loaded_bytes=s.loaded_bytes, load_seconds=s.load_seconds,
            hashed_prompts=s.hashed_prompts)

    def memory(self) -> EngineMemory:
        """Where this worker's resident memory goes (``worker.memory``): the KV cache's resident
        pages, glibc's heap in use and kept free, Python's live objects."""
        from kvstore.connector_meta import kv_cache_spans

        return engine_memory(kv_cache_spans(self.instance_id))

    def crash_mid_save(self) -> None:
        """Drill hook (``baton chaos``): the next KV save of two or more blocks this worker's
        engine makes copies half of them and then kills the process, reservations made and
        nothing committed, as a crash in the middle of a transfer would. The store node
        releases what the dead process held (``kvstore.node_holders``)."""
        from kvstore.connector import connector_stats

        connector_stats(self.instance_id).crash_mid_save = True

    def shutdown(self) -> None:
        self.runner.shutdown()


def _name_store_holder(instance_id: str) -> None:
    """Name this process to the store by ``instance_id`` when it is the Ray actor of that name
    (as the cluster starts workers): a store node that later finds no live actor by that name
    releases what the process held. A worker made any other way (a test's, in-process) is not
    named: nothing would tell its death from its absence."""
    import ray

    if not ray.is_initialized():
        return
    try:
        name = ray.get_runtime_context().get_actor_name()
    except Exception:  # noqa: BLE001 - not in an actor
        return
    if name == instance_id:
        from kvstore.client import set_process_holder

        set_process_holder(instance_id)

