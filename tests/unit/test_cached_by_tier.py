"""Where a request's reused prompt tokens came from: the store says which blocks of a lookup's
run it brought back from disk (``KVStoreNode.acquire_many``), the connector's scheduler half
counts the loaded tokens in them (``RequestTransfer.num_disk_tokens``), and the worker splits
vLLM's ``num_cached_tokens`` into device, host, disk and pulled
(``RequestTransfer.cached_by_tier``), the four adding up to it exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip(
    "vllm", reason="needs vllm, which is not installed (kvstore.connector is a vLLM KV connector)"
)

from kvstore.client import PendingRuns, StoreSlots  # noqa: E402
from kvstore.config import KVStoreConfig  # noqa: E402
from kvstore.connector import (  # noqa: E402
    BatonConnector,
    BatonWorkerMetadata,
    ConnectorStats,
    RequestTransfer,
    _RequestState,
    request_transfer,
)
from kvstore.keys import KeyExtras, block_keys  # noqa: E402
from kvstore.node import AcquiredRun, KVStoreNode  # noqa: E402
from protos.wire import CachedByTier  # noqa: E402

BS = 16
ARENA = "/dev/shm/test-arena"
BLOCK_BYTES = 256 * 1024


# ---------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("transfer, cached, pulled, expected", [
    (RequestTransfer(0), 0, 0, CachedByTier()),
    (RequestTransfer(0), 96, 0, CachedByTier(device=96)),  # all in the engine's own cache
    (RequestTransfer(64, 0, 48), 96, 0, CachedByTier(device=32, host=16, disk=48)),
    (RequestTransfer(64, 0, 16), 96, 32, CachedByTier(device=32, host=16, disk=16, pulled=32)),
    (RequestTransfer(64), 64, 64, CachedByTier(pulled=64)),
    # capped: loaded past cached (a load vLLM counted short), pulled past what was loaded
    (RequestTransfer(80, 0, 16), 64, 0, CachedByTier(host=48, disk=16)),
    (RequestTransfer(32, 0, 16), 48, 160, CachedByTier(device=16, disk=16, pulled=16)),
    (RequestTransfer(32, 0, 50), 40, 0, CachedByTier(device=8, disk=32)),
])
def test_cached_tokens_split_into_tiers_that_add_up(transfer, cached, pulled, expected):
    tiers = transfer.cached_by_tier(cached, pulled)
    assert tiers == expected
    assert tiers.total == cached


# ---------------------------------------------------------------- the store's answer


def chain(seed: int, num_blocks: int):
    return block_keys([seed * 1000 + i for i in range(num_blocks * 4)], 4, KeyExtras("m"))


def write(node: KVStoreNode, keys) -> None:
    slots = node.reserve(keys, [None] + list(keys[:-1]))
    node.commit([k for k, s in zip(keys, slots) if s is not None])


@pytest.fixture
def node(tmp_path):
    config = KVStoreConfig(host_capacity_bytes=4 * BLOCK_BYTES, arena_dir=str(tmp_path),
                           disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=64 * 1024 * 1024)
    n = KVStoreNode("node0", "t", config, BLOCK_BYTES, redis_url=None)
    yield n
    n.shutdown()


def test_acquire_many_says_which_blocks_of_each_run_it_brought_back_from_disk(node):
    a, b = chain(1, 4), chain(2, 3)
    write(node, a)
    write(node, b)  # 4 host slots: a's last three blocks go to disk
    assert node.store.match_prefix(a) == 1

    first, again = node.acquire_many([a, a[:2]])

    assert len(first.slots) == 4 and first.promoted == (1, 2, 3)
    assert len(again.slots) == 2 and again.promoted == (1,)  # promoted by this call, for both
    node.release(a)
    node.release(a[:2])
    [in_host] = node.acquire_many([a])  # in host memory now: nothing comes up from disk
    assert len(in_host.slots) == 4 and in_host.promoted == ()
    node.release(a)
    assert node.acquire(a) == in_host.slots  # ``acquire`` answers the slots alone, as before
    node.release(a)


def test_without_a_disk_tier_nothing_is_promoted(tmp_path):
    config = KVStoreConfig(host_capacity_bytes=4 * BLOCK_BYTES, arena_dir=str(tmp_path))
    node = KVStoreNode("node1", "t", config, BLOCK_BYTES, redis_url=None)
    try:
        write(node, chain(3, 2))
        assert node.acquire_many([chain(3, 3), chain(4, 1)]) == [
            AcquiredRun([0, 1], ()), AcquiredRun([], ())]
    finally:
        node.shutdown()


# ---------------------------------------------------------------- the connector


class _Store:
    """Answers every lookup with ``run``; records the unpins."""

    def __init__(self, run: StoreSlots) -> None:
        self.run, self.released = run, []
        self.arena = None

    def acquire(self, keys) -> StoreSlots:
        return self.run

    def acquire_many_later(self, key_lists) -> PendingRuns:
        return PendingRuns(None, None, ARENA, list(key_lists), [self.run] * len(key_lists))

    def release(self, keys, arena_path) -> None:
        self.released.append(list(keys))


def scheduler_half(store: _Store, async_transfers: bool) -> BatonConnector:
    connector = object.__new__(BatonConnector)
    connector._block_size, connector._loads, connector._saves = BS, True, False
    connector._async, connector._store, connector.stats = async_transfers, store, ConnectorStats()
    connector._requests, connector._releases, connector._loads_ready = {}, {}, []
    connector._lookups_unsent, connector._final_saves, connector._stepping = [], [], False
    return connector


def finish(connector: BatonConnector, request) -> RequestTransfer:
    _free_later, params = connector.request_finished(request, [])
    return request_transfer(SimpleNamespace(kv_transfer_params=params))


def run_request(connector, num_prompt_tokens: int, num_device_tokens: int, news=None):
    """One request through the scheduler half: looked up with ``num_device_tokens`` in vLLM's
    own cache, its external tokens allocated, then (after ``news``) finished."""
    keys = chain(7, -(-num_prompt_tokens // BS))
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(num_prompt_tokens)),
                              kv_transfer_params=None, num_output_tokens=1)
    connector._requests["r"] = _RequestState(keys=keys, num_prompt_tokens=num_prompt_tokens)
    connector.on_new_request(request)
    num_external, _later = connector.get_num_new_matched_tokens(request, num_device_tokens)
    blocks = SimpleNamespace(get_block_ids=lambda: [list(range(100, 100 + len(keys)))])
    connector.update_state_after_alloc(request, blocks, num_external)
    if news is not None:
        connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=news))
    return num_external, finish(connector, request)


@pytest.mark.parametrize("async_transfers", [False, True])
@pytest.mark.parametrize("num_prompt_tokens, promoted, num_device_tokens, loaded, disk", [
    (100, (3, 4, 5), 2 * BS, 4 * BS, 3 * BS),  # blocks 2..5 loaded, 3..5 from disk
    (100, (0, 1, 2), 2 * BS, 4 * BS, BS),  # disk blocks 0 and 1 were in vLLM's own cache
    (96, (5,), 0, 95, 15),  # the last block: vLLM computes its last token itself
    (100, (), 0, 6 * BS, 0),
])
def test_the_loaded_tokens_that_came_up_from_disk_are_reported(
        async_transfers, num_prompt_tokens, promoted, num_device_tokens, loaded, disk):
    store = _Store(StoreSlots(ARENA, [10, 11, 12, 13, 14, 15], promoted))
    connector = scheduler_half(store, async_transfers)

    num_external, done = run_request(connector, num_prompt_tokens, num_device_tokens)

    assert num_external == loaded
    assert (done.num_loaded_tokens, done.num_disk_tokens) == (loaded, disk)


def test_a_failed_load_reports_neither_loaded_nor_disk_tokens():
    store = _Store(StoreSlots(ARENA, [10, 11, 12, 13, 14, 15], (3, 4, 5)))
    connector = scheduler_half(store, async_transfers=True)

    _, done = run_request(connector, 100, 0, news=BatonWorkerMetadata(failed_loads={"r"}))

    assert done == RequestTransfer(0, 0, 0)


def test_the_client_reads_acquire_many_answers_and_plain_slot_lists():
    from kvstore.client import _runs_of_each

    assert _runs_of_each(ARENA, [AcquiredRun([4, 5, 6], (1, 2)), [7]]) == [
        StoreSlots(ARENA, [4, 5, 6], (1, 2)), StoreSlots(ARENA, [7], ())]
