"""Leases across store nodes: a lease travels with its blocks when another node pulls them (the
puller holds it under the same id and tenant, for the time it had left), the pulled leased
blocks outlive plain ones there, and a node that dies takes its leases with it while the other
node keeps serving (its sessions recompute what was on the dead one). Real parts: one
redis-server, two store nodes as Ray actors (own processes, arenas and block servers, node
``a`` with a disk tier), a worker's ``StoreClient`` in the test process."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from kvstore.client import StoreClient
from kvstore.config import KVStoreConfig, TransferConfig
from kvstore.host_arena import HostArena
from kvstore.keys import BlockKey
from kvstore.node import KVStoreNode
from kvstore.redis_server import start_local_redis
from kvstore.standalone import synthetic_block, synthetic_chain

NAMESPACE = "lease-pull"
SECRET = "lease-pull-secret"
BLOCK_BYTES = 64 * 1024
HOST_BLOCKS = 16  # the config's floor (1 MiB) in these blocks
ENV = {"BATON_TRANSFER_TOKEN": SECRET}


class Nodes:
    def __init__(self, redis_url: str, disk_dir) -> None:
        self.redis_url, self.disk_dir = redis_url, disk_dir
        self.actors: dict[str, object] = {}
        self.arenas: dict[str, HostArena] = {}

    def start(self, node: str, disk: bool = False):
        config = KVStoreConfig(
            host_capacity_bytes=HOST_BLOCKS * BLOCK_BYTES, arena_dir="/dev/shm",
            disk_dir=str(self.disk_dir) if disk else None, disk_capacity_bytes=4 << 20,
            heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0,
            lease_max_bytes=12 * BLOCK_BYTES, lease_max_bytes_per_tenant=8 * BLOCK_BYTES,
            transfer=TransferConfig(backend="tcp", same_node_shared_memory=False),
        )
        actor = (ray.remote(KVStoreNode)
                 .options(name=f"{NAMESPACE}-kvstore-{node}", namespace=NAMESPACE, num_cpus=0,
                          max_concurrency=8, runtime_env={"env_vars": ENV})
                 .remote(node, NAMESPACE, config, BLOCK_BYTES, self.redis_url, 16))
        info = ray.get(actor.arena_info.remote())
        self.actors[node] = actor
        self.arenas[node] = HostArena(info.path, info.slot_bytes, info.num_slots, create=False)
        return actor

    def write(self, node: str, keys: list[BlockKey]) -> None:
        """A worker's save: reserve, copy the bytes into the arena, commit."""
        actor = self.actors[node]
        slots = ray.get(actor.reserve.remote(keys, [None, *keys[:-1]]))
        assert all(slot is not None for slot in slots)
        for key, slot in zip(keys, slots):
            self.arenas[node].slot(slot).numpy()[:] = synthetic_block(key, BLOCK_BYTES)
        ray.get(actor.commit.remote(keys))

    def read(self, node: str, keys: list[BlockKey]) -> int:
        """How many leading blocks of ``keys`` the node serves, with their bytes checked."""
        actor = self.actors[node]
        slots = ray.get(actor.acquire.remote(keys))
        for key, slot in zip(keys, slots):
            assert np.array_equal(self.arenas[node].slot(slot).numpy(),
                                  synthetic_block(key, BLOCK_BYTES))
        ray.get(actor.release.remote(keys[:len(slots)]))
        return len(slots)


def wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """Until Ray reports ``actor`` dead, then its heartbeat's TTL: gone from the directory too."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.arena_info.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        assert time.monotonic() < deadline, "the killed store node kept answering"
        time.sleep(0.1)
    time.sleep(1.5)  # heartbeat_ttl_s = 1.0


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    redis = start_local_redis()
    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    n = Nodes(redis.url, tmp_path_factory.mktemp("disk-a"))
    try:
        n.start("a", disk=True)
        n.start("b")
        yield n
    finally:
        ray.shutdown()
        redis.stop()
        for arena in n.arenas.values():  # the nodes were killed, not shut down
            arena.close()
            arena.unlink()


def test_a_pull_carries_the_lease_and_the_dead_nodes_leases_go_with_it(nodes) -> None:
    a, b = nodes.actors["a"], nodes.actors["b"]
    session, trunk, other, filler = (synthetic_chain(seed, 6) for seed in (1, 2, 3, 4))
    nodes.write("a", session)
    info = ray.get(a.lease.remote("s-1", "acme", session, 600.0))
    assert (info.num_keys, info.num_present_blocks) == (6, 6)
    nodes.write("a", trunk)
    nodes.write("a", other)  # 18 blocks on 16 slots: plain ones go to a's disk, never the lease
    stats = ray.get(a.lease_stats.remote())
    assert (stats.leased_blocks, stats.num_leases, stats.by_tenant) == (
        6, 1, {"acme": 6 * BLOCK_BYTES})
    assert ray.get(a.tier_counters.remote()).demoted_blocks == 2
    assert ray.get(a.stats.remote()).leased_blocks == 6  # all of them still in host memory

    nodes.write("b", session[:2])  # b computed the session's first blocks itself, plain
    pulled = ray.get(b.pull.remote(session, "a"))
    assert (pulled.num_local, pulled.num_pulled, pulled.error) == (2, 4, "")
    pulled = ray.get(b.pull.remote(trunk, "a"))  # a plain prefix: it arrives plain
    assert (pulled.num_pulled, pulled.error) == (6, "")

    stats = ray.get(b.lease_stats.remote())  # the lease covers b's own leading blocks too
    assert (stats.leased_blocks, stats.leased_bytes, stats.num_leases) == (6, 6 * BLOCK_BYTES, 1)
    assert stats.by_tenant == {"acme": 6 * BLOCK_BYTES}
    # the same lease, with the time it had left on a: naming it again on b renews it there
    client = StoreClient(f"{NAMESPACE}-kvstore-b", NAMESPACE, attach_timeout_s=10)
    renewed = client.lease_now("s-1", "acme", session, 600.0)
    assert (renewed.num_keys, renewed.num_present_blocks, renewed.leased_bytes) == (
        6, 6, 6 * BLOCK_BYTES)
    assert 599 < renewed.expires_in_s <= 600

    # on b the pulled leased blocks outlive the plain ones: 18 blocks on 16 slots, no disk
    nodes.write("b", filler)
    assert nodes.read("b", session) == 6
    assert nodes.read("b", trunk) < 6
    assert ray.get(b.stats.remote()).leased_blocks == 6

    # a dies: its leases are simply gone; b keeps serving, and leasing, and pulling fails soft
    ray.kill(a, no_restart=True)
    wait_until_dead(a)  # ray.kill only asks: a's block server may still answer for a moment
    failed = ray.get(b.pull.remote(other, "a"))
    assert failed.num_pulled == 0 and failed.error
    assert nodes.read("b", session) == 6
    fresh = synthetic_chain(5, 4)
    nodes.write("b", fresh)
    client.lease("c-2", "acme", fresh[:2], 60.0)  # fire and forget, then a waited call
    assert client.release_lease_now("s-1") == 6
    deadline = time.monotonic() + 10  # s-1 is released: one lease means c-2 has landed
    while (stats := ray.get(b.lease_stats.remote())).num_leases != 1:
        assert time.monotonic() < deadline, "the fire-and-forget lease never landed"
        time.sleep(0.05)
    assert (stats.leased_blocks, stats.num_leases, stats.lease_evictions) == (2, 1, 0)
    nodes.write("b", synthetic_chain(6, 12))  # plain blocks make room; c-2's stay
    assert nodes.read("b", fresh[:2]) == 2 and nodes.read("b", session) == 0
    client.release_lease("c-2")  # fire and forget
    deadline = time.monotonic() + 10
    while ray.get(b.stats.remote()).leased_blocks:
        assert time.monotonic() < deadline, "the fire-and-forget release never landed"
        time.sleep(0.05)
    assert ray.get(b.lease_stats.remote()).num_leases == 0
