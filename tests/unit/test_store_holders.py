"""A store node releases what a dead client process held: reservations it never committed (a
worker killed mid-transfer) are aborted, read pins it never released are dropped, and only for
holders found dead. The node class is used in-process (no Ray): the liveness check is the
test's."""

from __future__ import annotations

import time

import pytest

from kvstore.block_store import BlockState
from kvstore.config import KVStoreConfig
from kvstore.keys import KeyExtras, block_keys
from kvstore.node import KVStoreNode

BLOCK_BYTES = 256 * 1024
EXTRAS = KeyExtras(model_id="m")


def chain(seed: int, num_blocks: int):
    return block_keys([seed * 1000 + i for i in range(num_blocks * 4)], 4, EXTRAS)


def parents_of(keys):
    return [None] + list(keys[:-1])


def make_node(tmp_path, sweep_s: float = 0.0, alive=None, slots: int = 8) -> KVStoreNode:
    config = KVStoreConfig(host_capacity_bytes=slots * BLOCK_BYTES, arena_dir=str(tmp_path),
                           holder_sweep_interval_s=sweep_s)
    return KVStoreNode("node0", "t", config, BLOCK_BYTES, redis_url=None, holder_alive=alive)


@pytest.fixture
def node(tmp_path):
    n = make_node(tmp_path)
    yield n
    n.shutdown()


def test_a_dead_writer_s_reservations_are_aborted_and_its_read_pins_dropped(node):
    ready = chain(1, 2)
    node.reserve(ready, parents_of(ready), holder="w0")
    node.commit(ready, holder="w0")
    cut = chain(2, 3)
    assert None not in node.reserve(cut, parents_of(cut), holder="w1")  # a transfer under way
    assert len(node.acquire(ready, holder="w1")) == 2  # and a load
    assert node.stats().pinned_blocks == 5
    assert node.holder_counts() == {"w1": (3, 2)}

    assert node.forget_holder("w1") == (3, 2)

    assert node.stats().pinned_blocks == 0
    assert [node.store.block_info(k) for k in cut] == [None, None, None]
    assert [node.store.block_info(k).state for k in ready] == [BlockState.READY] * 2
    assert node.holder_counts() == {}
    assert (node.reclaimed_writing_blocks, node.reclaimed_read_pins) == (3, 2)
    # the keys a dead writer held are storable again by anyone
    assert None not in node.reserve(cut, parents_of(cut), holder="w2")
    assert node.forget_holder("w1") == (0, 0)  # once only


def test_settled_calls_unfile_and_anonymous_calls_are_never_filed(node):
    keys = chain(3, 3)
    node.reserve_many([(keys, parents_of(keys))], holder="w0")
    node.commit(keys[:2], holder="w0")
    node.abort(keys[2:], holder="w0")
    runs = node.acquire_many([keys[:2], keys[:1]], holder="w0")
    assert [len(run.slots) for run in runs] == [2, 1]
    assert node.holder_counts() == {"w0": (0, 3)}
    node.release(keys[:2], holder="w0")
    node.release(keys[:1], holder="w0")
    assert node.holder_counts() == {}
    other = chain(4, 2)
    node.reserve(other, parents_of(other))  # no holder: a test's or a tool's call
    assert node.holder_counts() == {}
    assert node.forget_holder("w0") == (0, 0)
    assert node.stats().pinned_blocks == 2  # the anonymous reservation is its caller's to settle


def test_a_committed_block_is_not_aborted_when_its_writer_dies_later(node):
    keys = chain(5, 2)
    node.reserve(keys, parents_of(keys), holder="w0")
    node.commit(keys[:1], holder="w0")
    assert node.forget_holder("w0") == (1, 0)
    assert node.store.block_info(keys[0]).state is BlockState.READY
    assert node.store.block_info(keys[1]) is None


def test_the_sweep_forgets_only_holders_found_dead(tmp_path):
    dead: set[str] = set()
    node = make_node(tmp_path, sweep_s=0.02, alive=lambda name: name not in dead)
    try:
        a, b = chain(6, 2), chain(7, 2)
        node.reserve(a, parents_of(a), holder="alive")
        node.reserve(b, parents_of(b), holder="crashed")
        time.sleep(0.2)
        assert node.holder_counts() == {"alive": (2, 0), "crashed": (2, 0)}
        dead.add("crashed")
        deadline = time.monotonic() + 5
        while "crashed" in node.holder_counts() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert node.holder_counts() == {"alive": (2, 0)}
        assert node.stats().pinned_blocks == 2
        assert node.store.block_info(b[0]) is None
    finally:
        node.shutdown()
