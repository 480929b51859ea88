"""The store node's tiers: host blocks evicted to disk (demotion) and brought back on a hit
(promotion), with bytes intact; a corrupt disk block is a miss, never served. The node class is
used in-process (no Ray, no Redis): this is about its tier mechanism."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from kvstore.config import KVStoreConfig
from kvstore.disk_tier import HEADER_BYTES, find_block
from kvstore.keys import KeyExtras, block_keys
from kvstore.node import KVStoreNode
from kvstore.transfer_wire import block_checksum
from protos.wire import TierCounters

BLOCK_BYTES = 256 * 1024
EXTRAS = KeyExtras(model_id="m")


def chain(seed: int, num_blocks: int):
    return block_keys([seed * 1000 + i for i in range(num_blocks * 4)], 4, EXTRAS)


def payload(key) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "little"))
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=g)


def write(node: KVStoreNode, keys) -> None:
    parents = [None] + list(keys[:-1])
    slots = node.reserve(keys, parents)
    for key, slot in zip(keys, slots):
        if slot is not None:
            node.arena.slot(slot).copy_(payload(key))
    node.commit([k for k, s in zip(keys, slots) if s is not None])


def read(node: KVStoreNode, keys) -> list[torch.Tensor]:
    slots = node.acquire(keys)
    data = [node.arena.slot(s).clone() for s in slots]
    node.release(keys[: len(slots)])
    return data


@pytest.fixture
def node(tmp_path):
    config = KVStoreConfig(host_capacity_bytes=4 * BLOCK_BYTES, arena_dir=str(tmp_path),
                           disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=64 * 1024 * 1024)
    n = KVStoreNode("node0", "t", config, BLOCK_BYTES, redis_url=None)
    yield n
    n.shutdown()


def test_evicted_host_blocks_are_demoted_and_promoted_back_intact(node):
    a, b = chain(1, 4), chain(2, 3)
    write(node, a)
    write(node, b)  # host holds 4 blocks: three of a's go to disk, leaves first
    assert node.store.match_prefix(a) == 1
    assert node.tier_counters().demoted_blocks == 3

    data = read(node, a)

    assert len(data) == 4
    assert all(torch.equal(d, payload(k)) for d, k in zip(data, a))
    counters = node.tier_counters()
    assert counters.promoted_blocks == 3 and counters.disk_hits == 3
    assert list(counters.as_dict()) == [  # the names and order `baton status` always showed
        "promoted_blocks", "demoted_blocks", "host_full_rejected_blocks", "soft_pinned_blocks",
        "pulled_blocks", "pulled_bytes", "pull_failures", "disk_blocks", "disk_hits",
        "disk_corrupt_blocks", "disk_evictions", "disk_write_errors", "disk_rejected_puts",
        "leased_blocks", "leased_bytes", "lease_evictions"]  # new names only ever at the end
    node.store.check_invariants()
    node.disk.check_invariants()


def test_the_blocks_one_reserve_evicts_reach_the_disk_as_one_write(node, monkeypatch):
    """The host tier evicts a's four blocks (leaves first) to make room for b's, handing their
    slots to b in the same call: they are demoted together, before that call returns, in
    adjacent disk slots written at once, with the bytes they had."""
    from kvstore import disk_tier

    a, b = chain(1, 4), chain(2, 4)
    write(node, a)
    batches, writes = [], []
    real_put_many, real_pwritev = node.disk.put_many, os.pwritev
    monkeypatch.setattr(node.disk, "put_many", lambda blocks, **kw: (
        batches.append([key for key, _, _ in blocks]), real_put_many(blocks, **kw))[1])
    monkeypatch.setattr(disk_tier.os, "pwritev", lambda fd, buffers, offset: (
        writes.append(offset), real_pwritev(fd, buffers, offset))[1])
    slots = node.reserve(b, [None, *b[:-1]])
    assert batches == [list(reversed(a))] and writes == [0]
    assert node.tier_counters().demoted_blocks == 4
    for key, slot in zip(b, slots):
        node.arena.slot(slot).copy_(payload(key))
    node.commit(b)
    monkeypatch.undo()
    data = read(node, a)  # promoted back (b's blocks go to disk in turn)
    assert len(data) == 4 and all(torch.equal(d, payload(k)) for d, k in zip(data, a))
    node.store.check_invariants()
    node.disk.check_invariants()


def test_a_demoted_block_whose_checksum_the_node_knows_is_not_hashed_again(node, monkeypatch):
    """A block the node served (or pulled) carries its XXH3 to the disk tier; one it never
    hashed is hashed once, by the tier. Reads from disk still verify every block."""
    from kvstore import disk_format

    a, b, c = chain(1, 4), chain(2, 3), chain(3, 3)
    write(node, a)
    served = node.pin_for_transfer(a)  # hashes a's four blocks, as the block server does
    node.release(a)
    hashed = []
    real = disk_format.xxhash.xxh3_64_intdigest
    monkeypatch.setattr(disk_format.xxhash, "xxh3_64_intdigest",
                        lambda data: (hashed.append(1), real(data))[1])
    write(node, b)  # evicts a[1:] (served): their checksums go along
    assert node.tier_counters().demoted_blocks == 3 and hashed == []
    write(node, c)  # evicts a[0] (served) and b[2], b[1] (never served): two hashes
    assert node.tier_counters().demoted_blocks == 6 and len(hashed) == 2
    assert [node.disk.contains(key) for key in (*a, *b)] == [True] * 4 + [False, True, True]
    monkeypatch.undo()
    assert node._checksums == {}  # an evicted block's entry goes with it
    data = read(node, a)
    assert [torch.equal(d, payload(k)) for d, k in zip(data, a)] == [True] * 4
    assert node.tier_counters().disk_corrupt_blocks == 0
    assert served.checksums == [block_checksum(payload(k).numpy()) for k in a]
    node.disk.check_invariants()


def test_checksums_sent_at_commit_are_served_and_demoted_without_hashing(node, monkeypatch):
    """The writer's XXH3s, sent with its commit, are the node's: its first serve and the
    demotion to disk take them as they are (no hash anywhere), and a wrong one reads as a
    corrupt disk block, never as good bytes."""
    from kvstore import disk_format, transfer_wire

    a, b = chain(1, 4), chain(2, 4)
    digests = [block_checksum(payload(key).numpy()) for key in a]
    digests[3] ^= 1  # a writer's bug: a[3]'s is wrong
    slots = node.reserve(a, [None, *a[:-1]])
    for key, slot in zip(a, slots):
        node.arena.slot(slot).copy_(payload(key))
    hashed = []
    for module in (disk_format.xxhash, transfer_wire.xxhash):
        real = module.xxh3_64_intdigest
        monkeypatch.setattr(module, "xxh3_64_intdigest",
                            lambda data, real=real: (hashed.append(1), real(data))[1])
    node.commit(a, digests)
    served = node.pin_for_transfer(a)
    node.release(a)
    assert served.checksums == digests and hashed == []
    write(node, b)  # evicts a's four blocks to disk with the writer's checksums
    assert node.tier_counters().demoted_blocks == 4 and hashed == []
    monkeypatch.undo()
    data = read(node, a)  # a[0:3] come back; a[3] fails its (wrong) XXH3: a counted miss
    assert len(data) == 3 and all(torch.equal(d, payload(k)) for d, k in zip(data, a))
    assert node.tier_counters().disk_corrupt_blocks == 1
    node.disk.check_invariants()


def test_the_tier_counters_and_the_store_gauges_show_the_leases(tmp_path):
    from gateway import metrics
    from protos.wire import PoolStatus, StoreRow

    config = KVStoreConfig(host_capacity_bytes=4 * BLOCK_BYTES, arena_dir=str(tmp_path),
                           lease_max_bytes_per_tenant=4 * BLOCK_BYTES)
    node = KVStoreNode("node0", "t", config, BLOCK_BYTES, redis_url=None)
    a = chain(1, 3)
    node.lease("s-1", "acme", a[:2], ttl_s=60)  # before the blocks land: leased on commit
    write(node, a)
    counters = node.tier_counters()
    assert (counters.leased_blocks, counters.leased_bytes, counters.lease_evictions) == (
        2, 2 * BLOCK_BYTES, 0)
    stats = node.stats()
    status = PoolStatus("baton", {}, [], [StoreRow("node0", stats.capacity_blocks,
                                                   stats.used_blocks, stats.pinned_blocks, 0,
                                                   stats.evicted_blocks, counters)],
                        None, [])
    metrics.set_pool_gauges(status)
    assert metrics.STORE_BLOCKS.labels("node0", "leased")._value.get() == 2
    assert metrics.STORE_LEASED_BYTES.labels("node0")._value.get() == 2 * BLOCK_BYTES
    assert metrics.STORE_EVENTS.labels("node0", "lease_evictions")._value.get() == 0
    assert node.release_lease("s-1") == 2
    assert node.tier_counters().leased_blocks == 0
    node.shutdown()


def test_a_corrupt_disk_block_ends_the_run_and_is_never_served(node):
    a, b = chain(1, 4), chain(2, 3)
    write(node, a)
    write(node, b)
    path, offset = node.disk.block_location(a[2])
    with open(path, "r+b") as f:  # flip the payload's last byte
        f.seek(offset + HEADER_BYTES + BLOCK_BYTES - 1)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last ^ 0xFF]))

    data = read(node, a)

    assert len(data) == 2  # a[0] in host, a[1] promoted, a[2] corrupt: the run stops there
    assert all(torch.equal(d, payload(k)) for d, k in zip(data, a))
    assert node.tier_counters().disk_corrupt_blocks == 1
    assert not node.disk.contains(a[2])
    assert find_block(node.disk.directory, a[2], BLOCK_BYTES) is None  # its header was zeroed
    node.disk.check_invariants()


def test_without_a_disk_tier_evicted_blocks_are_dropped(tmp_path):
    config = KVStoreConfig(host_capacity_bytes=4 * BLOCK_BYTES, arena_dir=str(tmp_path))
    node = KVStoreNode("node0", "t", config, BLOCK_BYTES, redis_url=None)
    try:
        a, b = chain(1, 4), chain(2, 3)
        write(node, a)
        write(node, b)
        assert len(read(node, a)) == 1
        counters = node.tier_counters()
        assert counters == TierCounters(promoted_blocks=0, demoted_blocks=0,
                                        host_full_rejected_blocks=0, soft_pinned_blocks=0,
                                        pulled_blocks=0, pulled_bytes=0, pull_failures=0,
                                        leased_blocks=0, leased_bytes=0, lease_evictions=0)
        # without a disk tier the disk counters are absent from the encoded form, as before
        assert msgspec.json.encode(counters) == (
            b'{"promoted_blocks":0,"demoted_blocks":0,"host_full_rejected_blocks":0,'
            b'"soft_pinned_blocks":0,"pulled_blocks":0,"pulled_bytes":0,"pull_failures":0,'
            b'"leased_blocks":0,"leased_bytes":0,"lease_evictions":0}')
    finally:
        node.shutdown()


def test_the_arena_file_is_removed_on_shutdown(tmp_path):
    node = KVStoreNode("node0", "t", KVStoreConfig(host_capacity_bytes=BLOCK_BYTES * 4,
                                                   arena_dir=str(tmp_path)), BLOCK_BYTES, None)
    path = node.arena.path
    assert path.exists() and path.name.endswith(f"-{os.getpid()}.arena")
    node.shutdown()
    assert not path.exists()


def test_a_soft_pinned_prefix_stays_in_host_memory_while_newer_blocks_are_demoted(node):
    """The operator pin covers blocks present when it is set (``system``) and blocks stored
    after it (``late``); unpinning lets them age out like any others."""
    system, late, traffic = chain(1, 2), chain(2, 1), [chain(seed, 1) for seed in range(3, 11)]
    write(node, system)
    assert node.set_soft_pins([*system, *late]) == 2
    write(node, late)
    assert node.tier_counters().soft_pinned_blocks == 3

    for keys in traffic:  # 8 newer blocks through the one unpinned slot of a 4-block host tier
        write(node, keys)

    assert node.store.match_prefix(system) == 2 and node.store.match_prefix(late) == 1
    assert node.store.match_prefix(traffic[0]) == 0  # the unpinned older traffic went to disk
    assert node.set_soft_pins([]) == 0
    assert node.tier_counters().soft_pinned_blocks == 0
    for keys in traffic[:4]:
        write(node, keys)
    assert node.store.match_prefix(system) == 0
    node.store.check_invariants()
