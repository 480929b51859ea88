"""The SSD tier's mechanism: checksummed blocks in one preallocated slot file, leaf-LRU eviction.

Blocks live in ``<directory>/blocks.slots``: ``num_slots = capacity_bytes // slot_bytes`` slots of
``slot_bytes`` bytes (page-aligned for large blocks: the header's page, then the payload's
pages), slot ``i`` at byte ``i * slot_bytes``; each is a checksummed header followed by the payload,
laid out as ``kvstore.disk_format`` describes. The
file is created or resized sparse with ``ftruncate`` and held open for the tier's lifetime:
creating, renaming and unlinking one file per block (format version 2) cost ~300 us per 368 KB
block on ext4 here, about as much as writing it.

Atomicity. A put writes free slots whole (so the kernel never reads a page back to merge a
partial write), header and payload in one ``pwritev``, and ``put_many`` the blocks of adjacent
slots in one (``_write_run`` says why; a payload whose XXH3 the caller does not know is hashed
just before). A block is indexed when its slot is taken but pinned, and the call returns only
after its write did (single-threaded: no reader runs in between); a failed write zeroes the
headers of its run and frees their slots.
Dropping a block (eviction, removal, a failed check) zeroes its slot's header before freeing the
slot, so a restart does not bring it back. After a crash, a torn slot holds either a zero header
or one that fails its own checksum (the slot is free) or a sound header whose payload fails its
XXH3 on read: a counted miss, never served. Without
``fsync`` a crash may also undo a header zeroing and bring a dropped block back; its bytes are
still its key's (keys name content), and a block dropped as corrupt fails its check again.
A block that fails any check on read is dropped, counted in ``corrupt_blocks`` and reported as a
miss: the caller recomputes; a wrong block is never served.

Start-up (``rebuild_index``) reads every slot's header (holes of the sparse file are skipped) and
keeps the sound ones. The file records no access times, so recency restarts in slot order.
Format-2 block folders (``<hh>/<key hex>``) left by an older version are removed.

Invariants (``check_invariants`` asserts all of them):

- ``used_bytes`` (headers included) is ``slot_bytes`` per indexed block and never exceeds
  ``capacity_bytes``; the file spans exactly ``num_slots`` slots;
- every indexed block has its own slot, the free list holds every other slot once; a slot with a
  sound header is an indexed block at its recorded slot (free slots hold none). An indexed block's
  header can only lack soundness if it was damaged behind the tier's back: found on its next read;
- a block may be present without its parent (the host tier demotes leaves first, so a parent often
  reaches the disk after its child), but ``children`` counts, per key, the present blocks naming it
  as parent, whether or not that key is present itself;
- a block is evictable iff it is present, unpinned and has no present children ("LRU over
  leaves"): a shared ancestor goes only after all of its descendants. Plain blocks go first, then
  leased ones (``set_leased``, kept by the owner in line with its leases), least recently used
  first within each; and a put makes room only from blocks of its own class or a lower one, so
  a plain block demoted from host never displaces a leased one (it is dropped instead).
  Leases live in memory only: after a restart every block is plain.

Single-threaded: the owning actor serialises calls.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvstore.block_store import LEASED, PLAIN, eviction_class
from kvstore.disk_buffers import as_byte_view
from kvstore.disk_format import (
    HEADER_BYTES,
    PAGE_BYTES,
    SLOT_FILE_NAME,
    ZERO_HEADER,
    find_block,
    holds_block,
    is_page_aligned,
    pack_header,
    payload_offset_for,
    slot_bytes_for,
    sound_headers,
)
from kvstore.keys import KEY_SIZE_BYTES, BlockKey, key_hex

__all__ = ["HEADER_BYTES", "SLOT_FILE_NAME", "DiskTier", "DiskTierStats", "find_block"]

logger = logging.getLogger(__name__)

RUN_BLOCKS = 8
"""Most blocks one ``pwritev`` writes (``_write_run``): enough to make the per-call cost small,
few enough that payloads hashed just before it are still in the CPU's cache when it copies them.
Measured in one process, 128 SmolLM2 blocks (368,640 B) into dropped page cache, 11 interleaved
rounds, medians (2026-12-05): one ``pwritev`` of the bare batch 6.22 ms; digests known, runs of
8 6.52 ms (the whole batch in one write 6.50, one write per block 7.72); digests unknown, hashed
then written 4 / 8 / 16 at a time 7.97 / 7.59 / 8.09 ms, against 9.24 for the former per-block
slot, hash, then header write."""
_IOV_MAX = os.sysconf("SC_IOV_MAX")


class DiskTierStats(msgspec.Struct, frozen=True):
    """Occupancy gauges and monotonic counters since construction (or the last restart)."""

    capacity_bytes: int
    used_bytes: int
    used_blocks: int
    pinned_blocks: int
    evictable_blocks: int
    hits: int
    misses: int
    corrupt_blocks: int
    evictions: int
    write_errors: int
    rejected_puts: int
    leased_blocks: int = 0
    """Blocks marked leased now (a level)."""
    leased_evictions: int = 0
    """Leased blocks evicted (to make room for other leased blocks: nothing plain was left)."""


@dataclass(slots=True, frozen=True)
class _Admitted:
    """A block of a ``put_many`` call with its slot taken, waiting for its write."""

    index: int  # in the call's blocks
    key: BlockKey
    parent: BlockKey | None
    payload: memoryview
    slot: int
    payload_xxh3: int | None


def _runs_of_adjacent_slots(blocks: Sequence[_Admitted],
                            max_blocks: int) -> list[list[_Admitted]]:
    """``blocks`` in slot order, cut where a slot does not follow the one before it, and
    every ``max_blocks``."""
    runs: list[list[_Admitted]] = []
    for block in sorted(blocks, key=lambda b: b.slot):
        last = runs[-1] if runs else None
        if last is not None and last[-1].slot + 1 == block.slot and len(last) < max_blocks:
            last.append(block)
        else:
            runs.append([block])
    return runs


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    parent: BlockKey | None
    slot: int
    last_access_tick: int
    leased: bool = False


class DiskTier:
    """Blocks of exactly ``block_bytes`` payload bytes in one slot file in ``directory``, at most
    ``capacity_bytes`` of slots (headers included). Construction reads the slot headers
    (``rebuild_index``), so a restart keeps every block whose header is intact. ``close`` releases
    the file.

    ``fsync=True`` syncs each put's data before it returns (durable across power loss; slower).
    Without it a crash of the machine may lose recent blocks, never expose partial ones except as
    checksum failures, which read as misses.
    """

    def __init__(
        self, directory: Path, capacity_bytes: int, block_bytes: int, *, fsync: bool = False
    ) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.slot_bytes = slot_bytes_for(block_bytes)
        self.payload_offset = payload_offset_for(block_bytes)
        self._aligned = is_page_aligned(block_bytes)
        self._padding = bytes(self.slot_bytes - self.payload_offset - block_bytes)
        self._header_gap = bytearray(self.payload_offset - HEADER_BYTES)  # zeros, or scratch
        # a dropped block's header goes as one whole page where slots are aligned
        self._cleared_prefix = bytes(PAGE_BYTES) if self._aligned else ZERO_HEADER
        if capacity_bytes < self.slot_bytes:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} cannot hold one block of {block_bytes} bytes "
                f"plus its {HEADER_BYTES}-byte header; raise the disk tier capacity"
            )
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // self.slot_bytes
        self.fsync = fsync
        self.directory.mkdir(parents=True, exist_ok=True)
        _remove_per_file_blocks(self.directory)
        self.path = self.directory / SLOT_FILE_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._entries: dict[BlockKey, _Entry] = {}
        self._free_slots: list[int] = []  # a min-heap: the lowest slots fill first
        self._children: dict[BlockKey, int] = {}  # parent key -> present blocks naming it
        self._pins: dict[BlockKey, int] = {}  # key -> reference count (> 0 only)
        self._evictable: dict[BlockKey, int] = {}  # key -> seq of its one live heap entry
        self._heap: list[tuple[int, int, int, BlockKey]] = []  # (class, tick, seq, key)
        self._seq = itertools.count()
        self._tick = 0
        self._used_bytes = 0
        self._removed_keys: list[BlockKey] = []
        self._hits = self._misses = self._corrupt = self._evictions = 0
        self._write_errors = self._rejected_puts = 0
        self._num_leased = self._leased_evictions = 0
        try:
            self.rebuild_index()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the slot file (idempotent); the tier is unusable afterwards."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writes ----------------------------------------------------------------------------------

    def put(self, key: BlockKey, parent: BlockKey | None, payload: Any, *,
            leased: bool = False, payload_xxh3: int | None = None) -> bool:
        """Store one block; True when it is on disk afterwards (already present counts, and
        then takes ``leased`` as its mark).

        ``payload`` is ``bytes``, a ``memoryview``/``bytearray`` or a uint8 tensor, of exactly
        ``block_bytes`` bytes (``ValueError`` otherwise). ``payload_xxh3``, when the caller
        knows it, is the payload's XXH3-64 (``transfer_wire.block_checksum``: the node keeps it
        for blocks it served or pulled); the tier then writes it into the header without
        hashing the payload again. A wrong one is the caller's bug, and reads as a corrupt
        block (a counted miss), never as wrong bytes. Evicts leaf-LRU blocks to make room,
        never a pinned one, never ``parent`` and, for a plain block, never a leased one.
        Returns False, with nothing left behind, when no room can be made (``rejected_puts``)
        or the write fails, e.g. a full disk (``write_errors``, logged): the caller degrades
        to recompute.
        """
        return self.put_many([(key, parent, payload)], leased=leased,
                             payload_xxh3s=[payload_xxh3])[0]

    def put_many(self, blocks: Sequence[tuple[BlockKey, BlockKey | None, Any]], *,
                 leased: bool = False,
                 payload_xxh3s: Sequence[int | None] | None = None,
                 leased_flags: Sequence[bool] | None = None) -> list[bool]:
        """``put`` of each ``(key, parent, payload)`` (``payload_xxh3s[i]``, when given, is
        block ``i``'s known digest, as ``put``'s ``payload_xxh3``; ``leased_flags[i]``, when
        given, its ``leased`` instead of the batch's); element ``i`` of the result is ``put``'s
        answer for block ``i``, as a loop of ``put`` would give it, but for one difference: a
        block of the batch never evicts an earlier one of the same batch (it is refused
        instead, where only those could make room).

        The blocks are admitted in order (room made, a slot taken, indexed and pinned), then
        written: blocks in adjacent slots as one ``pwritev`` of their whole slots, at most
        ``RUN_BLOCKS`` to a write (``_write_run`` says why), then unpinned. A failed write
        drops the blocks of its run (False, ``write_errors``, never announced as removed).
        With ``fsync=True`` the batch costs one ``fdatasync``, before returning; if that sync
        fails, every block this call wrote is dropped again and reads False."""
        assert payload_xxh3s is None or len(payload_xxh3s) == len(blocks)
        assert leased_flags is None or len(leased_flags) == len(blocks)
        views = [self._checked_view(payload) for _, _, payload in blocks]  # before any change
        results = [False] * len(blocks)
        admitted: list[_Admitted] = []
        first_of: dict[BlockKey, int] = {}  # key admitted in this call -> its block index
        duplicates: list[tuple[int, int]] = []  # (block index, its first copy's)
        written: list[_Admitted] = []
        try:
            for i, (key, parent, _) in enumerate(blocks):
                is_leased = leased_flags[i] if leased_flags is not None else leased
                if key in first_of:  # a duplicate: it shares its first copy's answer
                    self.set_leased(key, is_leased)
                    duplicates.append((i, first_of[key]))
                    continue
                slot = self._admit(key, parent, is_leased)
                if slot is None:
                    results[i] = key in self._entries
                else:
                    first_of[key] = i
                    digest = payload_xxh3s[i] if payload_xxh3s is not None else None
                    admitted.append(_Admitted(i, key, parent, views[i], slot, digest))
            for run in _runs_of_adjacent_slots(admitted, RUN_BLOCKS):
                if self._write_run(run):
                    written.extend(run)
        except BaseException:  # not a write error (those are answers): leave nothing half-done
            done = {block.key for block in written}
            self._unadmit([b for b in admitted if b.key not in done and b.key in self._pins])
            for block in written:
                self.unpin(block.key)
            raise
        if self.fsync and written:
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                self._write_errors += len(written)
                logger.warning("disk tier sync of %d blocks failed; dropping them: %s",
                               len(written), e)
                self._unadmit(written)
                written = []
        for block in written:
            self.unpin(block.key)
            results[block.index] = True
        for i, first in duplicates:
            results[i] = results[first]
        return results

    def _checked_view(self, payload: Any) -> memoryview:
        view = as_byte_view(payload)
        if len(view) != self.block_bytes:
            raise ValueError(f"a disk block holds {self.block_bytes} bytes, got {len(view)}")
        return view

    def _admit(self, key: BlockKey, parent: BlockKey | None, leased: bool) -> int | None:
        """Step 1 of a put: a slot for a new block, the block indexed and pinned until its
        write returns. None when present already (marked ``leased``) or refused (counted)."""
        assert len(key) == KEY_SIZE_BYTES and (parent is None or len(parent) == KEY_SIZE_BYTES)
        if key in self._entries:
            self.set_leased(key, leased)
            return None
        if not self._make_room(self.slot_bytes, guard=parent, max_class=LEASED if leased else PLAIN):
            self._rejected_puts += 1
            return None
        slot = heapq.heappop(self._free_slots)
        # pinned before it is indexed, so never filed as evictable until written (a reader
        # may still owe a pin on the key from a copy dropped as corrupt: it stays owed)
        self._pins[key] = self._pins.get(key, 0) + 1
        self._insert(key, parent, slot, self._next_tick(), leased)
        return slot

    def _unadmit(self, blocks: Sequence[_Admitted]) -> None:
        """Undo ``_admit`` for blocks whose write or sync failed: unpinned, dropped (their slots'
        headers zeroed) and not announced, as they were never reported stored."""
        for block in blocks:
            self.unpin(block.key)
            self._drop(self._entries[block.key])
        unannounced = {block.key for block in blocks}
        self._removed_keys = [k for k in self._removed_keys if k not in unannounced]

    def set_leased(self, key: BlockKey, leased: bool) -> bool:
        """Mark a present block as leased (evicted after plain blocks) or plain again, its
        recency unchanged; False when absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.leased != leased:
            entry.leased = leased
            self._num_leased += 1 if leased else -1
            self._evictable.pop(key, None)  # its priority changed: file it afresh
            self._refile(key)
        return True

    def remove(self, key: BlockKey) -> bool:
        """Delete a block; False when it is absent or pinned (a read is in progress)."""
        entry = self._entries.get(key)
        if entry is None or key in self._pins:
            return False
        self._drop(entry)
        return True

    # -- reads -----------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> bytes | None:
        """The payload of ``key``, verified, or None on a miss (see ``get_into``)."""
        payload = bytearray(self.block_bytes)
        return bytes(payload) if self.get_into(key, payload) else None

    def get_into(self, key: BlockKey, out: Any) -> bool:
        """Read the payload of ``key`` into ``out`` (a writable buffer or uint8 tensor of
        ``block_bytes``), verified; False on a miss. Counts a hit or a miss.

        A block whose magic, version, key, parent, length or checksum is wrong (or whose slot
        cannot be read whole) is dropped, counted in ``corrupt_blocks`` and returned as a miss;
        ``out`` then holds undefined bytes. A hit makes the block the most recently used.
        """
        view = as_byte_view(out)
        if len(view) != self.block_bytes or view.readonly:
            raise ValueError(f"get_into needs a writable buffer of {self.block_bytes} bytes")
        entry = self._entries.get(key)
        if entry is None:
            self._misses += 1
            return False
        if not self._read_verified_into(entry, view):
            self._corrupt += 1
            self._misses += 1
            logger.warning("disk tier block %s failed verification; dropped", key_hex(key))
            self._drop(entry)
            return False
        self._hits += 1
        entry.last_access_tick = self._next_tick()
        self._evictable.pop(key, None)  # its priority changed: file it afresh
        self._refile(key)
        return True

    def keys(self) -> list[BlockKey]:
        """Every indexed block's key."""
        return list(self._entries)

    def contains(self, key: BlockKey) -> bool:
        return key in self._entries

    __contains__ = contains

    def __len__(self) -> int:
        return len(self._entries)

    def match_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading keys present (not verified). No pin, no LRU touch, no counters."""
        for i, key in enumerate(keys):
            if key not in self._entries:
                return i
        return len(keys)

    def block_location(self, key: BlockKey) -> tuple[Path, int]:
        """The file and byte offset of a present block's header (its payload ``payload_offset``
        bytes further on), for
        operators and tests; ``KeyError`` when absent."""
        return self.path, self._entries[key].slot * self.slot_bytes

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, key: BlockKey) -> bool:
        """Add a reference to a present block so it is not evicted; False when absent."""
        if key not in self._entries:
            return False
        self._pins[key] = self._pins.get(key, 0) + 1
        self._refile(key)
        return True

    def unpin(self, key: BlockKey) -> None:
        """Drop a reference taken by ``pin``. The block may have been dropped meanwhile as
        corrupt; the reference is still owed. Unpinning an unpinned key is a bug (assertion)."""
        count = self._pins.get(key, 0)
        assert count > 0, f"unpin of an unpinned block: {key_hex(key)}"
        if count == 1:
            del self._pins[key]
            self._refile(key)
        else:
            self._pins[key] = count - 1

    # -- bookkeeping for the owner ---------------------------------------------------------------

    def drain_removed_keys(self) -> list[BlockKey]:
        """Keys dropped (evicted or corrupt) since the last call, in order, for KV events."""
        removed, self._removed_keys = self._removed_keys, []
        return removed

    def stats(self) -> DiskTierStats:
        return DiskTierStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self._used_bytes,
            used_blocks=len(self._entries),
            pinned_blocks=sum(key in self._entries for key in self._pins),
            evictable_blocks=len(self._evictable),
            hits=self._hits,
            misses=self._misses,
            corrupt_blocks=self._corrupt,
            evictions=self._evictions,
            write_errors=self._write_errors,
            rejected_puts=self._rejected_puts,
            leased_blocks=self._num_leased,
            leased_evictions=self._leased_evictions,
        )

    def rebuild_index(self) -> None:
        """Forget the in-memory index and rebuild it from the slot headers (start-up).

        Keeps each slot whose header is sound (magic, version, header checksum, length); payload
        checksums are verified on read, not here, so start-up costs one header read per written
        slot. A key found twice (a crash undid a drop's header zeroing) keeps its first slot; the
        other is zeroed. Recency restarts in slot order. If the capacity shrank, blocks in slots
        beyond the new ``num_slots`` are evicted and the file is truncated; if it grew, the file
        is extended (sparse).
        """
        assert not self._pins, "rebuild_index with reads in progress"
        self._entries.clear()
        self._children.clear()
        self._evictable.clear()
        self._heap.clear()
        self._used_bytes = 0
        self._num_leased = 0
        file_bytes = os.fstat(self._fd).st_size
        seen: set[BlockKey] = set()
        for slot, key, parent in sound_headers(self._fd, file_bytes, self.block_bytes):
            if key in seen:
                logger.info("disk tier start-up: block %s found twice; one kept", key_hex(key))
                if slot < self.num_slots:
                    self._zero_header(slot)
            elif slot >= self.num_slots:
                logger.info("disk tier start-up: block %s is beyond the capacity", key_hex(key))
                self._evictions += 1
                self._removed_keys.append(key)
            else:
                self._insert(key, parent, slot, self._next_tick())
            seen.add(key)
        if file_bytes != self.num_slots * self.slot_bytes:
            os.ftruncate(self._fd, self.num_slots * self.slot_bytes)
            if self.fsync:  # the new size, and the file's name if it was just created
                os.fsync(self._fd)
                _fsync_directory(self.directory)
        used_slots = {entry.slot for entry in self._entries.values()}
        self._free_slots = [slot for slot in range(self.num_slots) if slot not in used_slots]
        self._make_room(0, guard=None)  # a no-op by construction; kept as the capacity guard

    def check_invariants(self) -> None:
        """Assert every invariant of the module docstring, reading every written slot header."""
        assert self._used_bytes == len(self._entries) * self.slot_bytes
        assert self._used_bytes <= self.capacity_bytes, "capacity exceeded"
        used_slots = [entry.slot for entry in self._entries.values()]
        all_slots = sorted(used_slots + self._free_slots)
        assert all_slots == list(range(self.num_slots)), "slots lost, shared or out of range"
        children: dict[BlockKey, int] = {}
        for entry in self._entries.values():
            if entry.parent is not None:
                children[entry.parent] = children.get(entry.parent, 0) + 1
        assert children == self._children, "child counts are off"
        assert all(count > 0 for count in self._pins.values()), "non-positive pin count"
        rule = {key for key in self._entries if self._is_evictable(key)}
        assert set(self._evictable) == rule, "evictable set differs from the rule"
        live = {key for (_, _, seq, key) in self._heap if self._evictable.get(key) == seq}
        assert live == rule, "evictable block missing from the heap"
        for cls, tick, seq, key in self._heap:
            if self._evictable.get(key) == seq:
                assert (cls, tick) == self._priority(self._entries[key]), "stale priority in heap"
        assert self._num_leased == sum(entry.leased for entry in self._entries.values())
        file_bytes = os.fstat(self._fd).st_size
        assert file_bytes == self.num_slots * self.slot_bytes, "the slot file has the wrong size"
        on_disk = {slot: (key, parent) for slot, key, parent in
                   sound_headers(self._fd, file_bytes, self.block_bytes)}
        indexed = {entry.slot: (entry.key, entry.parent) for entry in self._entries.values()}
        stray = {slot: block for slot, block in on_disk.items() if indexed.get(slot) != block}
        assert not stray, f"sound headers in free or other blocks' slots: {sorted(stray)}"

    # -- internals -------------------------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _is_evictable(self, key: BlockKey) -> bool:
        return key in self._entries and key not in self._pins and key not in self._children

    @staticmethod
    def _priority(entry: _Entry) -> tuple[int, int]:
        """Smallest goes first: the host tier's classes (no soft pins on disk), LRU within."""
        return eviction_class(soft_pinned=False, leased=entry.leased), entry.last_access_tick

    def _refile(self, key: BlockKey) -> None:
        """Bring ``key``'s membership in the evictable set in line with the rule."""
        if not self._is_evictable(key):
            self._evictable.pop(key, None)
            return
        if key in self._evictable:
            return
        seq = next(self._seq)
        self._evictable[key] = seq
        heapq.heappush(self._heap, (*self._priority(self._entries[key]), seq, key))
        if len(self._heap) > 2 * len(self._evictable) + 1024:
            self._heap = [e for e in self._heap if self._evictable.get(e[3]) == e[2]]
            heapq.heapify(self._heap)

    def _insert(self, key: BlockKey, parent: BlockKey | None, slot: int, tick: int,
                leased: bool = False) -> None:
        self._entries[key] = _Entry(key, parent, slot, tick, leased)
        self._num_leased += leased
        self._used_bytes += self.slot_bytes
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            self._refile(parent)
        self._refile(key)

    def _drop(self, entry: _Entry) -> None:
        """Free the block's slot and forget it; its parent may become a leaf."""
        self._free_slot(entry.slot)
        del self._entries[entry.key]
        self._evictable.pop(entry.key, None)
        self._num_leased -= entry.leased
        self._used_bytes -= self.slot_bytes
        self._removed_keys.append(entry.key)
        if entry.parent is not None:
            count = self._children[entry.parent] - 1
            if count:
                self._children[entry.parent] = count
            else:
                del self._children[entry.parent]
            self._refile(entry.parent)

    def _free_slot(self, slot: int) -> None:
        self._zero_header(slot)
        heapq.heappush(self._free_slots, slot)

    def _zero_header(self, slot: int) -> None:
        """One small write so a restart does not index the slot; the rest of the payload stays
        (a slot without a sound header holds no block)."""
        try:
            os.pwrite(self._fd, self._cleared_prefix, slot * self.slot_bytes)
        except OSError as e:  # the block is gone from the index; a restart may bring it back
            logger.warning("disk tier could not clear slot %d: %s", slot, e)

    def _make_room(self, num_bytes: int, guard: BlockKey | None,
                   max_class: int = LEASED) -> bool:
        """Evict LRU leaves of class ``max_class`` or lower until ``num_bytes`` more fit; never
        ``guard``. False if impossible."""
        if self._used_bytes + num_bytes <= self.capacity_bytes:
            return True
        guarded = guard is not None and self._evictable.pop(guard, None) is not None
        try:
            while self._used_bytes + num_bytes > self.capacity_bytes:
                if not self._evict_one(max_class):
                    return False
            return True
        finally:
            if guarded:
                self._refile(guard)

    def _evict_one(self, max_class: int = LEASED) -> bool:
        while self._heap:
            cls, _, seq, key = self._heap[0]
            if self._evictable.get(key) != seq:
                heapq.heappop(self._heap)  # stale
                continue
            if cls > max_class:
                return False
            heapq.heappop(self._heap)
            entry = self._entries[key]
            self._evictions += 1
            self._leased_evictions += entry.leased
            self._drop(entry)
            return True
        return False

    def _write_run(self, run: Sequence[_Admitted]) -> bool:
        """Write the whole slots of ``run`` (blocks in adjacent slots, in slot order) with one
        ``pwritev``: per block its header, the zeros up to the payload, the payload and the
        zeros to the slot's end, so no page is read back from the disk. A payload whose digest
        is unknown is hashed just before the write, ``RUN_BLOCKS`` at a time: the copy into the
        page cache then reads the payloads from the CPU's cache, and the header goes in the
        same write (a torn write leaves a sound header over a payload that fails its XXH3: a
        counted miss on read, never served). False when the write failed (counted, logged,
        the run's blocks dropped)."""
        gap = memoryview(self._cleared_prefix)[HEADER_BYTES:]
        padding = memoryview(self._padding)
        buffers: list[memoryview] = []
        for block in run:
            header = pack_header(block.key, block.parent, block.payload, block.payload_xxh3)
            buffers += [memoryview(header), gap, block.payload, padding]
        try:
            self._pwrite_all(buffers, run[0].slot * self.slot_bytes)
        except OSError as e:
            self._write_errors += len(run)
            hint = " (disk full: free space or lower the disk tier capacity)" if (
                e.errno == errno.ENOSPC
            ) else ""
            logger.warning("disk tier write of %d block(s) from %s failed%s: %s", len(run),
                           key_hex(run[0].key), hint, e)
            self._unadmit(run)
            return False
        return True

    def _pwrite_all(self, buffers: list[memoryview], offset: int) -> None:
        """``pwritev`` of ``buffers`` at ``offset`` (``IOV_MAX`` buffers a call); a short write
        (rare) resumes where it stopped."""
        buffers = [b for b in buffers if len(b)]
        while buffers:
            num_written = os.pwritev(self._fd, buffers[:_IOV_MAX], offset)
            if num_written <= 0:
                raise OSError(errno.EIO, "pwritev wrote nothing")
            offset += num_written
            while buffers and num_written >= len(buffers[0]):
                num_written -= len(buffers[0])
                buffers.pop(0)
            if buffers:
                buffers[0] = buffers[0][num_written:]

    def _read_verified_into(self, entry: _Entry, out: memoryview) -> bool:
        """One ``preadv`` reads the header and the payload into ``out``; the header must be the
        one this block's put wrote (its checksums aside) with a sound checksum, and the payload
        must match its XXH3. Kept to a few calls: the copy has just evicted the CPU caches."""
        header = bytearray(HEADER_BYTES)
        buffers = [header, self._header_gap, out] if self._header_gap else [header, out]
        try:
            num_read = os.preadv(self._fd, buffers, entry.slot * self.slot_bytes)
        except OSError:
            return False
        return num_read == self.payload_offset + self.block_bytes and holds_block(
            header, entry.key, entry.parent, out)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_per_file_blocks(directory: Path) -> None:
    """Format 2 kept one file per block in two-hex-digit subfolders; this format cannot read
    them, so they would only take space."""
    for folder in directory.iterdir():
        name = folder.name
        if len(name) == 2 and all(c in "0123456789abcdef" for c in name) and folder.is_dir():
            logger.info("disk tier start-up: removing format-2 block folder %s", folder)
            shutil.rmtree(folder, ignore_errors=True)
