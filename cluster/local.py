"""Bring a whole Baton cluster up on Ray, and take it down again.

``LocalCluster`` is what ``baton serve`` and the integration tests use: Redis (local unless a URL
is configured), Ray (local unless an address is configured), one KV store node, the conductor,
the prefill and decode pools, each worker a Ray actor hosting a vLLM engine. A store node that
dies is replaced by a watchdog thread (``store_watch_interval_s``). For failure drills
(``baton chaos``) it replaces a killed worker (``replace_worker``), holds a store node down
(``kill_store`` / ``start_store``) and restarts its Redis (``restart_redis``).

With ``store_nodes=2`` the machine plays two: the prefill workers use store node ``node0``, the
decode workers ``node1``, each with its own arena and block server (``kvstore.transfer`` must be
set), so every hand-off is a pull from one node's store to the other's over the transfer engine,
as between two machines. ``baton chaos`` runs so to kill a store node in the middle of a pull.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import ray
from ray.exceptions import RayActorError

from cluster.config import ClusterConfig
from cluster.control import ClusterConductor as Conductor
from conductor.cost_model import CostProfile, kv_bytes_per_token
from conductor.policy import PolicyConfig
from decode_worker.worker import DecodeWorker
from engine.builder import dtype_bytes, effective_dtype, engine_env
from engine.models import PreparedModel, prepare_model
from kvstore.attach import StoreWiring
from kvstore.config import KVStoreConfig
from kvstore.events import with_event_endpoints
from kvstore.node import KVStoreNode
from kvstore.node_holders import ray_actor_alive
from kvstore.redis_server import LocalRedis, RedisUnavailable, start_local_redis
from prefill_worker.worker import PrefillWorker
from protos.errors import ConfigError, EngineStartFailed
from worker.base import ConductorWiring

log = logging.getLogger(__name__)

PREFILL_RESOURCE = "baton_prefill"
DECODE_RESOURCE = "baton_decode"
_POOL_SLOTS = 1024  # custom-resource units a local node advertises for each pool


def kv_block_bytes(model: PreparedModel, block_size_tokens: int, dtype_size_bytes: int) -> int:
    """Bytes of one KV block across all layers: 2 (K and V) x layers x kv_heads x head_dim x
    dtype bytes x tokens per block."""
    return (2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_size_bytes
            * block_size_tokens)


def load_profile(path: str) -> CostProfile:
    """The cost profile ``baton profile`` wrote; ``ConfigError`` naming the file if unusable."""
    from pathlib import Path

    from pydantic import ValidationError

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"conductor.profile_path: {p} does not exist; run `baton profile --out {p}`")
    try:
        return CostProfile.model_validate_json(p.read_text())
    except ValidationError as exc:
        raise ConfigError(f"conductor.profile_path: {p} is not a Baton cost profile: {exc}") from exc


def policy_config_for(config: ClusterConfig, model: PreparedModel) -> PolicyConfig:
    """The conductor's tuning with the facts filled in: block size and KV bytes per token from
    the model and engine, the prefill chunk from the decode engines' step budget
    (``EngineConfig.step_token_budget``, unless the tuning names its own), cost models from the
    profile (when one is configured)."""
    dtype = effective_dtype(config.engine, model)
    updates: dict[str, object] = {
        "block_size_tokens": config.engine.kv_block_tokens,
        "prompts_at_once": config.engine.prefill_gate,
        "kv_bytes_per_token": kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim,
                                                 dtype_bytes(dtype)),
    }
    step_tokens = config.engine.step_token_budget("decode")
    if step_tokens is not None and "baton_prefill_chunk_tokens" not in config.conductor.tuning.model_fields_set:
        updates["baton_prefill_chunk_tokens"] = step_tokens
    if config.conductor.profile_path:
        profile = load_profile(config.conductor.profile_path)
        if profile.model != model.name:
            log.warning("cost profile %s was measured with %s, serving %s",
                        config.conductor.profile_path, profile.model, model.name)
        if profile.block_size_tokens != config.engine.kv_block_tokens:
            log.warning("cost profile %s was measured with KV blocks of %d tokens, the engines run "
                        "%d (engine.block_size_tokens): its decode-step fit counts blocks of the "
                        "other size; run `baton profile` again", config.conductor.profile_path,
                        profile.block_size_tokens, config.engine.kv_block_tokens)
        updates.update(prefill_cost=profile.prefill, decode_cost=profile.decode,
                       transfer=profile.transfer)
    return config.conductor.tuning.model_copy(update=updates)


def _omp_binds(config: ClusterConfig, num_engines: int) -> list[str]:
    if config.engine.omp_threads_bind != "auto":
        return [config.engine.omp_threads_bind] * num_engines
    cores = os.cpu_count() or 1
    if num_engines <= cores:
        return [str(i) for i in range(num_engines)]
    return ["nobind"] * num_engines


@dataclass
class LocalCluster:
    """A running cluster. Use ``start()`` then ``stop()`` (or the context manager)."""

    config: ClusterConfig
    progress: Callable[[str], None] = lambda _msg: None
    model: PreparedModel | None = None
    redis: LocalRedis | None = None
    redis_url: str | None = None
    conductor: object = None
    store_actor_name: str = ""
    conductor_name: str = ""
    prefill_ids: list[str] = field(default_factory=list)
    decode_ids: list[str] = field(default_factory=list)
    engine_start_s: dict[str, float] = field(default_factory=dict)
    store_watch_interval_s: float = 1.0
    """Seconds between the watchdog's liveness checks of the store nodes (0: no watchdog)."""
    store_nodes: int = 1
    """1: one store node for every worker; 2: prefill workers on ``node0``, decode workers on
    ``node1`` (module docstring)."""
    _actors: list = field(default_factory=list)
    _owns_ray: bool = False
    _stores: dict[str, object] = field(default_factory=dict)
    _watchdog: threading.Thread | None = None
    _store_lock: threading.RLock = field(default_factory=threading.RLock)
    _held_down: set[str] = field(default_factory=set)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _transfer_env: dict[str, str] = field(default_factory=dict)

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def namespace(self) -> str:
        return self.config.ray.namespace

    def start(self, wait_ready: bool = True) -> None:
        cfg = self.config
        self._check_store_nodes()  # a bad layout is a config error before anything starts
        self.progress(f"preparing model '{cfg.engine.model}'")
        self.model = prepare_model(cfg.engine.model, progress=self.progress)
        if cfg.redis.url:
            self.redis_url = cfg.redis.client_url(cfg.redis.url)
        else:
            self.progress("starting local redis-server")
            self.redis = start_local_redis(password=cfg.redis.password())
            self.redis_url = self.redis.url
        policy_config = policy_config_for(cfg, self.model)
        self._start_ray()
        self.progress("starting the conductor")
        self.conductor_name = f"{cfg.name}-conductor"
        self.conductor = (
            ray.remote(Conductor)
            .options(name=self.conductor_name, namespace=self.namespace, num_cpus=0,
                     max_concurrency=1000, enable_task_events=False)
            .remote(cfg.conductor, self.namespace, policy_config)
        )
        self._actors.append(self.conductor)
        for node_id in self.store_node_ids:
            self._start_store(node_id)
        if self.store_watch_interval_s > 0:
            self._watchdog = threading.Thread(target=self._watch_store, daemon=True,
                                              name="baton-store-watchdog")
            self._watchdog.start()
        self._start_workers()
        if wait_ready:
            self.wait_ready()

    def _start_ray(self) -> None:
        if ray.is_initialized():
            self._check_pool_resources()
            return
        if self.config.ray.address:
            self.progress(f"connecting to Ray at {self.config.ray.address}")
            ray.init(address=self.config.ray.address, namespace=self.namespace,
                     log_to_driver=False)
        else:
            self.progress("starting a local Ray cluster")
            ray.init(
                address="local",  # not whatever cluster `ray start` left running on this box
                namespace=self.namespace,
                num_cpus=os.cpu_count(),
                resources={PREFILL_RESOURCE: _POOL_SLOTS, DECODE_RESOURCE: _POOL_SLOTS},
                include_dashboard=False,
                log_to_driver=False,
            )
        self._owns_ray = True
        self._check_pool_resources()

    def _check_pool_resources(self) -> None:
        """Workers need nodes that advertise the pool resources; without them they would wait
        for a node forever."""
        resources = ray.cluster_resources()
        missing = [r for r in (PREFILL_RESOURCE, DECODE_RESOURCE) if resources.get(r, 0) < 1]
        if missing:
            raise ConfigError(
                f"the Ray cluster has no node with the custom resources {missing}: start prefill "
                f"nodes with `ray start --resources='{{\"{PREFILL_RESOURCE}\": 8}}'` and decode "
                f"nodes with `{DECODE_RESOURCE}` (see deploy/)"
            )

    @property
    def store_node_ids(self) -> list[str]:
        return [f"node{i}" for i in range(self.store_nodes)]

    def store_node_for(self, role: str) -> str:
        """The store node a worker of ``role`` uses."""
        return "node1" if self.store_nodes == 2 and role == "decode" else "node0"

    def _check_store_nodes(self) -> None:
        if self.store_nodes not in (1, 2):
            raise ConfigError(f"store_nodes={self.store_nodes}: a local cluster runs 1 or 2 "
                              "store nodes")
        transfer = self.config.kvstore.transfer
        if self.store_nodes == 1:
            return
        if transfer is None:
            raise ConfigError("two local store nodes pull from each other over the transfer "
                              "engine: set kvstore.transfer (e.g. --set "
                              "kvstore.transfer.backend=tcp)")
        if transfer.token_file is None:
            # the operator's secret, else (the two nodes are this cluster's own) a fresh one,
            # handed to the store actors whatever environment Ray gives its workers
            self._transfer_env = {transfer.token_env: os.environ.get(transfer.token_env)
                                  or secrets.token_hex(16)}

    def _store_config(self, node_id: str) -> KVStoreConfig:
        """The kvstore config of ``node_id``: the configured one for ``node0``; free ports for
        the events and the block server of another node on this machine."""
        kv = self.config.kvstore
        if node_id != "node0":
            update: dict[str, object] = {"events_endpoint": None, "events_replay_endpoint": None}
            if kv.transfer is not None:
                update["transfer"] = kv.transfer.model_copy(update={"listen_port": 0,
                                                                    "ucx_port": 0})
            kv = kv.model_copy(update=update)
        return with_event_endpoints(kv, "127.0.0.1")

    def store_actor_name_of(self, node_id: str) -> str:
        return f"{self.config.name}-kvstore-{node_id}"

    def _start_store(self, node_id: str = "node0") -> None:
        assert self.model is not None
        dtype = effective_dtype(self.config.engine, self.model)
        block_bytes = kv_block_bytes(
            self.model, self.config.engine.kv_block_tokens, dtype_bytes(dtype)
        )
        name = self.store_actor_name_of(node_id)
        if node_id == "node0":
            self.store_actor_name = name
        self.progress(f"starting the KV store node {node_id}" if self.store_nodes > 1
                      else "starting the KV store node")
        kv = self._store_config(node_id)
        store = (
            ray.remote(KVStoreNode)
            .options(name=name, namespace=self.namespace, num_cpus=0,
                     # a pull waits on the network without the node's lock: other calls go on
                     max_concurrency=8 if kv.transfer is not None else 1,
                     runtime_env={"env_vars": self._transfer_env} if self._transfer_env else None,
                     enable_task_events=False)
            .remote(node_id, self.config.name, kv, block_bytes, self.redis_url,
                    self.config.engine.kv_block_tokens,
                    holder_alive=functools.partial(ray_actor_alive, namespace=self.namespace))
        )
        ray.get(store.arena_info.remote())
        self._actors.append(store)
        ray.get(self.conductor.add_store_node.remote(node_id, kv.events_endpoint,
                                                     kv.events_replay_endpoint or "", name))
        self._stores[node_id] = store

    @property
    def store(self):
        """The store node actor now serving ``node0`` (a new one once the previous one was
        replaced)."""
        return self._stores.get("node0")

    @property
    def stores(self) -> dict[str, object]:
        """Every store node actor now serving, by node id."""
        return dict(self._stores)

    def kill_store(self, timeout_s: float = 60.0, node_id: str = "node0") -> None:
        """Kill a store node's process without warning and keep it down (the watchdog does not
        replace it) until ``start_store``. Workers are not told: their connectors find out at
        their next call and recompute meanwhile. For failure drills and tests."""
        with self._store_lock:
            self._held_down.add(node_id)
            self._retire_store(timeout_s, node_id)

    def start_store(self, node_id: str = "node0") -> None:
        """Start a new store node under the same actor name (a new process, an empty arena);
        the conductor follows its event stream, the workers' connectors find it by themselves."""
        with self._store_lock:
            self._held_down.discard(node_id)
            self._start_store(node_id)

    def _retire_store(self, timeout_s: float, node_id: str = "node0") -> None:
        """Kill a store node (if it still runs), have the conductor drop its index entries,
        and wait until Ray has released its name. Holds ``_store_lock``."""
        old = self._stores[node_id]
        try:
            ray.kill(old, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if old in self._actors:
            self._actors.remove(old)
        ray.get(self.conductor.store_node_lost.remote(node_id))
        name = self.store_actor_name_of(node_id)
        deadline = time.monotonic() + timeout_s
        while True:  # the name is free once Ray has seen the old actor die
            try:
                ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"store actor {name} still registered "
                                   f"{timeout_s} s after it was killed")
            time.sleep(0.1)

    def _watch_store(self) -> None:
        """Replace a store node when it dies (a call to it raises ``RayActorError``; a slow
        answer is not a death), unless a drill holds it down."""
        while not self._stopping.wait(self.store_watch_interval_s):
            for node_id, store in list(self._stores.items()):
                try:
                    ray.get(store.arena_info.remote(), timeout=30)
                    continue
                except RayActorError:
                    pass
                except Exception:  # noqa: BLE001 - slow, or Ray is going away: not a death
                    continue
                with self._store_lock:
                    if (self._stores.get(node_id) is not store or node_id in self._held_down
                            or self._stopping.is_set()):
                        continue
                    name = self.store_actor_name_of(node_id)
                    log.warning("KV store node %s died; starting a new one", name)
                    self.progress(f"the KV store node {node_id} died; starting a new one")
                    try:
                        self._retire_store(60.0, node_id)
                        self._start_store(node_id)
                    except Exception:  # noqa: BLE001 - try again at the next check
                        log.exception("could not replace the KV store node %s", name)

    def replace_store(self) -> float:
        """``kill_store`` then ``start_store``; returns the seconds the node was gone."""
        started = time.monotonic()
        self.kill_store()
        self.start_store()
        return time.monotonic() - started

    def restart_redis(self, down_s: float = 1.0) -> None:
        """Stop the local redis-server and start a new one on the same port after ``down_s``:
        it comes back empty (no snapshot), and every store node re-registers with what it holds
        at its next heartbeat. For failure drills; needs the local Redis (no ``redis.url``)."""
        if self.redis is None:
            raise RedisUnavailable("restart_redis needs the cluster's own redis-server "
                                   "(redis.url is set)")
        port, password = self.redis.port, self.redis.password
        self.redis.stop()
        time.sleep(down_s)
        self.redis = start_local_redis(port=port, password=password)

    def _start_workers(self) -> None:
        cfg = self.config
        plan = [("prefill", i) for i in range(cfg.prefill.num_instances)]
        plan += [("decode", i) for i in range(cfg.decode.num_instances)]
        binds = _omp_binds(cfg, len(plan))
        self._pending: dict[str, object] = {}
        self._replace_lock = threading.Lock()
        self._next_index = {"prefill": cfg.prefill.num_instances, "decode": cfg.decode.num_instances}
        for (role, index), bind in zip(plan, binds):
            self._start_worker(role, f"{cfg.name}-{role}-{index}", bind)

    def _start_worker(self, role: str, instance_id: str, bind: str):
        cfg = self.config
        node_id = self.store_node_for(role)
        wiring = StoreWiring(self.store_actor_name_of(node_id), self.namespace, node_id)
        joins = ConductorWiring(self.conductor_name, self.namespace,
                                ray.get(self.conductor.events_endpoint.remote()))
        cls, resource = (PrefillWorker, PREFILL_RESOURCE) if role == "prefill" else (
            DecodeWorker, DECODE_RESOURCE)
        actor = (
            ray.remote(cls)
            .options(
                name=instance_id,
                namespace=self.namespace,
                num_cpus=0,
                resources={resource: 1},
                max_concurrency=1000,
                runtime_env={"env_vars": engine_env(cfg.engine, bind)},
                enable_task_events=False,  # see cluster.pools
            )
            .remote(instance_id, cfg.engine, self.model, wiring, joins)
        )
        self._actors.append(actor)
        (self.prefill_ids if role == "prefill" else self.decode_ids).append(instance_id)
        self._pending[instance_id] = actor.ready.remote()
        return actor

    def replace_worker(self, instance_id: str, timeout_s: float = 600.0) -> str:
        """Kill ``instance_id`` (if it still runs), drop it from the conductor, and start a
        fresh worker of the same role under the next index; returns the new id once its engine
        is up. For failure drills (``baton chaos``): a real cluster replaces workers through
        its pools (``baton scale``)."""
        with self._replace_lock:  # replacements may run in several threads at once
            role = "prefill" if instance_id in self.prefill_ids else "decode"
            try:
                ray.kill(self.actor(instance_id), no_restart=True)
            except ValueError:
                pass  # already gone
            (self.prefill_ids if role == "prefill" else self.decode_ids).remove(instance_id)
            new_id = f"{self.config.name}-{role}-{self._next_index[role]}"
            self._next_index[role] += 1
            self._start_worker(role, new_id, "nobind")
            ready = self._pending.pop(new_id)
        ray.get(self.conductor.remove.remote(instance_id))
        self.engine_start_s[new_id] = ray.get(ready, timeout=timeout_s)
        ray.get(self.conductor.mark_ready.remote(new_id))
        self.progress(f"{new_id} ready (engine start {self.engine_start_s[new_id]:.1f} s)")
        return new_id

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every worker's engine is up, telling the conductor as each one is."""
        deadline = time.monotonic() + timeout_s
        pending = dict(self._pending)
        while pending:
            refs = list(pending.values())
            done, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TimeoutError(f"workers not ready after {timeout_s} s: {sorted(pending)}")
            for instance_id, ref in list(pending.items()):
                if ref in done:
                    try:
                        self.engine_start_s[instance_id] = ray.get(ref)
                    except RayActorError as exc:
                        raise EngineStartFailed(
                            f"{instance_id}'s engine failed to start: {engine_error(exc)}") from exc
                    ray.get(self.conductor.mark_ready.remote(instance_id))
                    del pending[instance_id]
                    self.progress(
                        f"{instance_id} ready (engine start {self.engine_start_s[instance_id]:.1f} s)"
                    )
        self._pending = {}

    def actor(self, instance_id: str):
        return ray.get_actor(instance_id, namespace=self.namespace)

    def stop(self) -> None:
        self._stopping.set()  # before the store goes: the watchdog must not replace it
        with self._store_lock:  # a replacement under way finishes first
            pass
        if self._watchdog is not None:  # no call to Ray from it once Ray is shut down
            self._watchdog.join(timeout=5)
        for actor in reversed(self._actors):
            try:
                ray.get(actor.shutdown.remote(), timeout=10) if hasattr(actor, "shutdown") else None
            except Exception:
                pass
            try:
                ray.kill(actor)
            except Exception:
                pass
        self._actors.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def engine_error(exc: RayActorError) -> str:
    """The line that says why a worker died while starting (the last line of the exception its
    constructor raised, as Ray quotes it: vLLM's own words, e.g. a KV cache too small for the
    context), else Ray's whole message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head and "ActorDiedError" not in head:
            return line
    return lines[-1] if lines else type(exc).__name__
