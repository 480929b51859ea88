"""The host (DRAM) tier's memory: a fixed array of block slots in a shared-memory file.

One arena per node. The node's store actor owns the slot bookkeeping (``BlockStore``); every
worker on the node maps the same file and copies KV straight in and out of its slots, so a block
written by a prefill engine is read by a decode engine on the same node without any copy through
Ray or a socket.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch


class HostArena:
    """``num_slots`` slots of ``slot_bytes`` each, backed by a file in ``/dev/shm``.

    ``create=True`` makes (or resizes) the file; workers open it with ``create=False``.
    """

    def __init__(self, path: str | Path, slot_bytes: int, num_slots: int, create: bool) -> None:
        assert slot_bytes > 0 and num_slots > 0
        self.path = Path(path)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        size_bytes = slot_bytes * num_slots
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size_bytes)
            actual = os.fstat(fd).st_size
            if actual != size_bytes:
                raise ValueError(
                    f"arena {self.path} holds {actual} bytes, expected {size_bytes} "
                    f"({num_slots} slots of {slot_bytes} bytes): is another cluster using it?"
                )
            self._mmap = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        self.slots = torch.frombuffer(self._mmap, dtype=torch.uint8).view(num_slots, slot_bytes)

    def slot(self, slot_id: int) -> torch.Tensor:
        """The bytes of one slot, as a writable uint8 view (no copy)."""
        return self.slots[slot_id]

    def close(self) -> None:
        self.slots = None  # drop the tensor's reference to the buffer before closing
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def default_arena_path(cluster_name: str, node_id: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"baton-{cluster_name}-{node_id}.arena"
