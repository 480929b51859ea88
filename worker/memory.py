"""Where an engine worker's resident memory goes, read from inside its process: the KV cache's
resident pages (``/proc/self/pagemap`` over the cache tensors' address ranges), what glibc's
allocator holds (``mallinfo2``: in use, free but kept, mapped), Python's live allocations, and
what vLLM's scheduler holds (requests, cached blocks). A soak samples it (``baton bench soak``)
to tell a heap that keeps growing from memory the live data explains.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import msgspec

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63
_SWAPPED = 1 << 62


class EngineMemory(msgspec.Struct, frozen=True):
    """One engine worker's memory, by where it goes (MB unless named otherwise)."""

    rss_mb: float
    kv_cache_mb: float
    """The engine's KV cache tensors' size."""
    kv_cache_resident_mb: float
    """Of those, pages resident (or swapped): touched at least once."""
    malloc_in_use_mb: float
    """glibc heap in use (``uordblks`` + ``hblkhd``: every live ``malloc``, including the
    tensors torch allocates, the KV cache among them)."""
    malloc_free_mb: float
    """Freed by the program but kept by glibc's arenas (``fordblks``): fragmentation or reuse."""
    python_objects: int
    """Objects the garbage collector tracks."""
    python_blocks: int
    """Blocks Python's allocator has handed out (``sys.getallocatedblocks``)."""


def resident_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes of the ``(address, nbytes)`` ranges whose pages are resident or swapped, from this
    process's page map (readable by the process itself; only the present and swapped bits are
    used)."""
    total = 0
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for address, nbytes in _merged(spans):
            first, last = address // PAGE_BYTES, (address + nbytes - 1) // PAGE_BYTES
            count = last - first + 1
            raw = os.pread(pagemap.fileno(), count * 8, first * 8)
            entries = memoryview(raw).cast("Q")
            total += sum(1 for e in entries if e & (_PRESENT | _SWAPPED)) * PAGE_BYTES
    return total


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges, overlapping ones (views of one storage) merged."""
    out: list[list[int]] = []
    for start, nbytes in sorted(s for s in spans if s[1] > 0):
        end = start + nbytes
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end - start) for start, end in out]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_stats() -> tuple[int, int]:
    """(bytes in use, bytes free but kept) by glibc's allocator over all its arenas; (0, 0)
    where there is no ``mallinfo2`` (not glibc, or glibc before 2.33)."""
    try:
        libc = ctypes.CDLL(None)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return 0, 0
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def engine_memory(kv_spans: list[tuple[int, int]]) -> EngineMemory:
    """This process's ``EngineMemory``, its KV cache given as ``(address, nbytes)`` ranges."""
    mb = 1 / 2**20
    in_use, free = malloc_stats()
    with open("/proc/self/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    return EngineMemory(
        rss_mb=round(rss_pages * PAGE_BYTES * mb, 1),
        kv_cache_mb=round(sum(n for _, n in _merged(kv_spans)) * mb, 1),
        kv_cache_resident_mb=round(resident_bytes(kv_spans) * mb, 1),
        malloc_in_use_mb=round(in_use * mb, 1),
        malloc_free_mb=round(free * mb, 1),
        python_objects=len(gc.get_objects()),
        python_blocks=sys.getallocatedblocks(),
    )
