"""Hypothesis drives random put/get/pin/unpin/evict sequences through a ``BlockStore`` and the
arena bytes it hands out, against a model of what was written.

After every step: capacity is never exceeded, no pinned block has been evicted, no ancestor of a
held block has been evicted, and every READY block's slot holds exactly the bytes that were put
(so every get returns them). Writes may stay open (WRITING) across steps, so readers and
evictions also meet half-written chains."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvstore.block_store import BlockState, BlockStore
from kvstore.keys import BlockKey

SLOT_BYTES = 32
NUM_TREE_NODES = 14


def key_of(node: int) -> BlockKey:
    return BlockKey(node.to_bytes(16, "little"))


class BlockStoreMachine(RuleBasedStateMachine):
    """A random tree of blocks (node i's parent is some j < i); a chain is a root-to-node path."""

    held = Bundle("held")  # key lists a reader has acquired and not yet released
    writes = Bundle("writes")  # reserved chains not yet committed or aborted

    @initialize(
        capacity=st.integers(1, 8),
        parents=st.lists(st.integers(0, NUM_TREE_NODES), min_size=NUM_TREE_NODES,
                         max_size=NUM_TREE_NODES),
    )
    def setup(self, capacity: int, parents: list[int]) -> None:
        # parents[i] >= i means "a root"; otherwise node i hangs under node parents[i]
        self.parent = {i: (p if p < i else None) for i, p in enumerate(parents)}
        self.arena = np.zeros((capacity, SLOT_BYTES), dtype=np.uint8)
        self.store = BlockStore(capacity, on_evict=self.on_evict)
        self.capacity = capacity
        self.expected: dict[BlockKey, bytes] = {}  # READY blocks: the bytes their writer put
        self.pins: Counter[BlockKey] = Counter()  # readers' and writers' pins, from the outside
        self.version = 0
        self.evicted_total = 0

    def chain(self, node: int) -> list[BlockKey]:
        path = []
        while node is not None:
            path.append(key_of(node))
            node = self.parent[node]
        return path[::-1]

    def on_evict(self, key: BlockKey, parent: BlockKey | None, slot: int) -> None:
        assert self.pins[key] == 0, "a pinned block is being evicted"
        info = self.store.block_info(key)
        assert info.num_children == 0, "an ancestor is being evicted before its descendants"
        assert bytes(self.arena[slot]) == self.expected[key], "the evicted slot lost its bytes"
        del self.expected[key]
        self.evicted_total += 1

    # -- writes ---------------------------------------------------------------------------------

    @rule(target=writes, node=st.integers(0, NUM_TREE_NODES - 1))
    def begin_put(self, node: int):
        keys = self.chain(node)
        parents = [None, *keys[:-1]]
        result = self.store.reserve(keys, parents)
        reserved = []
        for key, slot in zip(keys, result.slots):
            if slot is None:
                continue
            self.version += 1
            payload = np.random.default_rng(self.version).integers(0, 256, SLOT_BYTES,
                                                                     dtype=np.uint8)
            self.arena[slot] = payload
            reserved.append((key, payload.tobytes()))
            self.pins[key] += 1
        return reserved

    @rule(write=consumes(writes), commit=st.booleans())
    def finish_put(self, write, commit: bool):
        keys = [key for key, _ in write]
        for key in keys:
            self.pins[key] -= 1
        if commit:
            self.store.commit(keys)
            self.expected.update(write)
        else:
            self.store.abort(keys)

    # -- reads ----------------------------------------------------------------------------------

    @rule(target=held, node=st.integers(0, NUM_TREE_NODES - 1))
    def acquire(self, node: int):
        keys = self.chain(node)
        slots = self.store.acquire(keys)
        got = keys[: len(slots)]
        for key, slot in zip(got, slots):
            assert bytes(self.arena[slot]) == self.expected[key], "a get returned other bytes"
            self.pins[key] += 1
        # the run stops at the first key that is not READY
        if len(slots) < len(keys):
            info = self.store.block_info(keys[len(slots)])
            assert info is None or info.state is BlockState.WRITING
        return got

    @rule(keys=consumes(held))
    def release(self, keys):
        self.store.release(keys)
        for key in keys:
            self.pins[key] -= 1

    @rule(num_blocks=st.integers(0, 10))
    def evict(self, num_blocks: int):
        before = self.evicted_total
        evicted = self.store.evict(num_blocks)
        assert len(evicted) == self.evicted_total - before <= num_blocks
        if len(evicted) < num_blocks:
            assert self.store.stats().evictable_blocks == 0, "stopped with blocks still evictable"

    @rule(node=st.integers(0, NUM_TREE_NODES - 1), soft=st.booleans())
    def soft_pin(self, node: int, soft: bool):
        keys = self.chain(node)
        (self.store.soft_pin_prefix if soft else self.store.soft_unpin_prefix)(keys)

    # -- what must always hold ------------------------------------------------------------------

    @invariant()
    def store_invariants(self) -> None:
        if not hasattr(self, "store"):
            return
        self.store.check_invariants()
        stats = self.store.stats()
        assert stats.used_blocks <= self.capacity
        for key, count in self.pins.items():
            if count == 0:
                continue
            info = self.store.block_info(key)
            assert info is not None and info.refcount == count, "a pinned block was evicted"
            ancestor = info.parent
            while ancestor is not None:  # no ancestor of a held block is gone
                ancestor_info = self.store.block_info(ancestor)
                assert ancestor_info is not None, "an ancestor of a held block was evicted"
                ancestor = ancestor_info.parent
        for key, payload in self.expected.items():
            info = self.store.block_info(key)
            assert info is not None and info.state is BlockState.READY
            assert bytes(self.arena[info.slot]) == payload, "a READY slot changed under its block"
        ready = {k for k in self.expected}
        assert stats.ready_blocks == len(ready)


BlockStoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                               deadline=None)
TestBlockStoreProperties = BlockStoreMachine.TestCase
