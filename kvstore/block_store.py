"""The bookkeeping of one store node's host tier: which block lives in which arena slot.

Pure mechanism, no I/O: the owning actor moves bytes in and out of the slots this class hands
out, and publishes the keys it reports as stored or evicted. Everything is single-threaded.

Lifecycle of a block::

    reserve ──> WRITING ──commit──> READY ──(unpinned leaf, LRU)──> evicted
                   └──────abort───> gone

Invariants (``check_invariants`` asserts all of them):

- every present block's parent is present, and a READY block's parent is READY, so a chain is
  always stored from its root and readers only ever see whole prefixes;
- a WRITING block is pinned exactly once, by its writer, and only READY blocks are acquired;
- a block is evictable iff it is READY, unpinned and has no present children ("LRU over leaves"):
  a shared ancestor goes only after all of its descendants, so the trunk outlives the twigs;
- evictable blocks go in order of ``eviction_priority``, by class and least recently used first
  within a class: plain blocks, then leased blocks (a live lease names them:
  ``kvstore.leases``), then blocks soft-pinned by an operator (soft pins rank above leases).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from kvstore.keys import BlockKey

_HEAP_SLACK_ENTRIES = 1024
"""Stale heap entries tolerated beyond twice the evictable count before the heap is rebuilt."""


class BlockState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


class ReserveResult(msgspec.Struct, frozen=True):
    """Answer to ``reserve``.

    ``slots[i]`` is the arena slot to write ``keys[i]`` into, or ``None`` when there is nothing to
    write (already present) or no room (this key and every later one). ``evicted`` lists the keys
    dropped to make room, in eviction order, for the owner to publish as removed.
    """

    slots: list[int | None]
    evicted: list[BlockKey]


class BlockInfo(msgspec.Struct, frozen=True):
    """A snapshot of one block's bookkeeping (for the owner's diagnostics and for tests)."""

    key: BlockKey
    parent: BlockKey | None
    slot: int
    state: BlockState
    refcount: int
    last_access_tick: int
    num_children: int
    soft_pinned: bool
    leased: bool = False


class StoreStats(msgspec.Struct, frozen=True):
    """Occupancy gauges (in blocks) and monotonic counters since construction."""

    capacity_blocks: int
    used_blocks: int
    free_blocks: int
    ready_blocks: int
    writing_blocks: int
    pinned_blocks: int
    soft_pinned_blocks: int
    evictable_blocks: int
    acquire_queries_blocks: int
    acquire_hits_blocks: int
    evicted_blocks: int
    reserve_rejected_blocks: int
    leased_blocks: int = 0
    """Blocks a live lease names, now (a level)."""
    evicted_leased_blocks: int = 0
    """Leased blocks evicted anyway: nothing plain was evictable (demoted, where a disk tier
    takes them)."""


@dataclass(slots=True)
class _Block:
    key: BlockKey
    parent: BlockKey | None
    slot: int
    state: BlockState
    refcount: int
    last_access_tick: int
    num_children: int = 0
    soft_pinned: bool = False
    leased: bool = False


PLAIN, LEASED, SOFT_PINNED = 0, 1, 2
"""Eviction classes, first to go first."""


def eviction_class(soft_pinned: bool, leased: bool) -> int:
    """Soft pins rank above leases, leases above plain LRU blocks (shared with the disk tier)."""
    return SOFT_PINNED if soft_pinned else LEASED if leased else PLAIN


def eviction_priority(block: _Block) -> tuple[int, int]:
    """The eviction policy: smallest goes first. The class (``eviction_class``), then LRU within.

    Computed when a block becomes evictable; it must not change while the block stays evictable
    (the store re-files a block whenever its tick, soft pin or lease changes).
    """
    return (eviction_class(block.soft_pinned, block.leased), block.last_access_tick)


class BlockStore:
    """Slots ``0 .. capacity_blocks-1`` of a fixed arena, with pins, two-phase writes and leaf-LRU.

    All operations cost O(log n) per key (a lazily invalidated heap orders the evictable blocks;
    stale entries are compacted once they outnumber live ones), so millions of blocks stay cheap.
    """

    def __init__(
        self,
        capacity_blocks: int,
        on_evict: "Callable[[BlockKey, BlockKey | None, int], None] | None" = None,
    ) -> None:
        """``on_evict(key, parent, slot)`` runs just before a block is evicted, while its slot
        still holds its bytes: the owner's chance to demote it to a lower tier."""
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._on_evict = on_evict
        self._blocks: dict[BlockKey, _Block] = {}
        # A stack whose pop() hands out slot 0 first, so tests can pin exact slot ids.
        self._free_slots: list[int] = list(range(capacity_blocks - 1, -1, -1))
        self._evictable: dict[BlockKey, int] = {}  # key -> seq of its one live heap entry
        self._heap: list[tuple[int, int, int, BlockKey]] = []  # (class, tick, seq, key)
        self._seq = itertools.count()
        self._tick = 0
        self._num_writing = 0
        self._num_pinned = 0
        self._num_soft_pinned = 0
        self._num_leased = 0
        self._evicted_leased_blocks = 0
        self._acquire_queries_blocks = 0
        self._acquire_hits_blocks = 0
        self._evicted_blocks = 0
        self._reserve_rejected_blocks = 0

    # -- two-phase write -------------------------------------------------------------------------

    def reserve(
        self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]
    ) -> ReserveResult:
        """Step 1 of a write: allocate slots for the keys not yet present.

        ``parents[i]`` is the parent of ``keys[i]`` (``None`` for the first block of a chain);
        normally ``parents[i] == keys[i-1]`` for ``i > 0``. A new key is inserted WRITING, pinned
        once by the writer, who must later ``commit`` or ``abort`` it. A present key (READY or
        WRITING) gets ``None``: nothing to write.

        The chain stops (this key and every later one get ``None``) at the first new key that
        cannot be stored: its parent is absent, its parent is still being written by another
        writer (an abort there would orphan it), or no slot can be freed. So a child is never
        stored without its parent. Eviction never touches the keys of this call.
        """
        assert len(keys) == len(parents), "reserve needs one parent per key"
        slots: list[int | None] = [None] * len(keys)
        evicted: list[BlockKey] = []
        reserved_here: set[BlockKey] = set()
        guarded: list[_Block] = []  # present keys and parents of this call, pinned until we return
        for i, (key, parent) in enumerate(zip(keys, parents)):
            block = self._blocks.get(key)
            if block is not None:
                self._pin(block)
                guarded.append(block)
                continue
            parent_block = self._blocks.get(parent) if parent is not None else None
            parent_usable = parent is None or (
                parent_block is not None
                and (parent_block.state is BlockState.READY or parent in reserved_here)
            )
            if parent_usable and parent_block is not None:
                self._pin(parent_block)  # the parent may be a leaf outside ``keys``
                guarded.append(parent_block)
            slot = self._allocate_slot(evicted) if parent_usable else None
            if slot is None:
                self._reserve_rejected_blocks += sum(k not in self._blocks for k in keys[i:])
                break
            self._insert_writing(key, parent, slot)
            reserved_here.add(key)
            slots[i] = slot
        for block in guarded:
            self._unpin(block)
        return ReserveResult(slots=slots, evicted=evicted)

    def commit(self, keys: Sequence[BlockKey]) -> None:
        """Step 2 of a write: WRITING -> READY, dropping the writer's pin.

        Commit in chain order: a key's parent must already be READY (or be committed earlier in
        the same call). The block counts as freshly used.
        """
        for key in keys:
            block = self._blocks.get(key)
            assert block is not None and block.state is BlockState.WRITING, (
                f"commit of a block not being written: {key.hex()}"
            )
            assert block.parent is None or self._blocks[block.parent].state is BlockState.READY, (
                f"commit of {key.hex()} before its parent"
            )
            block.state = BlockState.READY
            self._num_writing -= 1
            block.last_access_tick = self._next_tick()
            self._unpin(block)

    def abort(self, keys: Sequence[BlockKey]) -> None:
        """Undo ``reserve`` for WRITING keys: remove them and free their slots.

        A block's reserved descendants must be aborted in the same call (or before); keys are
        processed deepest first, so passing a chain in order is enough.
        """
        for key in reversed(keys):
            block = self._blocks.get(key)
            assert block is not None and block.state is BlockState.WRITING, (
                f"abort of a block not being written: {key.hex()}"
            )
            assert block.num_children == 0, f"abort of {key.hex()} would orphan its children"
            self._unpin(block)
            self._num_writing -= 1
            self._remove(block)

    # -- reads -----------------------------------------------------------------------------------

    def match_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading keys that are READY. No pin, no LRU touch, no counters."""
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None or block.state is not BlockState.READY:
                return i
        return len(keys)

    def acquire(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pin the leading READY prefix of ``keys`` and return its slots, in order.

        Each pinned block gets a fresh tick, increasing along ``keys``, so a deeper block is more
        recent than its ancestors. Counts ``len(keys)`` queries and the prefix length as hits.
        Every acquired key must be ``release``d exactly once.
        """
        num_hits = self.match_prefix(keys)
        self._acquire_queries_blocks += len(keys)
        self._acquire_hits_blocks += num_hits
        slots: list[int] = []
        for key in keys[:num_hits]:
            block = self._blocks[key]
            self._pin(block)
            block.last_access_tick = self._next_tick()
            slots.append(block.slot)
        return slots

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Unpin keys returned by ``acquire``. Releasing an unpinned key is a bug (assertion)."""
        for key in keys:
            block = self._blocks.get(key)
            assert block is not None and block.state is BlockState.READY, (
                f"release of a block not acquired: {key.hex()}"
            )
            assert block.refcount > 0, f"release of an unpinned block: {key.hex()}"
            self._unpin(block)

    # -- operator pins and explicit eviction ---------------------------------------------------

    def soft_pin_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Mark the leading present keys as operator-pinned; returns how many were present.

        Soft-pinned blocks are still evictable, but only when no other block is. The mark is a
        flag, not a count, and disappears with the block.
        """
        return self._set_soft_pin(keys, True)

    def soft_unpin_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Clear the operator pin of the leading present keys; returns how many were present."""
        return self._set_soft_pin(keys, False)

    def set_leased(self, keys: Sequence[BlockKey], leased: bool) -> int:
        """Mark the present ``keys`` as leased (or plain again); returns how many are present.

        Leased blocks are evicted after plain ones and before soft-pinned ones. The mark is a
        flag the owner keeps in line with its lease registry (absent keys are skipped: the
        owner marks them when they are committed); it disappears with the block, and changing
        it leaves the block's recency as it was.
        """
        num_present = 0
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                continue
            num_present += 1
            if block.leased != leased:
                block.leased = leased
                self._num_leased += 1 if leased else -1
                self._evictable.pop(key, None)  # its priority changed: file it afresh
                self._refile(block)
        return num_present

    def evict(self, num_blocks: int) -> list[BlockKey]:
        """Evict up to ``num_blocks`` blocks in eviction order; returns their keys in that order."""
        evicted: list[BlockKey] = []
        while len(evicted) < num_blocks and self._evict_one(evicted):
            pass
        return evicted

    # -- introspection ---------------------------------------------------------------------------

    def ready_keys(self) -> list[BlockKey]:
        """Every readable block's key (parents before their children)."""
        return [key for key, block in self._blocks.items() if block.state is BlockState.READY]

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def block_info(self, key: BlockKey) -> BlockInfo | None:
        block = self._blocks.get(key)
        if block is None:
            return None
        return BlockInfo(
            key=block.key,
            parent=block.parent,
            slot=block.slot,
            state=block.state,
            refcount=block.refcount,
            last_access_tick=block.last_access_tick,
            num_children=block.num_children,
            soft_pinned=block.soft_pinned,
            leased=block.leased,
        )

    def stats(self) -> StoreStats:
        used = len(self._blocks)
        return StoreStats(
            capacity_blocks=self.capacity_blocks,
            used_blocks=used,
            free_blocks=len(self._free_slots),
            ready_blocks=used - self._num_writing,
            writing_blocks=self._num_writing,
            pinned_blocks=self._num_pinned,
            soft_pinned_blocks=self._num_soft_pinned,
            evictable_blocks=len(self._evictable),
            acquire_queries_blocks=self._acquire_queries_blocks,
            acquire_hits_blocks=self._acquire_hits_blocks,
            evicted_blocks=self._evicted_blocks,
            reserve_rejected_blocks=self._reserve_rejected_blocks,
            leased_blocks=self._num_leased,
            evicted_leased_blocks=self._evicted_leased_blocks,
        )

    def check_invariants(self) -> None:
        """Assert every invariant of the module docstring; O(n), for tests."""
        blocks = self._blocks.values()
        used_slots = [b.slot for b in blocks]
        assert len(set(used_slots)) == len(used_slots), "a slot is used twice"
        assert not set(used_slots) & set(self._free_slots), "a slot is both used and free"
        assert len(set(self._free_slots)) == len(self._free_slots), "a slot is free twice"
        assert len(used_slots) + len(self._free_slots) == self.capacity_blocks, "slots leaked"
        all_slots = itertools.chain(used_slots, self._free_slots)
        assert all(0 <= s < self.capacity_blocks for s in all_slots), "slot id out of range"
        children: dict[BlockKey, int] = {}
        for b in blocks:
            assert b.refcount >= 0, f"negative refcount on {b.key.hex()}"
            if b.state is BlockState.WRITING:
                assert b.refcount == 1, f"WRITING {b.key.hex()} must be pinned once, by its writer"
            if b.parent is not None:
                parent = self._blocks.get(b.parent)
                assert parent is not None, f"{b.key.hex()} is present without its parent"
                if b.state is BlockState.READY:
                    assert parent.state is BlockState.READY, f"READY {b.key.hex()} under WRITING"
                children[b.parent] = children.get(b.parent, 0) + 1
        for b in blocks:
            assert b.num_children == children.get(b.key, 0), f"child count of {b.key.hex()} is off"
        assert self._num_writing == sum(b.state is BlockState.WRITING for b in blocks)
        assert self._num_pinned == sum(b.refcount > 0 for b in blocks)
        assert self._num_soft_pinned == sum(b.soft_pinned for b in blocks)
        assert self._num_leased == sum(b.leased for b in blocks)
        assert set(self._evictable) == {k for k, b in self._blocks.items() if _is_evictable(b)}, (
            "evictable set differs from the blocks that satisfy the rule"
        )
        live = {seq: key for (_, _, seq, key) in self._heap if self._evictable.get(key) == seq}
        assert sorted(live.values()) == sorted(self._evictable), "evictable block not in heap"
        for cls, tick, seq, key in self._heap:
            if live.get(seq) == key:
                assert (cls, tick) == eviction_priority(self._blocks[key]), "stale priority in heap"

    # -- internals -------------------------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _insert_writing(self, key: BlockKey, parent: BlockKey | None, slot: int) -> None:
        tick = self._next_tick()
        block = _Block(key, parent, slot, BlockState.WRITING, refcount=1, last_access_tick=tick)
        self._blocks[key] = block
        self._num_writing += 1
        self._num_pinned += 1
        if parent is not None:
            parent_block = self._blocks[parent]
            parent_block.num_children += 1
            self._refile(parent_block)

    def _remove(self, block: _Block) -> None:
        """Drop an unpinned, childless block and free its slot; its parent may become a leaf."""
        assert block.refcount == 0 and block.num_children == 0
        del self._blocks[block.key]
        self._evictable.pop(block.key, None)
        self._free_slots.append(block.slot)
        if block.soft_pinned:
            self._num_soft_pinned -= 1
        if block.leased:
            self._num_leased -= 1
        if block.parent is not None:
            parent = self._blocks[block.parent]
            parent.num_children -= 1
            self._refile(parent)

    def _allocate_slot(self, evicted: list[BlockKey]) -> int | None:
        if not self._free_slots and not self._evict_one(evicted):
            return None
        return self._free_slots.pop()

    def _evict_one(self, evicted: list[BlockKey]) -> bool:
        """Evict the first block in eviction order, appending its key; False if none can go."""
        while self._heap:
            _, _, seq, key = heapq.heappop(self._heap)
            if self._evictable.get(key) == seq:
                block = self._blocks[key]
                if self._on_evict is not None:
                    self._on_evict(key, block.parent, block.slot)
                self._evicted_leased_blocks += block.leased
                self._remove(block)
                self._evicted_blocks += 1
                evicted.append(key)
                return True
        return False

    def _pin(self, block: _Block) -> None:
        block.refcount += 1
        if block.refcount == 1:
            self._num_pinned += 1
            self._refile(block)

    def _unpin(self, block: _Block) -> None:
        assert block.refcount > 0
        block.refcount -= 1
        if block.refcount == 0:
            self._num_pinned -= 1
            self._refile(block)

    def _set_soft_pin(self, keys: Sequence[BlockKey], soft_pinned: bool) -> int:
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None:
                return i
            if block.soft_pinned != soft_pinned:
                block.soft_pinned = soft_pinned
                self._num_soft_pinned += 1 if soft_pinned else -1
                self._evictable.pop(key, None)  # its priority changed: file it afresh
                self._refile(block)
        return len(keys)

    def _refile(self, block: _Block) -> None:
        """Bring the block's membership in the evictable set in line with the rule.

        A block whose priority changes while evictable must be dropped from ``_evictable`` first.
        """
        if not _is_evictable(block):
            self._evictable.pop(block.key, None)
            return
        if block.key in self._evictable:
            return
        seq = next(self._seq)
        self._evictable[block.key] = seq
        heapq.heappush(self._heap, (*eviction_priority(block), seq, block.key))
        if len(self._heap) > 2 * len(self._evictable) + _HEAP_SLACK_ENTRIES:
            self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [
            entry for entry in self._heap if self._evictable.get(entry[3]) == entry[2]
        ]
        heapq.heapify(self._heap)


def _is_evictable(block: _Block) -> bool:
    return block.state is BlockState.READY and block.refcount == 0 and block.num_children == 0
