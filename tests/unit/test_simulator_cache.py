"""The simulator's caches: exact eviction orders, pins, tiers, and the index's leading runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.cache import BlockIndex, DeviceCache, NodeStore


def make_index(num_nodes: int = 1, per_node: int = 1) -> BlockIndex:
    node_of = [n for n in range(num_nodes) for _ in range(per_node)]
    members = [[n * per_node + i for i in range(per_node)] for n in range(num_nodes)]
    return BlockIndex(node_of, members)


def test_device_cache_evicts_leaves_before_their_ancestors():
    index = make_index()
    cache = DeviceCache(4, 0, index)
    cache.insert(["a", "b", "c"])
    assert cache.lru_order() == ["c", "b", "a"]  # leaf oldest, root newest
    cache.insert(["a", "d"])
    assert cache.lru_order() == ["c", "b", "d", "a"]
    cache.insert(["e"])
    assert cache.lru_order() == ["b", "d", "a", "e"]  # c went first; a outlives b and d
    assert "c" not in cache and "c" not in index.device
    cache.insert(["f", "g"])
    assert cache.lru_order() == ["a", "e", "g", "f"]
    assert cache.num_evicted_blocks == 3
    cache.check_invariants()


def test_pinned_blocks_are_never_evicted_and_private_blocks_count():
    index = make_index()
    cache = DeviceCache(5, 0, index)
    assert cache.can_acquire(["a", "b"], 2)
    cache.acquire(["a", "b"], 2)
    assert cache.num_used_blocks == 4
    assert not cache.can_acquire(["c", "d"], 0)  # 4 used + 2 new > 5
    assert cache.can_acquire(["a", "c"], 0)  # a is already pinned: one new block
    cache.insert(["x"])
    cache.insert(["y"])  # only x can make room
    assert cache.lru_order() == ["y"]
    cache.release(["a", "b"], 2)
    assert cache.num_used_blocks == 0
    assert cache.lru_order() == ["y", "b", "a"]
    cache.check_invariants()


def test_a_block_pinned_twice_stays_pinned_until_both_release():
    index = make_index()
    cache = DeviceCache(3, 0, index)
    cache.acquire(["a"], 0)
    cache.acquire(["a", "b"], 0)
    cache.release(["a"], 0)
    assert cache.lru_order() == []
    cache.insert(["c"])
    cache.insert(["d"])  # room for one unpinned block only: c goes, a and b stay pinned
    assert "a" in cache and "b" in cache and cache.lru_order() == ["d"]
    cache.release(["a", "b"], 0)
    assert cache.lru_order() == ["d", "b", "a"]
    cache.check_invariants()


def test_node_store_demotes_to_disk_and_promotes_back():
    index = make_index()
    store = NodeStore(0, 2, 2, index)
    store.put(["a", "b", "c"])
    assert store.host_order() == ["b", "a"] and store.disk_order() == ["c"]
    store.put(["d"])
    assert store.host_order() == ["a", "d"] and store.disk_order() == ["c", "b"]
    store.put(["e"])
    assert store.host_order() == ["d", "e"] and store.disk_order() == ["b", "a"]
    assert store.num_dropped_blocks == 1  # c
    store.put(["a", "b"], insert_absent=False)  # a read from disk promotes the chain
    assert store.host_order() == ["b", "a"] and store.disk_order() == ["d", "e"]
    assert index.host == {"a": {0}, "b": {0}} and index.disk == {"d": {0}, "e": {0}}
    store.check_invariants()


def test_leading_runs_count_each_block_in_its_fastest_tier():
    index = make_index(num_nodes=2, per_node=2)
    caches = [DeviceCache(10, i, index) for i in range(4)]
    stores = [NodeStore(n, 10, 10, index) for n in range(2)]
    stores[0].put(["a", "b", "c"])
    caches[0].insert(["a", "b"])
    caches[3].insert(["a"])
    runs = index.leading_runs(["a", "b", "c", "d"])
    assert runs == {0: [2, 1, 0], 1: [0, 3, 0], 3: [1, 0, 0]}
    for i in range(4):
        assert tuple(runs.get(i, [0, 0, 0])) == index.leading_run(i, ["a", "b", "c", "d"])


chains = st.lists(st.integers(0, 3), min_size=1, max_size=5).map(
    lambda path: tuple("/".join(map(str, path[: i + 1])) for i in range(len(path))))
"""A prompt's keys: every key names its block and all before it, like the trace's hash ids."""


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), chains), min_size=1, max_size=40), chains)
def test_leading_runs_equal_walking_each_instance(ops, query):
    """Leaf-first order keeps device caches and node stores prefix-closed, which is what lets
    ``leading_runs`` walk holders rather than instances; a block-by-block walk must agree."""
    index = make_index(num_nodes=2, per_node=2)
    caches = [DeviceCache(6, i, index) for i in range(4)]
    stores = [NodeStore(n, 3, 4, index) for n in range(2)]
    for target, keys in ops:
        if target < 4:
            caches[target].insert(keys)
        else:
            stores[target - 4].put(keys)
        for cache in caches:
            cache.check_invariants()
        for store in stores:
            store.check_invariants()
    runs = index.leading_runs(query)
    for i in range(4):
        expected = index.leading_run(i, query)
        assert tuple(runs.get(i, [0, 0, 0])) == expected
