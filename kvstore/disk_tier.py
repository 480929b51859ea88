"""The SSD tier's mechanism: one checksummed file per block in a directory, with leaf-LRU eviction.

A block lives in ``<directory>/<hh>/<key hex>``, where ``hh`` is the first two hex digits of the
key (256 subfolders keep directories small). Each file is a fixed header followed by the payload::

    magic "BATONKV\\0" | version u16 | flags u16 | key 16B | parent 16B | payload_len u64
    | payload_xxh3 u64 | header_crc32 u32

All integers are little-endian. ``flags`` bit 0 says the parent field is meaningful (the block is
not the first of its chain). ``header_crc32`` covers every header byte before it, so start-up can
trust a header (the parent link decides eviction order) without reading the payload;
``payload_xxh3`` (XXH3-64 of the payload) is checked on every read. A flipped bit anywhere in the
file is caught. XXH3 replaced CRC-32 (format version 1) because a page-cache read runs at
~7.5 GB/s here and CRC-32 at ~3.6 GB/s would halve it; XXH3 runs at ~39 GB/s (368 KB block). It
guards against bit rot and torn writes, not against an adversary who can write the directory.

Writes are atomic: the file is written under a temporary name in the same subfolder and renamed
into place with ``os.replace``, so a reader (or a restart) sees either the whole block or nothing.
A block that fails any check on read is deleted, counted in ``corrupt_blocks`` and reported as a
miss: the caller recomputes; a wrong block is never served.

Invariants (``check_invariants`` asserts all of them):

- ``used_bytes`` (headers included) is the sum of the indexed files' sizes and never exceeds
  ``capacity_bytes``; the files in the directory are exactly the indexed blocks (no temporaries);
- a block may be present without its parent (the host tier demotes leaves first, so a parent often
  reaches the disk after its child), but ``children`` counts, per key, the present blocks naming it
  as parent, whether or not that key is present itself;
- a block is evictable iff it is present, unpinned and has no present children ("LRU over
  leaves"): a shared ancestor goes only after all of its descendants; least recently used first.

Single-threaded: the owning actor serialises calls.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from kvstore.keys import KEY_SIZE_BYTES, BlockKey, key_from_hex, key_hex

logger = logging.getLogger(__name__)

MAGIC = b"BATONKV\x00"
FORMAT_VERSION = 2
_FLAG_HAS_PARENT = 1
_HEADER = struct.Struct("<8sHH16s16sQQI")
HEADER_BYTES = _HEADER.size
_CHECKED_HEADER_BYTES = HEADER_BYTES - 4  # every header byte before the header checksum
_TEMP_SUFFIX = ".tmp"
_NO_PARENT = bytes(KEY_SIZE_BYTES)


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


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    parent: BlockKey | None
    file_bytes: int
    last_access_tick: int


class DiskTier:
    """Blocks of exactly ``block_bytes`` payload bytes in ``directory``, at most ``capacity_bytes``
    on disk (headers included). Construction scans the directory (``rebuild_index``), so a restart
    keeps every block whose header is intact.

    ``fsync=True`` syncs each file and its folder before a put returns (durable across power loss;
    slower). Without it a crash of the machine may lose recent blocks, never expose partial ones
    except as checksum failures, which read as misses.
    """

    def __init__(
        self, directory: Path, capacity_bytes: int, block_bytes: int, *, fsync: bool = False
    ) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.file_bytes = HEADER_BYTES + block_bytes
        if capacity_bytes < self.file_bytes:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} cannot hold one block of {block_bytes} bytes "
                f"plus its {HEADER_BYTES}-byte header; raise the disk tier capacity"
            )
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.fsync = fsync
        self.directory.mkdir(parents=True, exist_ok=True)
        self._root = str(self.directory)
        self._fanout_made: set[str] = set()  # subfolders known to exist (no mkdir per put)
        self._entries: dict[BlockKey, _Entry] = {}
        self._children: dict[BlockKey, int] = {}  # parent key -> present blocks naming it
        self._pins: dict[BlockKey, int] = {}  # key -> reference count (> 0 only)
        self._evictable: dict[BlockKey, int] = {}  # key -> seq of its one live heap entry
        self._heap: list[tuple[int, int, BlockKey]] = []  # (tick, seq, key)
        self._seq = itertools.count()
        self._tick = 0
        self._used_bytes = 0
        self._removed_keys: list[BlockKey] = []
        self._hits = self._misses = self._corrupt = self._evictions = 0
        self._write_errors = self._rejected_puts = 0
        self.rebuild_index()

    # -- writes ----------------------------------------------------------------------------------

    def put(self, key: BlockKey, parent: BlockKey | None, payload: Any) -> bool:
        """Store one block; True when it is on disk afterwards (already present counts).

        ``payload`` is ``bytes``, a ``memoryview``/``bytearray`` or a uint8 tensor, of exactly
        ``block_bytes`` bytes (``ValueError`` otherwise). Evicts leaf-LRU blocks to make room,
        never a pinned one and never ``parent``. Returns False, with nothing left behind, when no
        room can be made (``rejected_puts``) or the write fails, e.g. a full disk
        (``write_errors``, logged): the caller degrades to recompute.
        """
        assert len(key) == KEY_SIZE_BYTES and (parent is None or len(parent) == KEY_SIZE_BYTES)
        view = _as_byte_view(payload)
        if len(view) != self.block_bytes:
            raise ValueError(f"a disk block holds {self.block_bytes} bytes, got {len(view)}")
        if key in self._entries:
            return True
        if not self._make_room(self.file_bytes, guard=parent):
            self._rejected_puts += 1
            return False
        header = _pack_header(key, parent, view)
        try:
            self._write_atomically(self._path(key), header, view)
        except OSError as e:
            self._write_errors += 1
            hint = " (disk full: free space or lower the disk tier capacity)" if (
                e.errno == errno.ENOSPC
            ) else ""
            logger.warning("disk tier write of block %s failed%s: %s", key_hex(key), hint, e)
            return False
        self._insert(key, parent, self.file_bytes, self._next_tick())
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

        A block whose magic, version, key, length or checksum is wrong (or whose file vanished)
        is deleted, counted in ``corrupt_blocks`` and returned as a miss; ``out`` then holds
        undefined bytes. A hit makes the block the most recently used.
        """
        view = _as_byte_view(out)
        if len(view) != self.block_bytes or view.readonly:
            raise ValueError(f"get_into needs a writable buffer of {self.block_bytes} bytes")
        entry = self._entries.get(key)
        if entry is None:
            self._misses += 1
            return False
        if not self._read_verified_into(key, view):
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
        )

    def rebuild_index(self) -> None:
        """Forget the in-memory index and rebuild it from the directory (start-up).

        Deletes temporaries and block files whose header is bad (header checksum, magic, version,
        key not matching the file name, length or file size). Payload checksums are verified on
        read, not here, so start-up costs one header read per file. Recency is restored from file
        modification times (ties by key); if the blocks exceed the capacity, LRU leaves go.
        """
        assert not self._pins, "rebuild_index with reads in progress"
        self._entries.clear()
        self._children.clear()
        self._evictable.clear()
        self._heap.clear()
        self._used_bytes = 0
        found: list[tuple[int, str, BlockKey, BlockKey | None]] = []
        for folder in sorted(p for p in self.directory.iterdir() if _is_fanout_dir(p)):
            for path in folder.iterdir():
                if not path.is_file():
                    continue
                header = None if path.name.endswith(_TEMP_SUFFIX) else self._read_header(path)
                if header is None:
                    logger.info("disk tier start-up: removing %s", path)
                    _unlink_quietly(path)
                else:
                    found.append((path.stat().st_mtime_ns, path.name, *header))
        for _, _, key, parent in sorted(found):
            self._insert(key, parent, self.file_bytes, self._next_tick())
        self._make_room(0, guard=None)

    def check_invariants(self) -> None:
        """Assert every invariant of the module docstring, including the directory's contents."""
        assert self._used_bytes == sum(e.file_bytes for e in self._entries.values())
        assert self._used_bytes <= self.capacity_bytes, "capacity exceeded"
        children: dict[BlockKey, int] = {}
        for entry in self._entries.values():
            if entry.parent is not None:
                children[entry.parent] = children.get(entry.parent, 0) + 1
        assert children == self._children, "child counts are off"
        assert all(count > 0 for count in self._pins.values()), "non-positive pin count"
        rule = {key for key in self._entries if self._is_evictable(key)}
        assert set(self._evictable) == rule, "evictable set differs from the rule"
        live = {key for (_, seq, key) in self._heap if self._evictable.get(key) == seq}
        assert live == rule, "evictable block missing from the heap"
        for tick, seq, key in self._heap:
            if self._evictable.get(key) == seq:
                assert tick == self._entries[key].last_access_tick, "stale priority in heap"
        on_disk = {
            path.name: path.stat().st_size
            for folder in self.directory.iterdir()
            if _is_fanout_dir(folder)
            for path in folder.iterdir()
        }
        indexed = {key_hex(k): e.file_bytes for k, e in self._entries.items()}
        assert on_disk == indexed, "directory and index disagree (stray, partial or lost files)"

    # -- internals -------------------------------------------------------------------------------

    def _path(self, key: BlockKey) -> str:
        name = key_hex(key)
        return f"{self._root}/{name[:2]}/{name}"  # a str: pathlib costs ~20 us per block here

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _is_evictable(self, key: BlockKey) -> bool:
        return key in self._entries and key not in self._pins and key not in self._children

    def _refile(self, key: BlockKey) -> None:
        """Bring ``key``'s membership in the evictable set in line with the rule."""
        if not self._is_evictable(key):
            self._evictable.pop(key, None)
            return
        if key in self._evictable:
            return
        seq = next(self._seq)
        self._evictable[key] = seq
        heapq.heappush(self._heap, (self._entries[key].last_access_tick, seq, key))
        if len(self._heap) > 2 * len(self._evictable) + 1024:
            self._heap = [e for e in self._heap if self._evictable.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def _insert(self, key: BlockKey, parent: BlockKey | None, file_bytes: int, tick: int) -> None:
        self._entries[key] = _Entry(key, parent, file_bytes, tick)
        self._used_bytes += file_bytes
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            self._refile(parent)
        self._refile(key)

    def _drop(self, entry: _Entry) -> None:
        """Delete the block's file and forget it; its parent may become a leaf."""
        _unlink_quietly(self._path(entry.key))
        del self._entries[entry.key]
        self._evictable.pop(entry.key, None)
        self._used_bytes -= entry.file_bytes
        self._removed_keys.append(entry.key)
        if entry.parent is not None:
            count = self._children[entry.parent] - 1
            if count:
                self._children[entry.parent] = count
            else:
                del self._children[entry.parent]
            self._refile(entry.parent)

    def _make_room(self, num_bytes: int, guard: BlockKey | None) -> bool:
        """Evict LRU leaves until ``num_bytes`` more fit; never ``guard``. False if impossible."""
        guarded = guard is not None and self._evictable.pop(guard, None) is not None
        try:
            while self._used_bytes + num_bytes > self.capacity_bytes:
                if not self._evict_one():
                    return False
            return True
        finally:
            if guarded:
                self._refile(guard)

    def _evict_one(self) -> bool:
        while self._heap:
            _, seq, key = heapq.heappop(self._heap)
            if self._evictable.get(key) == seq:
                self._evictions += 1
                self._drop(self._entries[key])
                return True
        return False

    def _write_atomically(self, path: str, header: bytes, payload: memoryview) -> None:
        """Header and payload in one ``pwritev`` to a temporary file, then an atomic rename: a
        reader never sees a partial block, a crash leaves only a temporary (deleted at start)."""
        folder = path[: path.rindex("/")]
        if folder not in self._fanout_made:
            os.makedirs(folder, exist_ok=True)
            self._fanout_made.add(folder)
        temp = path + _TEMP_SUFFIX
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the subfolder was removed under us: make it again
            os.makedirs(folder, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                total, written = len(header) + len(payload), 0
                buffers = [memoryview(header), payload]
                while written < total:
                    n = os.pwritev(fd, buffers, written)
                    written += n
                    if written < total:  # a short write (rare): resume where it stopped
                        buffers = [b for b in (memoryview(header)[written:],
                                               payload[max(0, written - len(header)):]) if b]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except OSError:
            _unlink_quietly(temp)
            raise
        if self.fsync:
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _read_header(self, path: Path) -> tuple[BlockKey, BlockKey | None] | None:
        """(key, parent) from a file whose header is sound, else None. No payload check."""
        try:
            key = key_from_hex(path.name)
            with open(path, "rb") as f:
                raw = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
        except (OSError, ValueError):
            return None
        return self._parse_header(raw, key, size)

    def _parse_header(
        self, raw: bytes, key: BlockKey, file_size: int
    ) -> tuple[BlockKey, BlockKey | None] | None:
        if len(raw) != HEADER_BYTES or file_size != self.file_bytes:
            return None
        magic, version, flags, stored_key, parent, payload_len, _, header_crc = _HEADER.unpack(raw)
        if zlib.crc32(raw[:_CHECKED_HEADER_BYTES]) != header_crc:
            return None
        expected = (MAGIC, FORMAT_VERSION, key, self.block_bytes)
        if (magic, version, stored_key, payload_len) != expected:
            return None
        return key, BlockKey(parent) if flags & _FLAG_HAS_PARENT else None

    def _read_verified_into(self, key: BlockKey, out: memoryview) -> bool:
        """One ``preadv`` reads the header, the payload into ``out`` and probes for a trailing
        byte (a file of the wrong size fails), then both checksums are verified."""
        header = bytearray(HEADER_BYTES)
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except OSError:
            return False
        try:
            num_read = os.preadv(fd, [header, out, bytearray(1)], 0)
        except OSError:
            return False
        finally:
            os.close(fd)
        if self._parse_header(header, key, num_read) is None:
            return False
        (payload_xxh3,) = struct.unpack_from("<Q", header, _CHECKED_HEADER_BYTES - 8)
        return xxhash.xxh3_64_intdigest(out) == payload_xxh3


def _pack_header(key: BlockKey, parent: BlockKey | None, payload: memoryview) -> bytes:
    flags = _FLAG_HAS_PARENT if parent is not None else 0
    fields = (MAGIC, FORMAT_VERSION, flags, key, parent or _NO_PARENT, len(payload))
    prefix = _HEADER.pack(*fields, xxhash.xxh3_64_intdigest(payload), 0)[:_CHECKED_HEADER_BYTES]
    return prefix + struct.pack("<I", zlib.crc32(prefix))


def _as_byte_view(payload: Any) -> memoryview:
    """A flat byte view of bytes-like data (numpy arrays included) or a uint8 tensor (on the
    CPU), without copying."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        if type(payload).__module__ == "numpy":
            return memoryview(payload).cast("B")
        import torch  # only callers that pass tensors pay for the import

        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise TypeError(f"a disk block payload is bytes or a uint8 tensor, got {payload!r:.80}")
        payload = payload.detach().cpu().contiguous().view(-1).numpy()
    return memoryview(payload).cast("B")


def _is_fanout_dir(path: Path) -> bool:
    name = path.name
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name) and path.is_dir()


def _unlink_quietly(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
