"""DiskTier: atomic checksummed block files, corruption as a miss, leaf-LRU eviction, restart."""

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
from kvstore.disk_tier import HEADER_BYTES, DiskTier
from kvstore.keys import BlockKey, key_hex

BLOCK_BYTES = 64
FILE_BYTES = HEADER_BYTES + BLOCK_BYTES


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


def block_path(tier: DiskTier, name: str) -> Path:
    hex_name = key_hex(k(name))
    return tier.directory / hex_name[:2] / hex_name


def all_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


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
    assert all_files(tmp_path) == sorted(
        str(block_path(tier, n).relative_to(tmp_path)) for n in "AB"
    )
    assert block_path(tier, "A").stat().st_size == FILE_BYTES
    stats = tier.stats()
    counts = (stats.hits, stats.misses, stats.used_blocks, stats.used_bytes)
    assert counts == (2, 1, 2, 2 * FILE_BYTES)


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


def test_put_of_present_key_keeps_it_and_writes_nothing(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 2)
    assert put(tier, "A")
    mtime = block_path(tier, "A").stat().st_mtime_ns
    assert tier.put(k("A"), None, b"\0" * BLOCK_BYTES)
    assert tier.get(k("A")) == payload("A")
    assert block_path(tier, "A").stat().st_mtime_ns == mtime


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


# -- atomicity and write failures ------------------------------------------------------------------


def test_failed_replace_leaves_no_block(tmp_path: Path, monkeypatch) -> None:
    tier = make_tier(tmp_path, 2)
    put(tier, "A")

    def failing_replace(src, dst):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(disk_tier.os, "replace", failing_replace)
    assert not tier.put(k("B"), None, payload("B"))
    monkeypatch.undo()
    assert not tier.contains(k("B"))
    assert tier.stats().write_errors == 1 and tier.stats().used_blocks == 1
    assert all_files(tmp_path) == [str(block_path(tier, "A").relative_to(tmp_path))]
    tier.check_invariants()


class SimulatedCrash(BaseException):
    """Not an OSError: the process 'dies' mid-put, so no cleanup code runs."""


def test_crash_between_temp_write_and_replace_leaves_no_visible_block(
    tmp_path: Path, monkeypatch
) -> None:
    tier = make_tier(tmp_path, 2)
    put(tier, "A")

    def crash(src, dst):
        raise SimulatedCrash

    monkeypatch.setattr(disk_tier.os, "replace", crash)
    with pytest.raises(SimulatedCrash):
        tier.put(k("B"), None, payload("B"))
    monkeypatch.undo()
    assert not tier.contains(k("B"))
    assert not block_path(tier, "B").exists()
    leftovers = [p for p in tmp_path.rglob("*.tmp")]
    assert len(leftovers) == 1  # the temporary the crash left behind

    restarted = make_tier(tmp_path, 2)
    assert not restarted.contains(k("B"))
    assert restarted.get(k("A")) == payload("A")
    assert not list(tmp_path.rglob("*.tmp"))
    restarted.check_invariants()


def test_full_disk_rejects_put_without_partial_file(tmp_path: Path, monkeypatch, caplog) -> None:
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
    assert calls == [0, 10]  # the second write resumed where the short one stopped
    assert "disk full" in caplog.text and key_hex(k("B")) in caplog.text
    assert tier.stats().write_errors == 1
    assert not tier.contains(k("B"))
    assert all_files(tmp_path) == [str(block_path(tier, "A").relative_to(tmp_path))]
    tier.check_invariants()
    assert tier.stats().evictable_blocks == 1  # A is a leaf again: B never arrived
    assert put(tier, "B", "A")  # space came back


def test_short_writes_resume_until_the_block_is_whole(tmp_path: Path, monkeypatch) -> None:
    tier = make_tier(tmp_path, 4)
    real_pwritev = os.pwritev
    offsets = []

    def at_most_7_bytes(fd, buffers, offset):
        offsets.append(offset)
        return real_pwritev(fd, [bytes(b"".join(bytes(b) for b in buffers)[:7])], offset)

    monkeypatch.setattr(disk_tier.os, "pwritev", at_most_7_bytes)
    assert put(tier, "A")
    monkeypatch.undo()
    assert offsets == list(range(0, FILE_BYTES, 7))
    assert tier.get(k("A")) == payload("A")


# -- corruption ------------------------------------------------------------------------------------


def flip_byte(offset: int):
    def corrupt(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))

    return corrupt


def truncate_to(size: int):
    def corrupt(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:size])

    return corrupt


def append_byte(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


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
    "truncated-payload": truncate_to(FILE_BYTES - 1),
    "truncated-header": truncate_to(HEADER_BYTES - 1),
    "empty": truncate_to(0),
    "trailing-byte": append_byte,
    "deleted": lambda path: path.unlink(),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corruption_is_a_counted_miss_and_the_file_goes(tmp_path: Path, corrupt) -> None:
    tier = make_tier(tmp_path, 4)
    put(tier, "A")
    put(tier, "B", "A")
    tier.drain_removed_keys()
    corrupt(block_path(tier, "B"))
    assert tier.get(k("B")) is None
    stats = tier.stats()
    assert (stats.corrupt_blocks, stats.misses, stats.hits) == (1, 1, 0)
    assert not block_path(tier, "B").exists()
    assert not tier.contains(k("B"))
    assert tier.drain_removed_keys() == [k("B")]
    tier.check_invariants()
    assert tier.get(k("A")) == payload("A")  # the neighbour is untouched
    assert tier.get(k("B")) is None and tier.stats().corrupt_blocks == 1  # a plain miss now


def test_corrupt_pinned_block_is_dropped_and_the_pin_is_still_owed(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 2)
    put(tier, "A")
    assert tier.pin(k("A"))
    flip_byte(HEADER_BYTES)(block_path(tier, "A"))
    assert tier.get(k("A")) is None
    tier.check_invariants()
    tier.unpin(k("A"))
    tier.check_invariants()
    with pytest.raises(AssertionError, match="unpin of an unpinned block"):
        tier.unpin(k("A"))


# -- eviction and pins -----------------------------------------------------------------------------


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
    flip_byte(HEADER_BYTES + 3)(block_path(tier, "D"))  # payload rot: found on read, not start-up
    junk = {
        "temp": block_path(tier, "E").with_name(block_path(tier, "E").name + ".tmp"),
        "garbage": block_path(tier, "F"),
        "wrong-key": block_path(tier, "G"),
        "truncated": block_path(tier, "H"),
        "parent-rot": block_path(tier, "I"),
        "bad-name": block_path(tier, "A").with_name("not-a-key"),
    }
    for path in junk.values():
        path.parent.mkdir(exist_ok=True)
    junk["temp"].write_bytes(block_path(tier, "A").read_bytes())
    junk["garbage"].write_bytes(os.urandom(FILE_BYTES))
    junk["wrong-key"].write_bytes(block_path(tier, "A").read_bytes())
    junk["truncated"].write_bytes(block_path(tier, "A").read_bytes()[:HEADER_BYTES])
    junk["bad-name"].write_bytes(b"x")
    flip_byte(28)(junk["parent-rot"])  # a wrong parent link would mislead eviction: dropped
    outside = tmp_path / "README"  # not in a fan-out folder: not ours, left alone
    outside.write_text("operator notes")

    restarted = make_tier(tmp_path, 8)
    assert {n for n in "ABCDEFGHI" if restarted.contains(k(n))} == set("ABCD")
    assert not any(p.exists() for p in junk.values())
    assert outside.exists()
    outside.unlink()
    restarted.check_invariants()
    assert [restarted.get(k(n)) for n in "ABC"] == [payload(n) for n in "ABC"]
    assert restarted.get(k("D")) is None and restarted.stats().corrupt_blocks == 1
    assert restarted.match_prefix([k("A"), k("B"), k("C")]) == 3


def test_restart_restores_lru_from_mtime_and_fits_a_smaller_capacity(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 4)
    for name, parent in [("A", None), ("B", "A"), ("C", None), ("D", None)]:
        put(tier, name, parent)
    base_ns = 1_700_000_000 * 10**9
    for age_rank, name in enumerate("DBAC"):  # D oldest, then B, A, C
        os.utime(block_path(tier, name), ns=(base_ns + age_rank, base_ns + age_rank))
    restarted = make_tier(tmp_path, 2)  # capacity halved: two LRU leaves must go
    assert restarted.drain_removed_keys() == [k("D"), k("B")]
    assert {n for n in "ABCD" if restarted.contains(k(n))} == {"A", "C"}
    restarted.check_invariants()
    assert put(restarted, "E")
    assert restarted.drain_removed_keys() == [k("A")]


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
        flip_byte(offset)(block_path(self.tier, name))
        self.corrupted.add(name)

    @rule()
    def restart(self) -> None:
        """A new process: pins are gone; blocks with sound headers survive."""
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
