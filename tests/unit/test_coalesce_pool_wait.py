"""Coalescing on a co-located pool: requests that waited for one instance's prefill of their
shared prefix do not all queue on that instance. Once the owner is done, the first waiter goes
there (nothing queued yet); a later one waits, at most the queue it would join, for the prefix
to reach the node's store, and then loads it on the other instance. The real conductor and its
real ZMQ subscriber, a real store node in this process; the engines' side is played by calls."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from conductor.conductor import Conductor
from conductor.config import ConductorConfig
from conductor.cost_model import PrefillCostModel
from conductor.policy import PolicyConfig
from kvstore.config import KVStoreConfig
from kvstore.keys import KeyExtras, block_keys
from kvstore.node import KVStoreNode
from kvstore.redis_server import free_port
from protos.wire import PlacementRequest, Registration

pytestmark = pytest.mark.asyncio(loop_scope="session")

BS = 4
BLOCK_BYTES = 64 * 1024
SHARED_BLOCKS = 250
SHARED = list(range(1000, 1000 + SHARED_BLOCKS * BS))  # 1,000 ms at 1 ms a token
COST = PrefillCostModel(intercept_ms=0.0, per_token_ms=1.0, per_token_sq_ms=0.0, per_token_cached_ms=0.0)


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(tmp_path, request):
    elsewhere = getattr(request, "param", True)
    conductor = Conductor(ConductorConfig(stats_interval_s=3600,  # no engines to poll
                                          coalesce_elsewhere=elsewhere), "t",
                          PolicyConfig(block_size_tokens=BS, prefill_cost=COST))
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    node = KVStoreNode("node0", "t", KVStoreConfig(host_capacity_bytes=2 * SHARED_BLOCKS * BLOCK_BYTES,
                                                   arena_dir=str(tmp_path), events_endpoint=events,
                                                   events_replay_endpoint=replay),
                       BLOCK_BYTES, None, block_size_tokens=BS)
    await conductor.add_store_node("node0", events, replay)
    await asyncio.sleep(0.3)  # the subscription reaches the publisher
    yield conductor, node
    node.shutdown()
    for task in conductor._tasks:
        task.cancel()
    await asyncio.gather(*conductor._tasks, return_exceptions=True)
    conductor._ctx.destroy(linger=0)


async def join(conductor: Conductor, saves_prompts: bool) -> None:
    for instance_id in ("d0", "d1"):
        await conductor.register(Registration(instance_id, "decode", "node0", "m", "L",
                                              saves_prompts=saves_prompts))
        await conductor.mark_ready(instance_id)


def request(request_id: str, private: int) -> PlacementRequest:
    tokens = SHARED + list(range(private * 1000, private * 1000 + 50 * BS))  # its own: 200 ms
    return PlacementRequest(request_id, len(tokens), tuple(block_keys(tokens, BS, KeyExtras("m"))), 8)


def save(node: KVStoreNode, keys) -> None:
    """What the owner's engine does once its prompt is computed: the blocks into the store."""
    node.reserve(list(keys), [None, *keys[:-1]])
    node.commit(list(keys))


async def coalesce_two(conductor: Conductor) -> tuple[str, asyncio.Task, asyncio.Task]:
    # each waiter prices waiting (what is left of the owner's 1,200 ms, the waiters before it,
    # its own 200 ms) under recomputing the whole prompt on the idle instance (1,200 ms)
    owner = await conductor.place(request("owner", 1))
    await asyncio.sleep(0.25)
    first = asyncio.create_task(conductor.place(request("first", 2)))
    await asyncio.sleep(0.25)
    second = asyncio.create_task(conductor.place(request("second", 3)))
    await asyncio.sleep(0.02)
    assert not first.done() and not second.done()  # both wait for the owner's prefill
    await conductor.prefill_done("owner", 0)
    return owner.prefill_instance, first, second


async def test_a_later_waiter_waits_for_the_store_then_loads_the_prefix_on_the_other_instance(cluster):
    conductor, node = cluster
    await join(conductor, saves_prompts=True)
    owner, first, second = await coalesce_two(conductor)
    placed_first = await first
    assert placed_first.prefill_instance == owner
    assert placed_first.reason.startswith("coalesced after") and "pooled" not in placed_first.reason
    await asyncio.sleep(0.05)
    assert not second.done(), "the second waiter waits for the store, not behind the first"
    save(node, request("owner", 1).block_keys[:SHARED_BLOCKS])
    placed = await asyncio.wait_for(second, 5)
    assert placed.prefill_instance != owner
    assert "; pooled after " in placed.reason
    assert placed.expected_cached_blocks == SHARED_BLOCKS and placed.transfer_ms > 0.0
    counters = (await conductor.status()).counters
    assert (counters.pool_waits, counters.pooled) == (1, 1)


async def test_without_saves_every_waiter_queues_on_the_owners_instance(cluster):
    conductor, _ = cluster
    await join(conductor, saves_prompts=False)  # decode engines that only load
    owner, first, second = await coalesce_two(conductor)
    placed = [await asyncio.wait_for(task, 5) for task in (first, second)]
    assert [p.prefill_instance for p in placed] == [owner, owner]
    assert not [p for p in placed if "pooled" in p.reason]
    assert (await conductor.status()).counters.pool_waits == 0


@pytest.mark.parametrize("cluster", [False], indirect=True)
async def test_with_coalesce_elsewhere_off_every_waiter_queues_on_the_owners_instance(cluster):
    conductor, node = cluster
    await join(conductor, saves_prompts=True)
    owner, first, second = await coalesce_two(conductor)
    placed = [await asyncio.wait_for(task, 5) for task in (first, second)]
    assert [p.prefill_instance for p in placed] == [owner, owner]
    assert (await conductor.status()).counters.pool_waits == 0
