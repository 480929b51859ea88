"""A worker's store client outlives its store node: real Ray, a real ``KVStoreNode`` actor killed
without warning and started again under the same name (a new process, a new arena). While it is
gone nothing is found, nothing is saved and nothing raises; the client finds the new store by
itself; and the dead store's pins are never released in the new one."""

from __future__ import annotations

import time

import pytest
import ray

from kvstore.client import StoreClient, StoreSlots
from kvstore.config import KVStoreConfig
from kvstore.keys import KeyExtras, block_keys
from kvstore.node import KVStoreNode

NAMESPACE = "store-client"
NAME = "store-client-kvstore-n0"
BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def wait_gone() -> None:
    """Until Ray has seen the killed store die (``ray.kill`` returns before) and freed its name."""
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get_actor(NAME, namespace=NAMESPACE)
        except ValueError:
            return
        assert time.monotonic() < deadline
        time.sleep(0.05)


def start_store():
    config = KVStoreConfig(host_capacity_bytes=1 << 20, arena_dir="/dev/shm")
    store = (ray.remote(KVStoreNode).options(name=NAME, namespace=NAMESPACE, num_cpus=0)
             .remote("n0", "storeclient", config, BLOCK_BYTES, None, 4))
    ray.get(store.arena_info.remote())
    return store


def keys(n: int):
    return block_keys(list(range(4 * n)), 4, KeyExtras(model_id="m"))


def save(client: StoreClient, chain, fill: int) -> str:
    granted = client.reserve(chain, [None, *chain[:-1]])
    assert None not in granted.slots
    for slot in granted.slots:
        client.arena.slot(slot).fill_(fill)
    assert client.commit(chain, granted.arena_path)
    return granted.arena_path


def test_the_client_recomputes_while_the_store_is_gone_and_finds_the_new_one(ray_cluster):
    old_store = start_store()
    client = StoreClient(NAME, NAMESPACE, reattach_interval_s=0.05)
    chain = keys(2)
    old_path = save(client, chain, fill=7)
    held = client.acquire(chain)
    assert held == StoreSlots(old_path, held.slots) and len(held.slots) == 2

    ray.kill(old_store, no_restart=True)
    wait_gone()

    assert client.acquire(chain) == StoreSlots("", [])  # a miss: the engine recomputes
    assert client.reserve(chain, [None, chain[0]]) == StoreSlots("", [None, None])  # dropped
    assert client.commit(chain, old_path) is False
    client.release(chain, old_path)  # nothing to release: the pins died with the store
    # the blocks pinned before the death are still readable from the old arena: no one can be
    # granted their slots any more
    old_arena = client.arena_for(old_path)
    assert old_arena is not None
    assert old_arena.slot(held.slots[0]).eq(7).all()
    assert client.stats.failed_calls >= 1 and not client.attached

    new_store = start_store()
    time.sleep(0.1)  # past the reattach interval
    assert client.acquire(chain) == StoreSlots(client.arena_path, [])  # found by itself; empty
    assert client.attached and client.stats.reattaches == 1
    new_path = client.arena_path
    assert new_path not in ("", old_path)

    save(client, chain[:1], fill=9)
    again = client.acquire(chain[:1])
    assert again.arena_path == new_path and ray.get(new_store.stats.remote()).pinned_blocks == 1
    client.release(chain[:1], old_path)  # a pin of the dead store: must not free the new one's
    assert ray.get(new_store.stats.remote()).pinned_blocks == 1
    client.release(chain[:1], new_path)
    assert ray.get(new_store.stats.remote()).pinned_blocks == 0
    assert client.arena_for(old_path) is None  # the old arena is no longer mapped

    # idle while the node is replaced again: the first call goes to the newest store, no miss
    ray.kill(new_store, no_restart=True)
    wait_gone()
    third_store = start_store()
    third_path = save(client, chain[:1], fill=5)
    assert third_path not in (new_path, old_path) and client.stats.reattaches == 2
    assert client.acquire(chain[:1]).arena_path == third_path
    client.release(chain[:1], third_path)
    ray.get(third_store.shutdown.remote())


def test_the_writers_checksums_reach_the_store_with_its_commit(ray_cluster):
    """Sent with ``commit_later`` (and ``commit``) through Ray, the store node keeps them as the
    blocks' XXH3s: its first serve gives them back as they were sent, hashing nothing."""
    try:  # a store left by an earlier test of the module
        ray.kill(ray.get_actor(NAME, namespace=NAMESPACE), no_restart=True)
        wait_gone()
    except ValueError:
        pass
    store = start_store()
    try:
        client = StoreClient(NAME, NAMESPACE)
        later, now = keys(2), keys(3)[2:]
        granted = client.reserve(later, [None, later[0]])
        client.commit_later(later, granted.arena_path, checksums=[11, 12])
        ray.get(client.unsettled_commits())
        granted = client.reserve(now, [later[1]])
        assert client.commit(now, granted.arena_path, checksums=[13])
        served = ray.get(store.pin_for_transfer.remote([*later, *now]))
        assert served.checksums == [11, 12, 13]
    finally:
        ray.kill(store, no_restart=True)
        wait_gone()
