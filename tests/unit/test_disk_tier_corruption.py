"""Disk-tier corruption, byte by byte: flipping any bits anywhere in a block's slot is detected on
every read, counted once per corrupt read, and returns a miss; the freed slot takes the next block;
an intact neighbour still reads back exactly."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.disk_tier import HEADER_BYTES, DiskTier, find_block
from kvstore.keys import BlockKey

BLOCK_BYTES = 4096
FILE_BYTES = HEADER_BYTES + BLOCK_BYTES


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


flips = st.lists(
    st.tuples(st.integers(0, FILE_BYTES - 1), st.integers(1, 255)), min_size=1, max_size=4,
    unique_by=lambda flip: flip[0],
)


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(flips, min_size=1, max_size=5), read_into=st.booleans())
def test_every_corrupt_read_is_a_counted_miss(rounds, read_into):
    with tempfile.TemporaryDirectory() as folder, DiskTier(
        Path(folder), 64 * FILE_BYTES, BLOCK_BYTES
    ) as tier:
        neighbour = BlockKey(bytes(16))
        assert tier.put(neighbour, None, payload(0))
        for round_index, flipped in enumerate(rounds, start=1):
            key = BlockKey(round_index.to_bytes(16, "little"))
            assert tier.put(key, neighbour, payload(round_index))
            path, offset = tier.block_location(key)
            assert offset == FILE_BYTES, "the slot freed by the last round is taken again"
            with open(path, "r+b") as f:
                f.seek(offset)
                raw = bytearray(f.read(FILE_BYTES))
                for at, mask in flipped:
                    raw[at] ^= mask
                f.seek(offset)
                f.write(raw)

            if read_into:
                out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
                assert tier.get_into(key, out) is False
            else:
                assert tier.get(key) is None
            stats = tier.stats()
            assert stats.corrupt_blocks == round_index, "each corrupt read is counted once"
            assert key not in tier and find_block(Path(folder), key, BLOCK_BYTES) is None
            assert tier.get(key) is None and tier.stats().corrupt_blocks == round_index

            out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
            assert tier.get_into(neighbour, out) and np.array_equal(out, payload(0))
        tier.check_invariants()
