"""A store node executes the transfer plan it is given (``KVStoreNode.execute``): it reads exactly
the planned blocks from exactly the planned node, even where Redis shows another node holding a
longer run, and chooses a source itself only when it is given none. Real parts: one
redis-server, two source nodes as child processes (``python -m kvstore.standalone``), the pulling
node in this process, over tcp."""

from __future__ import annotations

import pytest

from kvstore.node import TransferPlan
from kvstore.standalone import synthetic_chain
from tests.integration.test_transfer_nodes import (  # noqa: F401 - fixtures
    NodeProcess,
    _environment,
    assert_blocks,
    node_config,
    pulling_node,
    redis_url,
)

CHAIN = 7


@pytest.fixture(scope="module")
def sources(tmp_path_factory, redis_url):  # noqa: F811 - the fixture above
    """Node ``long`` holds 12 blocks of the chain, node ``short`` its first 4."""
    long = NodeProcess("long", node_config(tmp_path_factory.mktemp("long"), 16), [f"{CHAIN}:12"],
                       redis_url)
    short = NodeProcess("short", node_config(tmp_path_factory.mktemp("short"), 16),
                        [f"{CHAIN}:4"], redis_url)
    yield long, short
    long.stop()
    short.stop()


def held(node, keys) -> list:
    slots = node.acquire(keys)
    blocks = [node.arena.slot(s).numpy() for s in slots]
    assert_blocks(keys[:len(slots)], blocks)
    node.release(keys[:len(slots)])
    return slots


def test_the_plan_names_the_source_and_the_store_does_not_choose_again(redis_url, sources):  # noqa: F811
    keys = synthetic_chain(CHAIN, 12)
    node = pulling_node("planned", 16, redis_url)
    try:
        result = node.execute(TransferPlan("short", tuple(keys)))
        # ``long`` holds the whole run, but the plan said ``short``: its 4 blocks, nothing else
        assert (result.num_local, result.num_pulled, result.source) == (0, 4, "short")
        assert result.error == "node short no longer held 8 of the blocks"
        assert len(held(node, keys)) == 4
    finally:
        node.shutdown()


def test_the_plan_says_how_many_blocks_and_no_more_are_read(redis_url, sources):  # noqa: F811
    keys = synthetic_chain(CHAIN, 12)
    node = pulling_node("planned-five", 16, redis_url)
    try:
        result = node.execute(TransferPlan("long", tuple(keys[:5])))
        assert (result.num_local, result.num_pulled, result.source, result.error) == (
            0, 5, "long", "")
        assert len(held(node, keys)) == 5
        again = node.execute(TransferPlan("long", tuple(keys[:7])))  # the 5 are local now
        assert (again.num_local, again.num_pulled) == (5, 2)
    finally:
        node.shutdown()


def test_a_plan_naming_a_node_without_a_transfer_address_pulls_nothing(redis_url, sources):  # noqa: F811
    keys = synthetic_chain(CHAIN, 12)
    node = pulling_node("planned-nowhere", 16, redis_url)
    try:
        result = node.execute(TransferPlan("nowhere", tuple(keys)))
        assert (result.num_local, result.num_pulled, result.source) == (0, 0, "nowhere")
        assert "no transfer address" in result.error
        assert node.acquire(keys) == [] and node.stats().used_blocks == 0
    finally:
        node.shutdown()


def test_without_a_plan_the_node_chooses_the_longest_run(redis_url, sources):  # noqa: F811
    keys = synthetic_chain(CHAIN, 12)
    node = pulling_node("unplanned", 16, redis_url)
    try:
        result = node.pull(keys)
        assert (result.num_pulled, result.source) == (12, "long")
        assert len(held(node, keys)) == 12
    finally:
        node.shutdown()
