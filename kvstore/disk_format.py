"""The SSD tier's on-disk format: the slot file, its fixed block header, and reading headers back.

Blocks live in ``<directory>/blocks.slots``: slots of ``slot_bytes = slot_bytes_for(block_bytes)``
bytes, slot ``i`` at byte ``i * slot_bytes``. Each slot is a fixed header followed by the
payload at ``payload_offset_for(block_bytes)``. Large blocks (where it pads the slot by at most
1/16) get page-aligned slots: the header alone in the slot's first page, the payload from the
second page on, zeros to the end of its last page; small blocks (as in tests) are packed,
``HEADER_BYTES + block_bytes``, the payload right after the header. The header::

    magic "BATONKV\\0" | version u16 | flags u16 | key 16B | parent 16B | payload_len u64
    | payload_xxh3 u64 | header_crc32 u32

All integers are little-endian. ``flags`` bit 0 says the parent field is meaningful (the block is
not the first of its chain). ``header_crc32`` covers every header byte before it, so start-up can
trust a header (the parent link decides eviction order) without reading the payload;
``payload_xxh3`` (XXH3-64 of the payload) is checked on every read. A flipped bit anywhere in the
slot is caught. XXH3 replaced CRC-32 (format version 1) because a page-cache read runs at
~7.5 GB/s here and CRC-32 at ~3.6 GB/s would halve it; XXH3 runs at ~39 GB/s (368 KB block). It
guards against bit rot and torn writes, not against an adversary who can write the directory.
Page-aligned slots keep a write off the disk's read path and the copy into the page cache
aligned: a write that covers only part of a page that is not in the page cache makes the kernel
read that page first (packed slots share their first and last pages with their neighbours), and
a payload that starts 64 bytes into a page is copied page by page in two pieces. With the page
cache dropped, a put of a 368 KB block into packed slots ran at half the speed of the same bytes
written page-aligned here (``baton bench kvstore``'s disk-write row). Slot files written with
packed large slots (before the alignment) are not read back: their blocks are misses.
A slot whose header is all zeros (``ZERO_HEADER``, or a hole of the sparse file) holds no block.

Contract: ``pack_header`` and ``holds_block`` are inverses for one (key, parent, payload);
``parse_header`` accepts exactly the headers ``pack_header`` writes for ``block_bytes``-byte
payloads; ``sound_headers`` and ``find_block`` only read the file. The tier that owns the file
(``kvstore.disk_tier``) does all writing.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import xxhash

from kvstore.keys import KEY_SIZE_BYTES, BlockKey

MAGIC = b"BATONKV\x00"
FORMAT_VERSION = 3
SLOT_FILE_NAME = "blocks.slots"
_FLAG_HAS_PARENT = 1
_HEADER = struct.Struct("<8sHH16s16sQQI")
_PREFIX = struct.Struct("<8sHH16s16sQ")  # the header up to its checksums
_CHECKSUMS = struct.Struct("<QI")  # payload_xxh3, header_crc32
HEADER_BYTES = _HEADER.size
_CHECKED_HEADER_BYTES = HEADER_BYTES - 4  # every header byte before the header checksum
ZERO_HEADER = bytes(HEADER_BYTES)
PAGE_BYTES = 4096
_NO_PARENT = bytes(KEY_SIZE_BYTES)


def is_page_aligned(block_bytes: int) -> bool:
    """Whether ``block_bytes``-byte payloads get page-aligned slots (see the module doc)."""
    packed = HEADER_BYTES + block_bytes
    aligned = PAGE_BYTES + -(-block_bytes // PAGE_BYTES) * PAGE_BYTES
    return 16 * (aligned - packed) <= packed


def slot_bytes_for(block_bytes: int) -> int:
    """Bytes of one slot for ``block_bytes``-byte payloads."""
    if is_page_aligned(block_bytes):
        return PAGE_BYTES + -(-block_bytes // PAGE_BYTES) * PAGE_BYTES
    return HEADER_BYTES + block_bytes


def payload_offset_for(block_bytes: int) -> int:
    """Where the payload starts within its slot."""
    return PAGE_BYTES if is_page_aligned(block_bytes) else HEADER_BYTES


def pack_header(key: BlockKey, parent: BlockKey | None, payload: memoryview,
                payload_xxh3: int | None = None) -> bytes:
    """The header a slot holding ``payload`` as block ``key`` (child of ``parent``) starts with;
    ``payload_xxh3``, when given, is the payload's XXH3-64, computed by the caller."""
    if payload_xxh3 is None:
        payload_xxh3 = xxhash.xxh3_64_intdigest(payload)
    checked = _pack_prefix(key, parent, len(payload)) + struct.pack("<Q", payload_xxh3)
    return checked + struct.pack("<I", zlib.crc32(checked))


def holds_block(
    header: bytes | bytearray, key: BlockKey, parent: BlockKey | None, payload: memoryview
) -> bool:
    """True when ``header`` (``HEADER_BYTES`` long) is the one ``pack_header`` writes for this
    block, its checksums aside, with a sound header checksum, and ``payload`` matches its XXH3."""
    expected = _pack_prefix(key, parent, len(payload))
    payload_xxh3, header_crc = _CHECKSUMS.unpack_from(header, _PREFIX.size)
    return (
        header.startswith(expected)
        and zlib.crc32(header[:_CHECKED_HEADER_BYTES]) == header_crc
        and xxhash.xxh3_64_intdigest(payload) == payload_xxh3
    )


def parse_header(
    raw: bytes | bytearray, block_bytes: int
) -> tuple[BlockKey, BlockKey | None] | None:
    """(key, parent) of a sound header, else None."""
    if len(raw) != HEADER_BYTES:
        return None
    magic, version, flags, key, parent, payload_len, _, header_crc = _HEADER.unpack(raw)
    if zlib.crc32(memoryview(raw)[:_CHECKED_HEADER_BYTES]) != header_crc:
        return None
    if (magic, version, payload_len) != (MAGIC, FORMAT_VERSION, block_bytes):
        return None
    return BlockKey(key), BlockKey(parent) if flags & _FLAG_HAS_PARENT else None


def sound_headers(
    fd: int, file_bytes: int, block_bytes: int
) -> Iterator[tuple[int, BlockKey, BlockKey | None]]:
    """(slot, key, parent) of every slot of the file whose header is sound, in slot order."""
    slot_bytes = slot_bytes_for(block_bytes)
    for slot in _written_slots(fd, file_bytes, slot_bytes):
        try:
            raw = os.pread(fd, HEADER_BYTES, slot * slot_bytes)
        except OSError:
            continue
        parsed = parse_header(raw, block_bytes)
        if parsed is not None:
            yield slot, *parsed


def find_block(directory: Path, key: BlockKey, block_bytes: int) -> tuple[Path, int] | None:
    """Where the tier in ``directory`` keeps ``key``'s header (file, byte offset), found by
    reading slot headers: for tests and tools outside the process that owns the tier. None when
    no slot holds a sound header for ``key``."""
    path = Path(directory) / SLOT_FILE_NAME
    fd = os.open(path, os.O_RDONLY)
    try:
        for slot, stored_key, _ in sound_headers(fd, os.fstat(fd).st_size, block_bytes):
            if stored_key == key:
                return path, slot * slot_bytes_for(block_bytes)
    finally:
        os.close(fd)
    return None


def _written_slots(fd: int, file_bytes: int, slot_bytes: int) -> Iterator[int]:
    """Slots overlapping the data (not the holes) of a sparse file, in order: a slot that was
    never written reads as zeros and holds no block. Every slot if the file system cannot tell."""
    num_slots = -(-file_bytes // slot_bytes)  # a partial last slot counts
    next_slot = offset = 0
    while offset < file_bytes:
        try:
            data_start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: no data after offset
                yield from range(next_slot, num_slots)
            return
        data_end = os.lseek(fd, data_start, os.SEEK_HOLE)
        end_slot = min(num_slots, -(-data_end // slot_bytes))
        yield from range(max(next_slot, data_start // slot_bytes), end_slot)
        next_slot = max(next_slot, end_slot)
        offset = data_end


def _pack_prefix(key: BlockKey, parent: BlockKey | None, payload_bytes: int) -> bytes:
    """The header up to its checksums."""
    flags = _FLAG_HAS_PARENT if parent is not None else 0
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, key, parent or _NO_PARENT, payload_bytes)
