"""The conductor follows a store node through its loss and its replacement by a new process:
what the old process said leaves the index, and the new process's event stream (sequence numbers
from 0 again, at a new endpoint) is indexed from its first batch, replayed if the subscription
missed it. Real store nodes (in this process) and the conductor's real ZMQ subscriber."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from conductor.conductor import Conductor
from conductor.config import ConductorConfig
from conductor.policy import PolicyConfig
from kvstore.config import KVStoreConfig
from kvstore.keys import KeyExtras, block_keys
from kvstore.node import KVStoreNode
from kvstore.redis_server import free_port

pytestmark = pytest.mark.asyncio(loop_scope="session")

BLOCK_BYTES = 64 * 1024


@pytest_asyncio.fixture(loop_scope="session")
async def conductor():
    conductor = Conductor(ConductorConfig(), "t", PolicyConfig())
    yield conductor
    for task in conductor._tasks:
        task.cancel()
    await asyncio.gather(*conductor._tasks, return_exceptions=True)
    conductor._ctx.destroy(linger=0)


def start_node(folder) -> tuple[KVStoreNode, str, str]:
    folder.mkdir()
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = KVStoreConfig(host_capacity_bytes=16 * BLOCK_BYTES, arena_dir=str(folder),
                           events_endpoint=events, events_replay_endpoint=replay)
    return KVStoreNode("node0", "t", config, BLOCK_BYTES, None, block_size_tokens=4), events, replay


def write(node: KVStoreNode, seed: int, num_blocks: int) -> None:
    keys = block_keys([seed * 1000 + i for i in range(4 * num_blocks)], 4, KeyExtras(model_id="m"))
    node.reserve(keys, [None, *keys[:-1]])
    node.commit(keys)


async def host_blocks_become(conductor: Conductor, expected: int) -> int:
    deadline = time.monotonic() + 5
    while conductor.state.index.num_blocks()["host"] != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return conductor.state.index.num_blocks()["host"]


async def test_a_lost_store_node_leaves_the_index_and_its_new_process_is_indexed_afresh(
        tmp_path, conductor):
    old, events, replay = start_node(tmp_path / "old")
    new = None
    try:
        await conductor.add_store_node("node0", events, replay)
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        write(old, seed=1, num_blocks=3)
        assert await host_blocks_become(conductor, 3) == 3

        await conductor.store_node_lost("node0")
        assert conductor.state.index.num_blocks()["host"] == 0
        old.shutdown()

        new, new_events, new_replay = start_node(tmp_path / "new")
        write(new, seed=2, num_blocks=2)  # batch 0: published before anyone listens
        await conductor.add_store_node("node0", new_events, new_replay)
        await asyncio.sleep(0.3)
        write(new, seed=3, num_blocks=1)  # batch 1: shows the gap, batch 0 is replayed

        assert await host_blocks_become(conductor, 3) == 3
        assert (await conductor.status()).last_seq_by_source["node0"] == 1
    finally:
        for node in (old, new):
            if node is not None and node.arena.slots is not None:
                node.shutdown()


async def test_a_store_node_announced_at_a_new_endpoint_replaces_the_old_process(
        tmp_path, conductor):
    """On a Ray cluster a node's store is announced by every worker on it: the same endpoint is
    nothing new, another endpoint is a new process of that node (its old entries go)."""
    old, events, replay = start_node(tmp_path / "old")
    new = None
    try:
        await conductor.add_store_node("node0", events, replay)
        await asyncio.sleep(0.3)
        write(old, seed=4, num_blocks=2)
        assert await host_blocks_become(conductor, 2) == 2
        await conductor.add_store_node("node0", events, replay)  # another worker announces it
        assert conductor.state.index.num_blocks()["host"] == 2

        new, new_events, new_replay = start_node(tmp_path / "new")
        await conductor.add_store_node("node0", new_events, new_replay)
        assert conductor.state.index.num_blocks()["host"] == 0
        await asyncio.sleep(0.3)
        write(old, seed=5, num_blocks=1)  # the old process is no longer listened to
        write(new, seed=6, num_blocks=1)
        assert await host_blocks_become(conductor, 1) == 1
    finally:
        for node in (old, new):
            if node is not None and node.arena.slots is not None:
                node.shutdown()
