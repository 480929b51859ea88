"""DiskTier's page-aligned slots for large blocks and ``put_many``: the same answers and bytes as
a loop of ``put``, blocks in adjacent slots in one write (at most ``RUN_BLOCKS``), one sync per
durable batch, a failed write or sync leaving nothing indexed; a payload with an unknown digest
hashed just before its run's write, never hashed again when its digest is known."""

from __future__ import annotations

import errno
import os

import pytest

from kvstore import disk_format, disk_tier
from kvstore.disk_format import (
    HEADER_BYTES,
    PAGE_BYTES,
    payload_offset_for,
    slot_bytes_for,
)
from kvstore.disk_tier import DiskTier
from kvstore.keys import BlockKey
from kvstore.transfer_wire import block_checksum

LARGE_BLOCK_BYTES = 16 * PAGE_BYTES  # a KV-sized block: slots padded to whole pages


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def block(i: int, size: int = LARGE_BLOCK_BYTES) -> bytes:
    return bytes([i % 251]) * size


def test_large_blocks_get_page_aligned_slots_small_ones_stay_packed():
    assert slot_bytes_for(LARGE_BLOCK_BYTES) == 17 * PAGE_BYTES
    assert payload_offset_for(LARGE_BLOCK_BYTES) == PAGE_BYTES
    assert slot_bytes_for(368_640) == 91 * PAGE_BYTES  # one SmolLM2 block: a header page + 90
    assert slot_bytes_for(368_640 - 100) == 91 * PAGE_BYTES  # the last page padded
    assert slot_bytes_for(64) == HEADER_BYTES + 64 and payload_offset_for(64) == HEADER_BYTES
    assert slot_bytes_for(4096) == HEADER_BYTES + 4096  # alignment would nearly double it


@pytest.mark.parametrize("block_bytes", [LARGE_BLOCK_BYTES, 90 * PAGE_BYTES - 100])
def test_a_large_block_is_a_header_page_and_its_payload_pages(tmp_path, block_bytes):
    slot_bytes = slot_bytes_for(block_bytes)
    assert slot_bytes == PAGE_BYTES * (1 + -(-block_bytes // PAGE_BYTES))
    tier = DiskTier(tmp_path, 4 * slot_bytes, block_bytes)
    assert tier.num_slots == 4
    assert tier.put(k(1), None, block(1, block_bytes))
    assert tier.put(k(2), k(1), block(2, block_bytes))
    path, offset = tier.block_location(k(2))
    assert offset == slot_bytes
    raw = path.read_bytes()[offset:offset + tier.slot_bytes]
    assert raw[HEADER_BYTES:PAGE_BYTES] == bytes(PAGE_BYTES - HEADER_BYTES)
    assert raw[PAGE_BYTES:PAGE_BYTES + block_bytes] == block(2, block_bytes)
    assert raw[PAGE_BYTES + block_bytes:] == bytes(tier.slot_bytes - PAGE_BYTES - block_bytes)
    assert tier.get(k(2)) == block(2, block_bytes)
    tier.check_invariants()
    tier.close()
    restarted = DiskTier(tmp_path, 4 * slot_bytes, block_bytes)
    assert sorted(restarted.keys()) == sorted([k(1), k(2)])
    assert restarted.get(k(1)) == block(1, block_bytes)


def test_a_flipped_payload_byte_of_an_aligned_slot_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, 4 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    tier.put(k(1), None, block(1))
    path, offset = tier.block_location(k(1))
    with open(path, "r+b") as f:
        f.seek(offset + PAGE_BYTES + 5)
        f.write(b"\xff")
    assert tier.get(k(1)) is None and tier.stats().corrupt_blocks == 1
    tier.check_invariants()


def test_a_dropped_block_loses_its_header_page(tmp_path):
    tier = DiskTier(tmp_path, 4 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    tier.put(k(1), None, block(1))
    path, offset = tier.block_location(k(1))
    assert tier.remove(k(1))
    raw = path.read_bytes()[offset:offset + tier.slot_bytes]
    assert raw[:PAGE_BYTES] == bytes(PAGE_BYTES) and raw[PAGE_BYTES:PAGE_BYTES + 8] == block(1)[:8]
    tier.check_invariants()


@pytest.mark.parametrize("fsync", [False, True])
def test_put_many_answers_like_a_loop_of_put(tmp_path, fsync):
    batch = DiskTier(tmp_path / "batch", 3 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES, fsync=fsync)
    loop = DiskTier(tmp_path / "loop", 3 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES, fsync=fsync)
    for tier in (batch, loop):
        tier.put(k(0), None, block(0))
    # present already, new, a duplicate within the batch, new, new (evicts the LRU leaf)
    blocks = [(k(0), None, block(0)), (k(1), k(0), block(1)), (k(1), k(0), block(1)),
              (k(2), k(1), block(2)), (k(3), k(2), block(3))]
    assert batch.put_many(blocks) == [loop.put(*b) for b in blocks]
    assert sorted(batch.keys()) == sorted(loop.keys())
    for key in batch.keys():
        assert batch.get(key) == loop.get(key)
    batch.check_invariants()
    assert batch.stats().evictions == loop.stats().evictions


def test_a_durable_batch_syncs_once(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES, fsync=True)
    syncs = []
    real = os.fdatasync
    monkeypatch.setattr(disk_tier.os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    assert tier.put_many([(k(i), None, block(i)) for i in range(5)]) == [True] * 5
    assert len(syncs) == 1
    assert tier.put(k(9), None, block(9)) and len(syncs) == 2  # put alone still syncs itself


def test_a_failed_sync_drops_the_whole_batch(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES, fsync=True)
    tier.put(k(0), None, block(0))

    def failing(fd):
        raise OSError(errno.EIO, "sync failed")

    monkeypatch.setattr(disk_tier.os, "fdatasync", failing)
    assert tier.put_many([(k(0), None, block(0)), (k(1), k(0), block(1)),
                          (k(2), k(1), block(2))]) == [True, False, False]
    assert sorted(tier.keys()) == [k(0)] and tier.stats().write_errors == 2
    tier.check_invariants()


def test_a_failed_write_drops_the_blocks_of_its_run_only(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    assert tier.put_many([(k(10 + i), None, block(10 + i)) for i in range(3)]) == [True] * 3
    assert tier.remove(k(11))  # free slots: 1, then 3 on
    real = os.pwritev
    failures = []

    def flaky(fd, buffers, offset):  # the batch's first write fails, once
        if not failures:
            failures.append(offset)
            raise OSError(errno.ENOSPC, "no space")
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk_tier.os, "pwritev", flaky)
    tier.drain_removed_keys()
    # slots 1 | 3, 4: two runs; the first (block 0's) fails
    assert tier.put_many([(k(i), None, block(i)) for i in range(3)]) == [False, True, True]
    assert failures == [tier.slot_bytes] and tier.stats().write_errors == 1
    assert sorted(tier.keys()) == sorted([k(10), k(12), k(1), k(2)])
    assert tier.drain_removed_keys() == []  # never announced
    assert [tier.block_location(k(i))[1] for i in (1, 2)] == [3 * tier.slot_bytes,
                                                              4 * tier.slot_bytes]
    tier.check_invariants()
    assert tier.put_many([(k(i), None, block(i)) for i in range(3)]) == [True] * 3
    assert [tier.get(k(i)) for i in range(3)] == [block(i) for i in range(3)]
    assert tier.block_location(k(0))[1] == tier.slot_bytes  # the failed run's slot, free again
    tier.check_invariants()


def test_a_failed_run_write_drops_every_block_of_the_run(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, "device error")

    monkeypatch.setattr(disk_tier.os, "pwritev", failing)
    assert tier.put_many([(k(i), None, block(i)) for i in range(3)]) == [False] * 3
    stats = tier.stats()
    assert (stats.write_errors, stats.used_blocks, stats.pinned_blocks) == (3, 0, 0)
    assert tier.drain_removed_keys() == []
    monkeypatch.undo()
    tier.check_invariants()


def test_adjacent_slots_go_in_one_write_of_at_most_run_blocks(tmp_path, monkeypatch):
    num_blocks = disk_tier.RUN_BLOCKS + 2
    tier = DiskTier(tmp_path, (num_blocks + 4) * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    keys = [k(i) for i in range(num_blocks)]
    digests = [block_checksum(block(i)) for i in range(num_blocks)]
    events = _record_writes_and_hashes(monkeypatch)
    assert tier.put_many(list(zip(keys, [None, *keys[:-1]], map(block, range(num_blocks)))),
                         payload_xxh3s=digests) == [True] * num_blocks
    slot = tier.slot_bytes
    assert events == [("write", 0, disk_tier.RUN_BLOCKS * slot),
                      ("write", disk_tier.RUN_BLOCKS * slot, 2 * slot)]
    monkeypatch.undo()
    assert [tier.get(key) for key in keys] == [block(i) for i in range(num_blocks)]
    tier.check_invariants()


def test_a_batch_never_evicts_its_own_blocks(tmp_path):
    """Two slots: a loop of put would write block 0, then evict it for block 2; the batch
    refuses block 2 instead (nothing of its own is evictable until written)."""
    tier = DiskTier(tmp_path, 2 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    assert tier.put_many([(k(i), None, block(i)) for i in range(3)]) == [True, True, False]
    assert sorted(tier.keys()) == [k(0), k(1)]
    stats = tier.stats()
    assert (stats.evictions, stats.rejected_puts, stats.pinned_blocks) == (0, 1, 0)
    tier.check_invariants()
    assert tier.put(k(2), None, block(2)) and tier.stats().evictions == 1  # a later call may


def test_a_batch_marks_each_block_leased_as_told(tmp_path):
    tier = DiskTier(tmp_path, 4 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    assert tier.put_many([(k(i), None, block(i)) for i in range(3)],
                         leased_flags=[True, False, True]) == [True] * 3
    assert tier.stats().leased_blocks == 2
    # plain blocks: the free slot, then the plain block 1's; never a leased block's
    assert tier.put_many([(k(i), None, block(i)) for i in (3, 4, 5)]) == [True, True, False]
    assert sorted(tier.keys()) == sorted([k(0), k(2), k(3), k(4)])
    stats = tier.stats()
    assert (stats.evictions, stats.leased_evictions, stats.leased_blocks) == (1, 0, 2)
    tier.check_invariants()


def _record_writes_and_hashes(monkeypatch):
    """Every ``pwritev`` (offset, bytes) and every payload hash, in order."""
    events = []
    real_pwritev, real_hash = os.pwritev, disk_format.xxhash.xxh3_64_intdigest
    monkeypatch.setattr(disk_tier.os, "pwritev", lambda fd, buffers, offset: (
        events.append(("write", offset, sum(len(b) for b in buffers))),
        real_pwritev(fd, buffers, offset))[1])
    monkeypatch.setattr(disk_format.xxhash, "xxh3_64_intdigest", lambda data: (
        events.append(("hash", len(memoryview(data).cast("B")))), real_hash(data))[1])
    return events


def test_an_unknown_digest_is_hashed_just_before_its_runs_one_write(tmp_path, monkeypatch):
    """Each payload hashed (the write then copies it from the CPU's cache), then header and
    payload of both blocks in one write: no second, header-only write."""
    tier = DiskTier(tmp_path, 8 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    events = _record_writes_and_hashes(monkeypatch)
    assert tier.put_many([(k(i), None, block(i)) for i in range(2)]) == [True, True]
    assert events == [("hash", LARGE_BLOCK_BYTES), ("hash", LARGE_BLOCK_BYTES),
                      ("write", 0, 2 * tier.slot_bytes)]
    monkeypatch.undo()
    assert [tier.get(k(i)) for i in range(2)] == [block(0), block(1)]
    tier.check_invariants()


@pytest.mark.parametrize("batched", [False, True])
def test_a_known_digest_is_written_without_hashing_again(tmp_path, monkeypatch, batched):
    tier = DiskTier(tmp_path, 8 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    digests = [block_checksum(block(i)) for i in range(2)]
    events = _record_writes_and_hashes(monkeypatch)
    if batched:
        assert tier.put_many([(k(i), None, block(i)) for i in range(2)],
                             payload_xxh3s=digests) == [True, True]
    else:
        assert all(tier.put(k(i), None, block(i), payload_xxh3=digests[i]) for i in range(2))
    slot = tier.slot_bytes
    assert events == ([("write", 0, 2 * slot)] if batched else  # adjacent: one write
                      [("write", 0, slot), ("write", slot, slot)])
    num_writes = len(events)
    assert tier.get(k(1)) == block(1)
    assert events[num_writes:] == [("hash", LARGE_BLOCK_BYTES)]  # reads still verify
    monkeypatch.undo()
    restarted = DiskTier(tmp_path, 8 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    tier.close()
    assert restarted.get(k(0)) == block(0) and restarted.stats().corrupt_blocks == 0


def test_a_wrong_digest_reads_as_a_corrupt_block_never_as_bytes(tmp_path):
    tier = DiskTier(tmp_path, 8 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    assert tier.put(k(1), None, block(1), payload_xxh3=block_checksum(block(2)))
    assert tier.get(k(1)) is None
    stats = tier.stats()
    assert (stats.corrupt_blocks, stats.misses, stats.used_blocks) == (1, 1, 0)
    tier.check_invariants()


def test_a_short_write_resumes_mid_buffer(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 4 * 17 * PAGE_BYTES, LARGE_BLOCK_BYTES)
    real = os.pwritev

    def short(fd, buffers, offset):  # at most 1,000 bytes a call: every boundary is crossed
        out, left = [], 1000
        for b in buffers:
            if left <= 0:
                break
            out.append(memoryview(b)[:left])
            left -= len(out[-1])
        return real(fd, out, offset)

    monkeypatch.setattr(disk_tier.os, "pwritev", short)
    assert tier.put_many([(k(1), None, block(1))]) == [True]
    assert tier.put(k(2), None, block(2))
    monkeypatch.setattr(disk_tier.os, "pwritev", real)
    assert tier.get(k(1)) == block(1) and tier.get(k(2)) == block(2)
    tier.check_invariants()
