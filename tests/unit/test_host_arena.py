"""The shared-memory arena: two mappings of one file see each other's writes."""

from __future__ import annotations

import os

import pytest
import torch

from kvstore.host_arena import HostArena
from kvstore.node import _remove_stale_arenas


def test_writer_and_reader_mappings_share_bytes(tmp_path):
    path = tmp_path / "a.arena"
    owner = HostArena(path, slot_bytes=64, num_slots=4, create=True)
    reader = HostArena(path, slot_bytes=64, num_slots=4, create=False)
    owner.slot(2).copy_(torch.arange(64, dtype=torch.uint8))
    assert torch.equal(reader.slot(2), torch.arange(64, dtype=torch.uint8))
    assert int(reader.slot(1).sum()) == 0
    reader.close()
    owner.close()
    owner.unlink()
    assert not path.exists()


def test_opening_with_the_wrong_geometry_is_refused(tmp_path):
    path = tmp_path / "a.arena"
    HostArena(path, slot_bytes=64, num_slots=4, create=True).close()
    with pytest.raises(ValueError, match="holds 256 bytes, expected 512"):
        HostArena(path, slot_bytes=128, num_slots=4, create=False)


def test_stale_arenas_of_dead_processes_are_removed(tmp_path):
    alive = tmp_path / f"baton-c-node0-{os.getpid()}.arena"
    dead = tmp_path / "baton-c-node0-999999999.arena"
    other = tmp_path / "baton-other-node0-999999999.arena"
    for p in (alive, dead, other):
        p.write_bytes(b"x")
    _remove_stale_arenas(tmp_path, "baton-c-node0-")
    assert alive.exists() and not dead.exists() and other.exists()
