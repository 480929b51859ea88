"""Baton on an existing Ray cluster: ``baton up``, ``down``, ``status``, ``scale``, ``drain``.

Everything ``baton up`` starts is a detached named actor in the config's Ray namespace, named
after the cluster (``<name>-conductor``, ``<name>-gateway``, ``<name>-redis``,
``<name>-kvstore-<node>``, ``<name>-prefill-<i>``, ``<name>-decode-<i>``), so any later command
finds it by name and ``baton down`` removes exactly what belongs to the cluster. The conductor
owns the pools (``cluster.pools``): it starts workers, drains them and removes them; the CLI
only asks. Workers carry their pool's custom resource (``baton_prefill`` / ``baton_decode``),
so a worker that no node can host stays pending, which is what asks the Ray autoscaler for a
node of that group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import msgspec
import ray

from cluster.config import ClusterConfig
from cluster.pools import POOL_RESOURCES, LaunchSpec
from protos.errors import BatonError
from protos.wire import PoolSizes, PoolStatus, ScaleResult

UP_SCALE_REASON = "baton up: initial pool size from the config"


class NoRayCluster(BatonError):
    """No Ray cluster to run on (no address given, or it does not answer)."""


class NotUp(BatonError):
    """Baton is not running on this Ray cluster (under that name and namespace)."""


def actor_names(name: str) -> dict[str, str]:
    return {"conductor": f"{name}-conductor", "gateway": f"{name}-gateway", "redis": f"{name}-redis"}


class RedisHost:
    """A Redis server owned by a detached actor (it dies with the actor): for clusters without
    ``redis.url``. Production clusters should point ``redis.url`` at a managed Redis."""

    def __init__(self, password: str | None = None) -> None:
        from kvstore.redis_server import start_local_redis

        self._redis = start_local_redis(password=password)

    def url(self) -> str:
        return self._redis.url

    def stop(self) -> None:
        self._redis.stop()


def connect(address: str | None, namespace: str) -> None:
    """Join the Ray cluster at ``address`` (or ``$RAY_ADDRESS``) as a driver."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise NoRayCluster("no Ray cluster given: pass --address HOST:PORT (or 'auto' on a node of "
                           "the cluster) or set RAY_ADDRESS; for one machine use `baton serve`")
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False,
                 logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise NoRayCluster(f"cannot reach a Ray cluster at '{address}': {exc}") from exc


def _get(name: str, namespace: str):
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _near_driver():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)


@dataclass
class UpResult:
    already_up: bool
    addresses: object
    scale: list[ScaleResult]


def up(cfg: ClusterConfig, progress: Callable[[str], None], timeout_s: float) -> UpResult:
    """Start Baton on the connected Ray cluster; if it is already up, start only what is missing
    (the fronts) and change nothing else."""
    from cluster.control import ClusterConductor as Conductor
    from cluster.gateway_host import GatewayHost
    from cluster.local import kv_block_bytes, policy_config_for
    from engine.builder import dtype_bytes, effective_dtype
    from engine.models import prepare_model
    from kvstore.attach import NodeStoreSpec
    from worker.base import ConductorWiring

    ns, names = cfg.ray.namespace, actor_names(cfg.name)
    resources = ray.cluster_resources()
    for role, resource in POOL_RESOURCES.items():
        if resources.get(resource, 0) < 1:
            progress(f"warning: no node advertises '{resource}' yet: {role} workers stay pending "
                     "until the autoscaler (or you) adds one (see deploy/)")
    progress(f"preparing model '{cfg.engine.model}'")
    model = prepare_model(cfg.engine.model, progress=progress)
    conductor = _get(names["conductor"], ns)
    already_up = conductor is not None
    scale_results: list[ScaleResult] = []
    if not already_up:
        redis_url = cfg.redis.client_url(cfg.redis.url) if cfg.redis.url else None
        if redis_url is None:
            progress("starting redis-server (redis.url is unset)")
            redis = (ray.remote(RedisHost)
                     .options(name=names["redis"], namespace=ns, lifetime="detached", num_cpus=0,
                              get_if_exists=True, scheduling_strategy=_near_driver(),
                              enable_task_events=False)
                     .remote(cfg.redis.password()))
            redis_url = ray.get(redis.url.remote())
        progress("starting the conductor")
        conductor = (ray.remote(Conductor)
                     .options(name=names["conductor"], namespace=ns, lifetime="detached", num_cpus=0,
                              max_concurrency=1000, scheduling_strategy=_near_driver(),
                              enable_task_events=False)
                     .remote(cfg.conductor, ns, policy_config_for(cfg, model), "auto"))
        events_endpoint = ray.get(conductor.events_endpoint.remote())
        dtype = effective_dtype(cfg.engine, model)
        block_size = cfg.engine.kv_block_tokens
        spec = LaunchSpec(
            cfg.name, cfg.engine, model,
            NodeStoreSpec(cfg.name, ns, cfg.kvstore, kv_block_bytes(model, block_size, dtype_bytes(dtype)),
                          redis_url, block_size),
            ConductorWiring(names["conductor"], ns, events_endpoint),
            num_gpus_per_instance=1.0 if cfg.engine.device == "cuda" else 0.0,
        )
        ray.get(conductor.set_launch_spec.remote(spec))
    gateway = _get(names["gateway"], ns)
    if gateway is None:
        progress("starting the gateway (gRPC + OpenAI HTTP + /metrics)")
        gateway = (ray.remote(GatewayHost)
                   .options(name=names["gateway"], namespace=ns, lifetime="detached", num_cpus=0,
                            max_concurrency=1000, scheduling_strategy=_near_driver(),
                            enable_task_events=False)
                   .remote(cfg, model, names["conductor"]))
    addresses = ray.get(gateway.start.remote())
    if not already_up:
        progress(f"starting {cfg.prefill.num_instances} prefill and {cfg.decode.num_instances} "
                 "decode workers")
        scale_results = ray.get(conductor.scale.remote(
            PoolSizes(prefill=cfg.prefill.num_instances, decode=cfg.decode.num_instances),
            timeout_s, UP_SCALE_REASON))
        ray.get(conductor.start_autoscaler.remote(cfg.autoscale))
    return UpResult(already_up, addresses, scale_results)


def _conductor(name: str, namespace: str):
    conductor = _get(actor_names(name)["conductor"], namespace)
    if conductor is None:
        raise NotUp(f"Baton '{name}' is not up in Ray namespace '{namespace}': run `baton up` "
                    "(or pass the --name/--namespace it was started with)")
    return conductor


def status(name: str, namespace: str) -> tuple[PoolStatus, object]:
    conductor = _conductor(name, namespace)
    gateway = _get(actor_names(name)["gateway"], namespace)
    addresses = ray.get(gateway.addresses.remote()) if gateway is not None else None
    return ray.get(conductor.pool_status.remote()), addresses


def scale(name: str, namespace: str, sizes: PoolSizes, timeout_s: float) -> list[ScaleResult]:
    return ray.get(_conductor(name, namespace).scale.remote(sizes, timeout_s))


def drain(name: str, namespace: str, instance_id: str, timeout_s: float):
    return ray.get(_conductor(name, namespace).drain.remote(instance_id, timeout_s))


def set_autoscale(name: str, namespace: str, enabled: bool):
    """Apply the planner's decisions, or stop (``baton autoscale on|off``)."""
    return ray.get(_conductor(name, namespace).set_autoscale.remote(enabled))


def pin(name: str, namespace: str, pin_name: str, text: str, cache_salt: str):
    """Soft-pin ``text``'s blocks (tokenized as the fronts do) on every store node."""
    conductor = _conductor(name, namespace)
    gateway = _get(actor_names(name)["gateway"], namespace)
    if gateway is None:
        raise NotUp(f"Baton '{name}' has no gateway to tokenize with: run `baton up`")
    token_ids = ray.get(gateway.tokenize.remote(text))
    return ray.get(conductor.pin_prefix.remote(pin_name, token_ids, cache_salt))


def unpin(name: str, namespace: str, pin_name: str):
    return ray.get(_conductor(name, namespace).unpin_prefix.remote(pin_name))


class RayOperator:
    """The operator verbs on cluster ``name`` through Ray (the driver is connected): what the CLI
    calls without ``--endpoint``. ``cli.admin_client.AdminClient`` has the same verbs
    through the gateway's Admin service; both end in the same conductor actor methods."""

    def __init__(self, name: str, namespace: str) -> None:
        self.name, self.namespace = name, namespace

    def status(self):
        from gateway.admin_wire import StatusView

        pools, addresses = status(self.name, self.namespace)
        return StatusView(pools, addresses, self.name)

    def scale(self, sizes: PoolSizes, timeout_s: float) -> list[ScaleResult]:
        return scale(self.name, self.namespace, sizes, timeout_s)

    def drain(self, instance_id: str, timeout_s: float):
        return drain(self.name, self.namespace, instance_id, timeout_s)

    def pin(self, pin_name: str, text: str, cache_salt: str = ""):
        return pin(self.name, self.namespace, pin_name, text, cache_salt)

    def unpin(self, pin_name: str):
        return unpin(self.name, self.namespace, pin_name)

    def set_autoscale(self, enabled: bool):
        return set_autoscale(self.name, self.namespace, enabled)

    def close_session(self, session_id: str, tenant: str = "", api_key: str = ""):
        """End an agent session (``gateway.sessions``: scoped to the key and tenant its requests
        carried); ``UnknownSession`` when none is live."""
        from gateway.sessions import UnknownSession, scoped_session_id

        ended = ray.get(_conductor(self.name, self.namespace).close_session.remote(
            scoped_session_id(api_key, tenant, session_id)))
        if ended is None:
            raise UnknownSession(f"no live session {session_id!r} under that API key and tenant "
                                 f"{tenant!r}: it was never opened, is closed already, or its TTL "
                                 "lapsed")
        return msgspec.structs.replace(ended, session_id=session_id)


def down(name: str, namespace: str, progress: Callable[[str], None]) -> list[str]:
    """Remove every actor of cluster ``name``: fronts first (no new requests), then workers,
    stores, the conductor and Redis. Returns the names removed (none: nothing was up)."""
    prefix = f"{name}-"
    present = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a.get("namespace") == namespace and a["name"].startswith(prefix))
    names = actor_names(name)

    def rank(actor_name: str) -> int:
        if actor_name == names["gateway"]:
            return 0
        if actor_name.startswith((f"{name}-prefill-", f"{name}-decode-")):
            return 1
        if actor_name.startswith(f"{name}-kvstore-"):
            return 2
        return 3 if actor_name == names["conductor"] else 4

    removed = []
    for actor_name in sorted(present, key=rank):
        actor = _get(actor_name, namespace)
        if actor is None:
            continue
        for method in ("stop", "shutdown"):
            if hasattr(actor, method):
                try:
                    ray.get(getattr(actor, method).remote(), timeout=15)
                except Exception:
                    pass
                break
        ray.kill(actor, no_restart=True)
        removed.append(actor_name)
        progress(f"removed {actor_name}")
    return removed
