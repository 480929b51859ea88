"""KV produced on one store node, decoded on another: the decode worker pulls the prompt's blocks
over the transfer engine (``ucx``, then ``tcp``) into its own node's store, and its engine loads
them instead of recomputing. Real parts: one redis-server, three store nodes as separate Ray
actor processes (own arenas, own block servers), a vLLM prefill engine on node ``a``, one vLLM
decode engine on each of ``b-ucx`` and ``b-tcp``; greedy outputs compared with a plain engine."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import ray

from cluster.local import kv_block_bytes
from decode_worker.worker import DecodeWorker
from engine.builder import dtype_bytes, effective_dtype, engine_env
from engine.config import EngineConfig
from kvstore.attach import StoreWiring
from kvstore.config import KVStoreConfig, TransferConfig
from kvstore.disk_tier import HEADER_BYTES, find_block
from kvstore.host_arena import HostArena
from kvstore.metadata import BlockDirectory
from kvstore.node import KVStoreNode
from kvstore.redis_server import start_local_redis
from prefill_worker.worker import PrefillWorker
from protos.wire import EngineRequest, SamplingOptions
from tests.integration.engines import plain_generate, plain_runner, random_prompt

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

NAMESPACE = "cross-node"
HEARTBEAT_TTL_S = 1.0
SECRET = "cross-node-secret"
MAX_TOKENS = 16
ENV = {"BATON_TRANSFER_TOKEN": SECRET, "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}


class Cluster:
    """Store nodes and workers as Ray actors of one local Ray instance."""

    def __init__(self, model, redis_url: str) -> None:
        # blocks of 128 tokens: at the CPU default of 32 the tiny model's blocks are so small
        # that the host tiers below (a few dozen blocks) fall under the store's 1 MiB minimum
        self.engine = EngineConfig(model="tiny", block_size_tokens=128)
        self.block_size = self.engine.kv_block_tokens
        block_bytes = kv_block_bytes(model, self.block_size,
                                     dtype_bytes(effective_dtype(self.engine, model)))
        self.model, self.redis_url, self.block_bytes = model, redis_url, block_bytes
        self.stores: dict[str, object] = {}

    def store(self, node: str, backend: str, host_blocks: int = 64,
              disk_dir: Path | None = None) -> StoreWiring:
        config = KVStoreConfig(
            host_capacity_bytes=host_blocks * self.block_bytes, arena_dir="/dev/shm",
            disk_dir=str(disk_dir) if disk_dir else None, disk_capacity_bytes=256 << 20,
            heartbeat_interval_s=0.2, heartbeat_ttl_s=HEARTBEAT_TTL_S,
            # one machine: without this, peers would be read straight from their arenas (shm)
            transfer=TransferConfig(backend=backend, same_node_shared_memory=False),
        )
        name = f"{NAMESPACE}-kvstore-{node}"
        self.stores[node] = (
            ray.remote(KVStoreNode)
            .options(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=8,
                     runtime_env={"env_vars": ENV})
            .remote(node, NAMESPACE, config, self.block_bytes, self.redis_url, self.block_size)
        )
        ray.get(self.stores[node].arena_info.remote())
        return StoreWiring(name, NAMESPACE, node)

    def worker(self, cls, instance_id: str, store: StoreWiring):
        env = {**engine_env(self.engine, "nobind"), **ENV}
        actor = (
            ray.remote(cls)
            .options(name=instance_id, namespace=NAMESPACE, num_cpus=0, max_concurrency=1000,
                     runtime_env={"env_vars": env})
            .remote(instance_id, self.engine, self.model, store, None)
        )
        ray.get(actor.ready.remote())
        return actor


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    redis = start_local_redis()
    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        c = Cluster(tiny_model, redis.url)
        # node a: room for 8 blocks in host memory, the rest demoted to its disk tier
        c.disk_dir = tmp_path_factory.mktemp("disk-a")
        c.prefill = c.worker(PrefillWorker, "prefill-a",  # serves ucx and tcp
                             c.store("a", "ucx", host_blocks=8, disk_dir=c.disk_dir))
        c.decode = {backend: c.worker(DecodeWorker, f"decode-b-{backend}", c.store(f"b-{backend}", backend))
                    for backend in ("ucx", "tcp")}
        yield c
    finally:
        ray.shutdown()
        redis.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def reference(tiny_model):
    runner = plain_runner(tiny_model)
    yield runner
    runner.shutdown()


async def decode(actor, request: EngineRequest) -> tuple[list[int], object]:
    tokens, last = [], None
    async for ref in actor.generate.options(num_returns="streaming").remote(request):
        last = await ref
        tokens.extend(last.token_ids)
    return tokens, last


@pytest.mark.parametrize("backend", ["ucx", "tcp"])
async def test_decode_on_node_b_pulls_the_kv_prefilled_on_node_a(cluster, reference, backend):
    prompt = random_prompt(5 * cluster.block_size + 40, seed=hash(backend) % 1000)
    num_blocks = 6  # five full blocks and the partial tail
    request = EngineRequest(f"pull-{backend}", tuple(prompt),
                            SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0))
    expected = await plain_generate(reference, prompt, MAX_TOKENS, f"ref-{backend}")

    prefilled = await cluster.prefill.prefill.remote(request)
    assert (prefilled.node_id, prefilled.num_stored_blocks) == ("a", num_blocks)

    pulled = msgspec.structs.replace(request, kv_source_node=prefilled.node_id)
    tokens, last = await decode(cluster.decode[backend], pulled)

    assert tokens == expected
    assert last.num_pulled_blocks == num_blocks
    assert last.num_loaded_tokens == len(prompt) - 1  # vLLM computes the last prompt token itself
    counters = ray.get(cluster.stores[f"b-{backend}"].tier_counters.remote())
    assert counters.pulled_blocks >= num_blocks and counters.pull_failures == 0
    served = ray.get(cluster.stores["a"].transfer_address.remote())
    assert served is not None and served.node_id == "a"


async def test_without_the_source_node_the_decode_recomputes_with_the_same_output(cluster, reference):
    """The control: the same kind of request without ``kv_source_node`` loads nothing on node B
    (so the loads above came from the pull), and still answers correctly."""
    prompt = random_prompt(3 * cluster.block_size + 7, seed=77)
    request = EngineRequest("no-pull", tuple(prompt), SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0))
    expected = await plain_generate(reference, prompt, MAX_TOKENS, "ref-no-pull")
    await cluster.prefill.prefill.remote(request)

    tokens, last = await decode(cluster.decode["tcp"], request)

    assert tokens == expected
    assert (last.num_pulled_blocks, last.num_loaded_tokens) == (0, 0)


async def test_a_pull_from_a_node_without_the_blocks_recomputes_correctly(cluster, reference):
    """A stale hint (the source holds none of the prompt) costs nothing but the lookup."""
    prompt = random_prompt(2 * cluster.block_size + 3, seed=78)
    request = EngineRequest("stale-hint", tuple(prompt), SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0),
                            kv_source_node="a")
    expected = await plain_generate(reference, prompt, MAX_TOKENS, "ref-stale")

    tokens, last = await decode(cluster.decode["ucx"], request)

    assert tokens == expected
    assert (last.num_pulled_blocks, last.num_loaded_tokens) == (0, 0)



def greedy(name: str, prompt: list[int], **fields) -> EngineRequest:
    return EngineRequest(name, tuple(prompt), SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0),
                         **fields)


async def test_a_corrupt_block_on_the_source_nodes_disk_is_never_served_and_is_recomputed(
        cluster, reference):
    """Prompt P is pushed down to node a's disk tier by two later prompts; a byte of one of its
    blocks is flipped there. Node b's pull stops at that block (a's checksum catches it on the read
    that promotes it), so the decode loads the two blocks before it, recomputes the rest, and
    answers exactly like a plain engine; the corruption is counted and the block dropped."""
    block = cluster.block_size
    prompt = random_prompt(5 * block + 40, seed=91)
    request = greedy("corrupt-p", prompt)
    expected = await plain_generate(reference, prompt, MAX_TOKENS, "ref-corrupt")
    await cluster.prefill.prefill.remote(request)
    for seed in (92, 93):  # 12 more blocks through an 8-block host tier: P goes to disk
        await cluster.prefill.prefill.remote(greedy(f"push-{seed}", random_prompt(6 * block, seed)))
    keys = await cluster.prefill.prompt_keys.remote(request)
    [tier_dir] = cluster.disk_dir.iterdir()  # node a's own folder
    places = {key: find_block(tier_dir, key, cluster.block_bytes) for key in keys}
    assert None not in places.values(), "P is not wholly on a's disk"
    slot_file, offset = places[keys[2]]
    with open(slot_file, "r+b") as f:  # flip a byte mid-slot, in the payload
        f.seek(offset + (HEADER_BYTES + cluster.block_bytes) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))
    before = ray.get(cluster.stores["a"].tier_counters.remote()).disk_corrupt_blocks

    tokens, last = await decode(cluster.decode["tcp"], greedy("corrupt-d", prompt, kv_source_node="a"))

    assert tokens == expected
    assert (last.num_pulled_blocks, last.num_loaded_tokens) == (2, 2 * block)
    assert ray.get(cluster.stores["a"].tier_counters.remote()).disk_corrupt_blocks == before + 1
    assert find_block(tier_dir, keys[2], cluster.block_bytes) is None  # dropped: header zeroed


async def test_a_lost_store_node_leaves_the_metadata_within_the_heartbeat_ttl(cluster, reference):
    """Node x holds (junk bytes under) prompt R's keys and dies without deregistering. Within
    the heartbeat TTL the live nodes remove its entries from Redis; a request that wanted its
    blocks pulls nothing and is recomputed correctly (had x's junk been served, the output
    would differ)."""
    prompt = random_prompt(3 * cluster.block_size + 5, seed=95)
    request = greedy("lost-node", prompt, kv_source_node="x")
    expected = await plain_generate(reference, prompt, MAX_TOKENS, "ref-lost")
    keys = await cluster.decode["ucx"].prompt_keys.remote(request)
    cluster.store("x", "tcp")
    x = cluster.stores["x"]
    info = ray.get(x.arena_info.remote())
    slots = ray.get(x.reserve.remote(keys, [None, *keys[:-1]]))
    arena = HostArena(info.path, info.slot_bytes, info.num_slots, create=False)
    for slot in slots:
        arena.slot(slot).numpy()[:] = np.frombuffer(np.random.bytes(info.slot_bytes), np.uint8)
    arena.close()
    ray.get(x.commit.remote(keys))
    directory = BlockDirectory.from_url(cluster.redis_url)
    assert directory.locate(keys) == [{"x": "host"}] * len(keys)

    ray.kill(x, no_restart=True)  # no clean shutdown: its entries stay until reaped
    killed = time.monotonic()
    while directory.locate(keys[:1]) != [{}] and time.monotonic() - killed < 10:
        time.sleep(0.05)
    gone_after_s = time.monotonic() - killed
    assert directory.locate(keys) == [{}] * len(keys)
    assert "x" not in directory.nodes() and "x" not in directory.transfer_addresses()
    assert gone_after_s <= HEARTBEAT_TTL_S + 1.0  # TTL plus a reaper's heartbeat interval

    tokens, last = await decode(cluster.decode["ucx"], request)

    assert tokens == expected
    assert (last.num_pulled_blocks, last.num_loaded_tokens) == (0, 0)
