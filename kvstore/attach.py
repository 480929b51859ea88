"""One KV store node actor per Ray node, created by the first worker that lands there.

On a Ray cluster (``baton up``) the scheduler, not Baton, decides which node a worker runs on:
the pool's custom resource picks the node group, the autoscaler may add a node for it. So a
worker resolves its store only once it is running: it looks for the store actor of its own Ray
node and creates it (pinned to that node, detached) if it is not there yet. The first worker on
a node wins the creation; every worker then asks the store itself where it publishes its tier
events, so the conductor subscribes to the real sockets whoever created them.
"""

from __future__ import annotations

import logging

import msgspec

from kvstore.config import KVStoreConfig
from kvstore.events import with_event_endpoints
from kvstore.node import KVStoreNode

log = logging.getLogger(__name__)

STORE_PREFIX = "kvstore"


class StoreWiring(msgspec.Struct, frozen=True):
    """How an engine's connector reaches its node's KV store actor."""

    store_actor: str
    namespace: str
    node_id: str = "node0"
    """The store node's id: the instances on it share its host and disk tiers."""


class NodeStoreSpec(msgspec.Struct, frozen=True):
    """Everything a worker needs to create its node's store if it is the first one there."""

    cluster_name: str
    namespace: str
    config: KVStoreConfig
    block_bytes: int
    redis_url: str | None
    block_size_tokens: int


class StoreEndpoints(msgspec.Struct, frozen=True):
    node_id: str
    events_endpoint: str
    replay_endpoint: str


class NodeStore(KVStoreNode):
    """A ``KVStoreNode`` that can say where its tier events are published."""

    def __init__(self, node_id: str, cluster_name: str, config: KVStoreConfig, block_bytes: int,
                 redis_url: str | None, block_size_tokens: int) -> None:
        super().__init__(node_id, cluster_name, config, block_bytes, redis_url, block_size_tokens)
        self._endpoints = StoreEndpoints(node_id, config.events_endpoint or "",
                                         config.events_replay_endpoint or "")

    def endpoints(self) -> StoreEndpoints:
        return self._endpoints


def store_node_id(ray_node_id: str) -> str:
    """Baton's short name for a Ray node (its id's first 12 hex digits)."""
    return f"n{ray_node_id[:12]}"


def store_actor_name(cluster_name: str, node_id: str) -> str:
    return f"{cluster_name}-{STORE_PREFIX}-{node_id}"


def _reachable_transfer(config: KVStoreConfig, host: str) -> KVStoreConfig:
    """A block server left on its loopback default listens on the node's own address instead,
    so store nodes on other machines can pull from it."""
    transfer = config.transfer
    if transfer is None or transfer.advertise_host is not None or transfer.listen_host not in (
            "127.0.0.1", "localhost"):
        return config
    return config.model_copy(update={"transfer": transfer.model_copy(update={"listen_host": host})})


def ensure_node_store(spec: NodeStoreSpec, conductor_actor: str | None) -> StoreWiring:
    """The store of the Ray node this process runs on (created if missing), subscribed to by
    the conductor named ``conductor_actor``. Call from inside a Ray actor."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray_node = ray.get_runtime_context().get_node_id()
    node_id = store_node_id(ray_node)
    name = store_actor_name(spec.cluster_name, node_id)
    host = ray.util.get_node_ip_address()
    kv = _reachable_transfer(with_event_endpoints(spec.config, host), host)
    store = (
        ray.remote(NodeStore)
        .options(name=name, namespace=spec.namespace, lifetime="detached", get_if_exists=True,
                 num_cpus=0, max_concurrency=8,  # a pull waits on the network unlocked
                 scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node, soft=False),
                 enable_task_events=False)
        .remote(node_id, spec.cluster_name, kv, spec.block_bytes, spec.redis_url,
                spec.block_size_tokens)
    )
    endpoints: StoreEndpoints = ray.get(store.endpoints.remote())
    if conductor_actor is not None:
        conductor = ray.get_actor(conductor_actor, namespace=spec.namespace)
        ray.get(conductor.add_store_node.remote(node_id, endpoints.events_endpoint,
                                                endpoints.replay_endpoint, name))
    log.info("using KV store %s on node %s", name, node_id)
    return StoreWiring(name, spec.namespace, node_id)
