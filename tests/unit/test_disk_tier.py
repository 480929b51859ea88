"""DiskTier: checksummed blocks in one slot file, corruption as a miss, leaf-LRU, restart."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import disk_tier
from kvstore.disk_tier import HEADER_BYTES, SLOT_FILE_NAME, DiskTier, find_block
from kvstore.keys import BlockKey, key_hex
from kvstore.transfer_wire import block_checksum

BLOCK_BYTES = 64
FILE_BYTES = HEADER_BYTES + BLOCK_BYTES  # one slot: header and payload


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def payload(name: str) -> bytes:
    return (name.encode() * BLOCK_BYTES)[:BLOCK_BYTES]


def make_tier(directory: Path, num_blocks: int, extra_bytes: int = 0) -> DiskTier:
    return DiskTier(directory, num_blocks * FILE_BYTES + extra_bytes, BLOCK_BYTES)


def put(tier: DiskTier, name: str, parent: str | None = None) -> bool:
    ok = tier.put(k(name), k(parent) if parent else None, payload(name))
    tier.check_invariants()
    return ok


def slot_of(tier: DiskTier, name: str) -> int:
    path, offset = tier.block_location(k(name))
    assert path == tier.directory / SLOT_FILE_NAME and offset % FILE_BYTES == 0
    return offset // FILE_BYTES


def slot_bytes(tier: DiskTier, slot: int) -> bytes:
    with open(tier.directory / SLOT_FILE_NAME, "rb") as f:
        f.seek(slot * FILE_BYTES)
        return f.read(FILE_BYTES)


def write_slot(tier: DiskTier, slot: int, data: bytes, at: int = 0) -> None:
    """Write ``data`` at byte ``at`` of ``slot``, behind the tier's back."""
    with open(tier.directory / SLOT_FILE_NAME, "r+b") as f:
        f.seek(slot * FILE_BYTES + at)
        f.write(data)


def flip_byte(offset: int):
    def corrupt(tier: DiskTier, slot: int) -> None:
        write_slot(tier, slot, bytes([slot_bytes(tier, slot)[offset] ^ 0xFF]), at=offset)

    return corrupt


def zero_from(offset: int):
    """What a torn write leaves in a fresh slot: the bytes after ``offset`` never arrived."""
    def corrupt(tier: DiskTier, slot: int) -> None:
        write_slot(tier, slot, bytes(FILE_BYTES - offset), at=offset)

    return corrupt


def copy_of_slot(source: int):
    """A sound slot of another block (a stale or misplaced write)."""
    def corrupt(tier: DiskTier, slot: int) -> None:
        write_slot(tier, slot, slot_bytes(tier, source))

    return corrupt


# -- round trip and API ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wrap",
    [bytes, bytearray, memoryview, lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)],
    ids=["bytes", "bytearray", "memoryview", "tensor"],
)
def test_round_trip(tmp_path: Path, wrap) -> None:
    tier = make_tier(tmp_path, 4)
    assert tier.put(k("A"), None, wrap(payload("A")))
    assert tier.put(k("B"), k("A"), wrap(payload("B")))
    tier.check_invariants()
    assert tier.get(k("A")) == payload("A")
    assert tier.get(k("B")) == payload("B")
    assert tier.get(k("Z")) is None
    assert tier.contains(k("A")) and k("B") in tier and len(tier) == 2
    slot_file = tmp_path / SLOT_FILE_NAME
    assert [p.name for p in tmp_path.iterdir()] == [SLOT_FILE_NAME]
    assert slot_file.stat().st_size == 4 * FILE_BYTES  # every slot, written or not
    assert tier.block_location(k("A")) == (slot_file, 0)
    assert tier.block_location(k("B")) == (slot_file, FILE_BYTES)
    assert find_block(tmp_path, k("B"), BLOCK_BYTES) == (slot_file, FILE_BYTES)
    assert find_block(tmp_path, k("Z"), BLOCK_BYTES) is None
    with pytest.raises(KeyError):
        tier.block_location(k("Z"))
    assert slot_bytes(tier, 1)[HEADER_BYTES:] == payload("B")
    stats = tier.stats()
    counts = (stats.hits, stats.misses, stats.used_blocks, stats.used_bytes)
    assert counts == (2, 1, 2, 2 * FILE_BYTES)
    tier.close()
    tier.close()  # idempotent


def test_tensor_view_of_a_larger_tensor(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 2)
    slots = torch.arange(3 * BLOCK_BYTES, dtype=torch.int64).to(torch.uint8).view(3, BLOCK_BYTES)
    assert tier.put(k("A"), None, slots[1])
    assert tier.get(k("A")) == bytes(slots[1].numpy())


def test_put_validates_payload_and_capacity(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 2)
    with pytest.raises(ValueError, match="holds 64 bytes"):
        tier.put(k("A"), None, b"short")
    with pytest.raises(TypeError, match="uint8 tensor"):
        tier.put(k("A"), None, torch.zeros(BLOCK_BYTES, dtype=torch.float32))
    with pytest.raises(ValueError, match="raise the disk tier capacity"):
        DiskTier(tmp_path / "small", FILE_BYTES - 1, BLOCK_BYTES)


def test_put_of_present_key_keeps_it_and_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    tier = make_tier(tmp_path, 2)
    assert put(tier, "A")

    def no_write(*args):
        raise AssertionError("a present block was written again")

    monkeypatch.setattr(disk_tier.os, "pwritev", no_write)
    assert tier.put(k("A"), None, b"\0" * BLOCK_BYTES)
    monkeypatch.undo()
    assert tier.get(k("A")) == payload("A")


def test_match_prefix_remove_and_stats(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 4)
    for name, parent in [("A", None), ("B", "A"), ("C", "B")]:
        put(tier, name, parent)
    assert tier.match_prefix([k("A"), k("B"), k("C"), k("D")]) == 3
    assert tier.match_prefix([k("X"), k("A")]) == 0
    assert tier.match_prefix([]) == 0
    assert tier.remove(k("B"))
    assert not tier.remove(k("B"))
    tier.check_invariants()
    assert tier.match_prefix([k("A"), k("B"), k("C")]) == 1
    assert tier.drain_removed_keys() == [k("B")]
    assert tier.stats() == disk_tier.DiskTierStats(
        capacity_bytes=4 * FILE_BYTES, used_bytes=2 * FILE_BYTES, used_blocks=2,
        pinned_blocks=0, evictable_blocks=2,  # A and C: a gap (B) breaks the chain
        hits=0, misses=0, corrupt_blocks=0, evictions=0, write_errors=0, rejected_puts=0,
    )  # fmt: skip


def test_a_dropped_blocks_slot_is_reused_and_a_restart_does_not_bring_it_back(
    tmp_path: Path,
) -> None:
    tier = make_tier(tmp_path, 3)
    for name in "ABC":
        put(tier, name)
    assert [slot_of(tier, n) for n in "ABC"] == [0, 1, 2]
    assert tier.remove(k("B"))
    assert slot_bytes(tier, 1)[:HEADER_BYTES] == bytes(HEADER_BYTES)  # header zeroed on drop
    assert put(tier, "D")
    assert slot_of(tier, "D") == 1  # the freed slot
    assert put(tier, "E")  # full: A, the LRU leaf, goes and E takes its slot
    assert tier.drain_removed_keys() == [k("B"), k("A")]
    assert slot_of(tier, "E") == 0
    tier.close()

    restarted = make_tier(tmp_path, 3)
    assert {n for n in "ABCDE" if restarted.contains(k(n))} == set("CDE")
    assert [restarted.get(k(n)) for n in "CDE"] == [payload(n) for n in "CDE"]
    assert find_block(tmp_path, k("A"), BLOCK_BYTES) is None
    assert find_block(tmp_path, k("B"), BLOCK_BYTES) is None
    restarted.check_invariants()


# -- atomicity and write failures ------------------------------------------------------------------


def test_failed_write_leaves_no_block(tmp_path: Path, monkeypatch) -> None:
    tier = make_tier(tmp_path, 2)
    put(tier, "A")
    real_pwritev = os.pwritev

    def header_then_eio(fd, buffers, offset):
        real_pwritev(fd, [buffers[0]], offset)  # a whole, sound header, then the device fails
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(disk_tier.os, "pwritev", header_then_eio)
    assert not tier.put(k("B"), None, payload("B"))
    monkeypatch.undo()
    assert not tier.contains(k("B"))
    assert tier.stats().write_errors == 1 and tier.stats().used_blocks == 1
    assert slot_bytes(tier, 1)[:HEADER_BYTES] == bytes(HEADER_BYTES)  # the header was zeroed
    tier.check_invariants()
    tier.close()
    assert not make_tier(tmp_path, 2).contains(k("B"))


class SimulatedCrash(BaseException):
    """Not an OSError: the process 'dies' mid-put."""


def die_after(monkeypatch, torn_bytes: int | None) -> list[int]:
    """From the next ``pwritev`` on the process is dead: that write reaches the file only up to
    ``torn_bytes`` (None: not at all), and nothing after it does (the tier's clean-up writes
    fail too, as they would in a dead process). The offsets of the writes tried."""
    real_pwritev = os.pwritev
    tried: list[int] = []

    def torn_then_dead(fd, buffers, offset):
        tried.append(offset)
        if len(tried) == 1 and torn_bytes is not None:
            real_pwritev(fd, [b"".join(bytes(b) for b in buffers)[:torn_bytes]], offset)
        raise SimulatedCrash

    def dead(*args):
        raise SimulatedCrash

    monkeypatch.setattr(disk_tier.os, "pwritev", torn_then_dead)
    monkeypatch.setattr(disk_tier.os, "pwrite", dead)
    return tried


@pytest.mark.parametrize("digest_known", [False, True])
def test_a_crash_mid_write_is_a_counted_miss_after_a_restart(tmp_path: Path, monkeypatch,
                                                              digest_known) -> None:
    """Header and payload go in one write: a torn write leaves a sound header over a payload
    that fails its XXH3, whether the digest was known or hashed by the tier."""
    tier = make_tier(tmp_path, 2)
    put(tier, "A")
    tried = die_after(monkeypatch, HEADER_BYTES + BLOCK_BYTES // 2)
    digest = block_checksum(payload("B")) if digest_known else None
    with pytest.raises(SimulatedCrash):
        tier.put(k("B"), None, payload("B"), payload_xxh3=digest)
    monkeypatch.undo()
    assert tried == [FILE_BYTES]  # slot 1, once
    assert find_block(tmp_path, k("B"), BLOCK_BYTES) is not None  # the torn slot's sound header

    restarted = make_tier(tmp_path, 2)  # the header is sound: the payload check decides, on read
    assert restarted.get(k("B")) is None
    assert restarted.stats().corrupt_blocks == 1 and not restarted.contains(k("B"))
    assert restarted.get(k("A")) == payload("A")
    restarted.check_invariants()
    assert put(restarted, "B")  # the slot is free again
    assert restarted.get(k("B")) == payload("B")


def test_a_crash_before_the_write_leaves_a_free_slot(tmp_path: Path, monkeypatch) -> None:
    tier = make_tier(tmp_path, 2)
    put(tier, "A")
    die_after(monkeypatch, None)
    with pytest.raises(SimulatedCrash):
        tier.put(k("B"), None, payload("B"))
    monkeypatch.undo()
    assert slot_bytes(tier, 1) == bytes(FILE_BYTES)  # never written: a hole of the sparse file
    restarted = make_tier(tmp_path, 2)
    assert restarted.keys() == [k("A")] and restarted.stats().corrupt_blocks == 0


def test_a_crash_mid_run_keeps_the_whole_blocks_and_misses_the_torn_one(tmp_path: Path,
                                                                        monkeypatch) -> None:
    """Three blocks in adjacent slots go in one write, torn in the middle of the second: after
    a restart the first is a hit, the second a counted miss, the third's slot is free."""
    tier = make_tier(tmp_path, 4)
    tried = die_after(monkeypatch, FILE_BYTES + HEADER_BYTES + BLOCK_BYTES // 2)
    with pytest.raises(SimulatedCrash):
        tier.put_many([(k(name), None, payload(name)) for name in "ABC"])
    monkeypatch.undo()
    assert tried == [0]
    restarted = make_tier(tmp_path, 4)
    assert sorted(restarted.keys()) == sorted([k("A"), k("B")])
    assert restarted.get(k("A")) == payload("A")
    assert restarted.get(k("B")) is None and restarted.stats().corrupt_blocks == 1
    restarted.check_invariants()


def test_an_exception_mid_batch_in_a_live_process_leaves_nothing_behind(tmp_path: Path,
                                                                       monkeypatch) -> None:
    """Not a write error (an answer) but a bug or an interrupt: the call's unwritten blocks are
    dropped again (headers zeroed, slots free, nothing pinned) before it propagates."""
    tier = make_tier(tmp_path, 4)
    put(tier, "A")
    real_pwritev = os.pwritev

    def torn_then_raise(fd, buffers, offset):
        real_pwritev(fd, [b"".join(bytes(b) for b in buffers)[:HEADER_BYTES + 8]], offset)
        raise KeyboardInterrupt

    monkeypatch.setattr(disk_tier.os, "pwritev", torn_then_raise)
    with pytest.raises(KeyboardInterrupt):
        tier.put_many([(k("B"), k("A"), payload("B")), (k("C"), k("B"), payload("C"))])
    monkeypatch.undo()
    assert tier.keys() == [k("A")] and tier.stats().pinned_blocks == 0
    assert tier.drain_removed_keys() == []  # never announced as stored: nothing to take back
    tier.check_invariants()  # no sound header left in a free slot
    assert put(tier, "B", "A") and tier.get(k("B")) == payload("B")


def test_full_disk_rejects_put_without_leaving_a_block(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    tier = make_tier(tmp_path, 4)
    put(tier, "A")
    real_pwritev = os.pwritev
    calls = []

    def write_then_enospc(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 1:  # a short write, then the disk is full
            return real_pwritev(fd, [bytes(buffers[0])[:10]], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier.os, "pwritev", write_then_enospc)
    with caplog.at_level(logging.WARNING, logger="kvstore.disk_tier"):
        assert not tier.put(k("B"), k("A"), payload("B"))
    monkeypatch.undo()
    assert calls == [FILE_BYTES, FILE_BYTES + 10]  # slot 1; the retry resumed after the short write
    assert "disk full" in caplog.text and key_hex(k("B")) in caplog.text
    assert tier.stats().write_errors == 1
    assert not tier.contains(k("B"))
    assert find_block(tmp_path, k("B"), BLOCK_BYTES) is None
    tier.check_invariants()
    assert tier.stats().evictable_blocks == 1  # A is a leaf again: B never arrived
    assert put(tier, "B", "A")  # space came back
    assert slot_of(tier, "B") == 1  # the slot the failed write had taken


def test_short_writes_resume_until_the_block_is_whole(tmp_path: Path, monkeypatch) -> None:
    tier = make_tier(tmp_path, 4)
    real_pwritev = os.pwritev
    offsets = []

    def at_most_7_bytes(fd, buffers, offset):
        offsets.append(offset)
        return real_pwritev(fd, [bytes(b"".join(bytes(b) for b in buffers)[:7])], offset)

    monkeypatch.setattr(disk_tier.os, "pwritev", at_most_7_bytes)
    assert put(tier, "A")
    assert put(tier, "B")
    monkeypatch.undo()
    # each slot, header included, in one write that resumes where each short write stopped
    assert offsets == list(range(0, FILE_BYTES, 7)) + list(range(FILE_BYTES, 2 * FILE_BYTES, 7))
    assert tier.get(k("A")) == payload("A") and tier.get(k("B")) == payload("B")


# -- corruption ------------------------------------------------------------------------------------


CORRUPTIONS = {
    "payload-first-byte": flip_byte(HEADER_BYTES),
    "payload-last-byte": flip_byte(FILE_BYTES - 1),
    "header-magic": flip_byte(0),
    "header-version": flip_byte(8),
    "header-flags": flip_byte(10),
    "header-key": flip_byte(12),
    "header-parent": flip_byte(28),
    "header-length": flip_byte(44),
    "header-payload-checksum": flip_byte(HEADER_BYTES - 8),
    "header-checksum": flip_byte(HEADER_BYTES - 1),
    "torn-payload": zero_from(HEADER_BYTES + BLOCK_BYTES // 2),
    "torn-header": zero_from(HEADER_BYTES // 2),
    "zeroed": zero_from(0),
    "another-blocks-slot": copy_of_slot(0),  # a sound header, but not B's
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corruption_is_a_counted_miss_and_the_slot_is_freed(tmp_path: Path, corrupt) -> None:
    tier = make_tier(tmp_path, 4)
    put(tier, "A")
    put(tier, "B", "A")
    tier.drain_removed_keys()
    corrupt(tier, slot_of(tier, "B"))
    assert tier.get(k("B")) is None
    stats = tier.stats()
    assert (stats.corrupt_blocks, stats.misses, stats.hits) == (1, 1, 0)
    assert slot_bytes(tier, 1)[:HEADER_BYTES] == bytes(HEADER_BYTES)
    assert not tier.contains(k("B"))
    assert tier.drain_removed_keys() == [k("B")]
    tier.check_invariants()
    assert tier.get(k("A")) == payload("A")  # the neighbour is untouched
    assert tier.get(k("B")) is None and tier.stats().corrupt_blocks == 1  # a plain miss now


def test_a_slot_file_truncated_under_the_tier_reads_as_a_counted_miss(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 4)
    put(tier, "A")
    put(tier, "B", "A")
    os.truncate(tmp_path / SLOT_FILE_NAME, 2 * FILE_BYTES - 1)  # B's last byte is gone
    assert tier.get(k("B")) is None and tier.stats().corrupt_blocks == 1
    assert tier.get(k("A")) == payload("A")
    tier.close()
    restarted = make_tier(tmp_path, 4)  # extends the file back to four slots
    assert {n for n in "AB" if restarted.contains(k(n))} == {"A"}
    restarted.check_invariants()


def test_corrupt_pinned_block_is_dropped_and_the_pin_is_still_owed(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 2)
    put(tier, "A")
    assert tier.pin(k("A"))
    flip_byte(HEADER_BYTES)(tier, slot_of(tier, "A"))
    assert tier.get(k("A")) is None
    tier.check_invariants()
    tier.unpin(k("A"))
    tier.check_invariants()
    with pytest.raises(AssertionError, match="unpin of an unpinned block"):
        tier.unpin(k("A"))


# -- eviction and pins -----------------------------------------------------------------------------


def test_a_pin_owed_on_a_dropped_block_still_pins_the_block_put_again(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 2)
    put(tier, "A")
    assert tier.pin(k("A"))
    flip_byte(HEADER_BYTES)(tier, slot_of(tier, "A"))
    assert tier.get(k("A")) is None  # dropped as corrupt; the reader's pin is still owed
    assert tier.put(k("A"), None, payload("A"))
    assert tier.stats().pinned_blocks == 1
    tier.unpin(k("A"))  # the reader's
    assert tier.stats().pinned_blocks == 0 and tier.stats().evictable_blocks == 1
    tier.check_invariants()


def test_leaf_lru_eviction_order_is_exact(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 4, extra_bytes=FILE_BYTES - 1)  # room for 4 blocks, not 5
    for name, parent in [("A", None), ("B", "A"), ("C", "B"), ("D", None)]:
        assert put(tier, name, parent)
    evicted = []
    for name in "EFGH":
        assert put(tier, name)
        evicted += tier.drain_removed_keys()
    # C is the LRU leaf; then B and A become leaves in turn, and are older than D.
    assert evicted == [k("C"), k("B"), k("A"), k("D")]
    assert tier.stats().evictions == 4


def test_get_refreshes_recency(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 3)
    for name in "ABC":
        put(tier, name)
    assert tier.get(k("A")) == payload("A")
    put(tier, "D")
    put(tier, "E")
    assert tier.drain_removed_keys() == [k("B"), k("C")]


def test_parent_arriving_after_its_child_is_not_a_leaf(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 2)
    assert put(tier, "C", "B")  # demoted child first: its parent is not on disk yet
    assert put(tier, "B")
    assert put(tier, "X")  # C (leaf, older) goes; B, though older than X, has a child
    assert tier.drain_removed_keys() == [k("C")]
    assert put(tier, "Y")
    assert tier.drain_removed_keys() == [k("B")]


def test_put_never_evicts_its_own_parent(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 1)
    put(tier, "A")
    assert not put(tier, "B", "A")
    assert tier.contains(k("A")) and tier.stats().rejected_puts == 1
    assert tier.drain_removed_keys() == []


def test_pinned_blocks_are_never_evicted(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 2)
    put(tier, "A")
    put(tier, "B")
    assert tier.pin(k("A")) and tier.pin(k("A"))
    assert put(tier, "C")
    assert put(tier, "D")
    assert tier.drain_removed_keys() == [k("B"), k("C")]
    assert tier.pin(k("D"))
    assert not put(tier, "E")  # everything pinned: rejected, nothing dropped
    assert tier.stats().rejected_puts == 1 and tier.stats().pinned_blocks == 2
    assert not tier.remove(k("A"))  # a read is in progress
    tier.unpin(k("A"))
    assert not put(tier, "E")  # still one pin on A
    tier.unpin(k("A"))
    assert put(tier, "E")
    assert tier.drain_removed_keys() == [k("A")]
    assert not tier.pin(k("Z"))


# -- restart ---------------------------------------------------------------------------------------


def test_restart_keeps_valid_blocks_and_discards_junk(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 8)
    for name, parent in [("A", None), ("B", "A"), ("C", "B"), ("D", None), ("I", "D")]:
        put(tier, name, parent)
    flip_byte(HEADER_BYTES + 3)(tier, slot_of(tier, "D"))  # payload rot: found on read
    flip_byte(28)(tier, slot_of(tier, "I"))  # a wrong parent link would mislead eviction
    write_slot(tier, 5, os.urandom(FILE_BYTES))  # garbage in a free slot
    write_slot(tier, 6, slot_bytes(tier, 0))  # A twice (a crash undid a drop's header zeroing)
    write_slot(tier, 7, slot_bytes(tier, 1)[: HEADER_BYTES // 2])  # a torn header
    legacy = tmp_path / key_hex(k("E"))[:2]  # a format-2 block file: unreadable now
    legacy.mkdir()
    (legacy / key_hex(k("E"))).write_bytes(b"x" * FILE_BYTES)
    outside = tmp_path / "README"  # not ours: left alone
    outside.write_text("operator notes")
    tier.close()

    restarted = make_tier(tmp_path, 8)
    assert {n for n in "ABCDEI" if restarted.contains(k(n))} == set("ABCD")
    assert slot_of(restarted, "A") == 0  # the first copy; the second slot is free again
    assert slot_bytes(restarted, 6)[:HEADER_BYTES] == bytes(HEADER_BYTES)
    assert not legacy.exists() and outside.read_text() == "operator notes"
    restarted.check_invariants()
    assert [restarted.get(k(n)) for n in "ABC"] == [payload(n) for n in "ABC"]
    assert restarted.get(k("D")) is None and restarted.stats().corrupt_blocks == 1
    assert restarted.match_prefix([k("A"), k("B"), k("C")]) == 3
    assert restarted.stats().used_blocks == 3


def test_restart_reads_every_slot_where_the_file_system_cannot_report_holes(
    tmp_path: Path, monkeypatch
) -> None:
    tier = make_tier(tmp_path, 4)
    for name in "AB":
        put(tier, name)
    assert tier.remove(k("A"))
    tier.close()
    real_lseek = os.lseek

    def no_seek_data(fd, offset, whence):
        if whence in (os.SEEK_DATA, os.SEEK_HOLE):
            raise OSError(errno.EINVAL, "not supported")
        return real_lseek(fd, offset, whence)

    monkeypatch.setattr(disk_tier.os, "lseek", no_seek_data)
    restarted = make_tier(tmp_path, 4)
    assert {n for n in "AB" if restarted.contains(k(n))} == {"B"} and slot_of(restarted, "B") == 1
    restarted.check_invariants()


def test_restart_restores_recency_in_slot_order(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 3)
    for name in "XYZ":
        put(tier, name)
    assert tier.get(k("X")) == payload("X")  # X is the most recent now, but only in memory
    tier.close()
    restarted = make_tier(tmp_path, 3)
    assert put(restarted, "W")
    assert restarted.drain_removed_keys() == [k("X")]  # slot 0: the oldest after a restart


def test_restart_with_a_smaller_capacity_drops_the_slots_beyond_it(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 4)
    for name, parent in [("A", None), ("B", "A"), ("C", None), ("D", None)]:
        put(tier, name, parent)
    tier.close()
    restarted = make_tier(tmp_path, 2)  # capacity halved: slots 2 and 3 go
    assert restarted.drain_removed_keys() == [k("C"), k("D")]
    assert restarted.stats().evictions == 2
    assert {n for n in "ABCD" if restarted.contains(k(n))} == {"A", "B"}
    assert (tmp_path / SLOT_FILE_NAME).stat().st_size == 2 * FILE_BYTES
    restarted.check_invariants()
    assert put(restarted, "E")  # B is the only leaf
    assert restarted.drain_removed_keys() == [k("B")]
    restarted.close()

    grown = make_tier(tmp_path, 6)  # a larger capacity extends the file; the blocks stay
    assert {n for n in "ABCDE" if grown.contains(k(n))} == {"A", "E"}
    assert (tmp_path / SLOT_FILE_NAME).stat().st_size == 6 * FILE_BYTES
    grown.check_invariants()
    for name in "FGHI":
        assert put(grown, name)
    assert grown.drain_removed_keys() == []


# -- property test ---------------------------------------------------------------------------------

NAMES = [f"n{i}" for i in range(8)]
PARENTS = {name: (NAMES[(i - 1) // 2] if i else None) for i, name in enumerate(NAMES)}  # a tree
names = st.sampled_from(NAMES)


class DiskTierMachine(RuleBasedStateMachine):
    """Random put/get/pin/unpin/remove/corrupt/restart against a model of what must be there."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="disk-tier-"))
        self.capacity_bytes = 4 * FILE_BYTES + 10
        self.tier = DiskTier(self.directory, self.capacity_bytes, BLOCK_BYTES)
        self.present: set[str] = set()
        self.corrupted: set[str] = set()
        self.pins: dict[str, int] = {}
        self.counts = {"hits": 0, "misses": 0, "corrupt_blocks": 0, "evictions": 0}

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    @rule(name=names)
    def put(self, name: str) -> None:
        pinned_before = {n for n in self.present if self.pins.get(n)}
        ok = self.tier.put(k(name), k(PARENTS[name]) if PARENTS[name] else None, payload(name))
        removed = self.tier.drain_removed_keys()
        evicted = {n for n in NAMES if k(n) in removed}
        assert len(evicted) == len(removed)
        assert ok == self.tier.contains(k(name))
        assert ok or name not in self.present
        assert not evicted & pinned_before, "a pinned block was evicted"
        assert PARENTS[name] not in evicted, "the new block's parent was evicted"
        self.counts["evictions"] += len(evicted)
        self.present -= evicted
        self.corrupted -= evicted
        if ok:
            self.present.add(name)
        for child in self.present:
            assert PARENTS[child] not in evicted, f"{PARENTS[child]} evicted before child {child}"

    @rule(name=names)
    def get(self, name: str) -> None:
        got = self.tier.get(k(name))
        if name in self.present and name in self.corrupted:
            assert got is None
            self.counts["corrupt_blocks"] += 1
            self.counts["misses"] += 1
            self.present.discard(name)
            self.corrupted.discard(name)
            assert self.tier.drain_removed_keys() == [k(name)]
        elif name in self.present:
            assert got == payload(name)
            self.counts["hits"] += 1
        else:
            assert got is None
            self.counts["misses"] += 1

    @rule(name=names)
    def pin(self, name: str) -> None:
        assert self.tier.pin(k(name)) == (name in self.present)
        if name in self.present:
            self.pins[name] = self.pins.get(name, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        name = data.draw(st.sampled_from(sorted(self.pins)))
        self.tier.unpin(k(name))
        self.pins[name] -= 1
        if not self.pins[name]:
            del self.pins[name]

    @rule(name=names)
    def remove(self, name: str) -> None:
        removable = name in self.present and not self.pins.get(name)
        assert self.tier.remove(k(name)) == removable
        if removable:
            assert self.tier.drain_removed_keys() == [k(name)]
            self.present.discard(name)
            self.corrupted.discard(name)

    @precondition(lambda self: self.present - self.corrupted)
    @rule(data=st.data(), offset=st.integers(0, FILE_BYTES - 1))
    def corrupt(self, data, offset: int) -> None:
        # never the same block twice: a second flip of one byte would undo the first
        name = data.draw(st.sampled_from(sorted(self.present - self.corrupted)))
        flip_byte(offset)(self.tier, slot_of(self.tier, name))
        self.corrupted.add(name)

    @rule()
    def restart(self) -> None:
        """A new process: pins are gone; blocks with sound headers survive."""
        self.tier.close()
        self.tier = DiskTier(self.directory, self.capacity_bytes, BLOCK_BYTES)
        self.pins.clear()
        survivors = {n for n in NAMES if self.tier.contains(k(n))}
        assert self.present - self.corrupted <= survivors <= self.present
        self.present = survivors
        self.corrupted &= survivors
        self.counts = dict.fromkeys(self.counts, 0)

    @invariant()
    def consistent(self) -> None:
        self.tier.check_invariants()
        stats = self.tier.stats()
        assert stats.used_bytes <= self.capacity_bytes
        assert {n for n in NAMES if self.tier.contains(k(n))} == self.present
        assert stats.used_bytes == len(self.present) * FILE_BYTES
        observed = {name: getattr(stats, name) for name in self.counts}
        assert observed == self.counts
        assert stats.pinned_blocks == len(self.pins.keys() & self.present)


TestDiskTierMachine = DiskTierMachine.TestCase
TestDiskTierMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
