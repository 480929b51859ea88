"""BlockStore: slots, two-phase writes, pins and LRU-over-leaves eviction, with exact orders."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.block_store import BlockInfo, BlockState, BlockStore, ReserveResult
from kvstore.keys import BlockKey


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def keys_of(*names: str) -> list[BlockKey]:
    return [k(n) for n in names]


def chain_parents(
    keys: Sequence[BlockKey], first_parent: BlockKey | None = None
) -> list[BlockKey | None]:
    return [first_parent, *keys[:-1]]


def put(store: BlockStore, names: str, parent: str | None = None) -> ReserveResult:
    """Reserve and commit a chain given as one letter per block, e.g. ``put(s, "ABC")``."""
    keys = keys_of(*names)
    result = store.reserve(keys, chain_parents(keys, k(parent) if parent else None))
    store.commit([key for key, slot in zip(keys, result.slots) if slot is not None])
    store.check_invariants()
    return result


def info(store: BlockStore, key: BlockKey) -> BlockInfo:
    block_info = store.block_info(key)
    assert block_info is not None, f"{key!r} is not in the store"
    return block_info


def names(keys: Sequence[BlockKey]) -> list[str]:
    return [key.rstrip(b".").decode() for key in keys]


# -- eviction order ----------------------------------------------------------------------------


def test_leaves_go_first_by_lru_and_the_trunk_last() -> None:
    store = BlockStore(capacity_blocks=8)
    put(store, "ABC")
    put(store, "D", parent="B")  # A-B-C and A-B-D; C is the older leaf
    assert names(store.evict(10)) == ["C", "D", "B", "A"]
    store.check_invariants()
    assert len(store) == 0 and store.stats().free_blocks == 8


def test_acquire_makes_a_leaf_recent() -> None:
    store = BlockStore(capacity_blocks=8)
    put(store, "ABC")
    put(store, "D", parent="B")
    store.release(keys_of("A", "B", "C")[: len(store.acquire(keys_of("A", "B", "C")))])
    assert names(store.evict(10)) == ["D", "C", "B", "A"]


def test_full_store_evicts_twigs_not_the_shared_trunk() -> None:
    store = BlockStore(capacity_blocks=5)
    put(store, "SPx")  # system prompt S-P, twig x
    put(store, "y", parent="P")
    put(store, "z", parent="P")  # full: S P x y z
    result = put(store, "w", parent="P")
    assert names(result.evicted) == ["x"]
    result = put(store, "v", parent="P")
    assert names(result.evicted) == ["y"]
    assert {"S", "P", "z", "w", "v"} == {n for n in "SPxyzwv" if k(n) in store}


def test_evict_returns_fewer_when_not_enough_is_evictable() -> None:
    store = BlockStore(capacity_blocks=4)
    put(store, "AB")
    assert store.acquire(keys_of("A")) == [0]
    assert names(store.evict(5)) == ["B"]
    assert store.evict(5) == []
    store.release(keys_of("A"))
    assert names(store.evict(5)) == ["A"]
    assert store.stats().evicted_blocks == 2


# -- pins ----------------------------------------------------------------------------------------


def test_pinned_blocks_are_never_evicted() -> None:
    store = BlockStore(capacity_blocks=8)
    put(store, "ABC")
    put(store, "D", parent="B")
    assert store.acquire(keys_of("A", "B", "C")) == [0, 1, 2]
    assert names(store.evict(10)) == ["D"]
    store.release(keys_of("A", "B", "C"))
    assert names(store.evict(10)) == ["C", "B", "A"]


def test_pins_count() -> None:
    store = BlockStore(capacity_blocks=2)
    put(store, "A")
    store.acquire(keys_of("A"))
    store.acquire(keys_of("A"))
    store.release(keys_of("A"))
    assert store.evict(1) == []
    store.release(keys_of("A"))
    assert names(store.evict(1)) == ["A"]


def test_releasing_an_unpinned_block_is_a_bug() -> None:
    store = BlockStore(capacity_blocks=2)
    put(store, "A")
    with pytest.raises(AssertionError, match="unpinned"):
        store.release(keys_of("A"))


def test_reserve_gets_none_when_everything_is_pinned() -> None:
    store = BlockStore(capacity_blocks=2)
    put(store, "AB")
    store.acquire(keys_of("A", "B"))
    result = store.reserve(keys_of("X", "Y"), [None, k("X")])
    assert result == ReserveResult(slots=[None, None], evicted=[])
    assert store.stats().reserve_rejected_blocks == 2
    store.check_invariants()


def test_reserve_gets_none_when_everything_is_being_written() -> None:
    store = BlockStore(capacity_blocks=2)
    assert store.reserve(keys_of("A", "B"), [None, k("A")]).slots == [0, 1]
    assert store.reserve(keys_of("X"), [None]).slots == [None]


def test_chain_stops_at_the_first_block_it_cannot_store() -> None:
    store = BlockStore(capacity_blocks=3)
    put(store, "AB")
    store.acquire(keys_of("A", "B"))
    result = store.reserve(keys_of("X", "Y"), [None, k("X")])
    assert result.slots == [2, None]
    store.abort(keys_of("X"))
    store.check_invariants()


def test_reserve_never_evicts_its_own_chain() -> None:
    store = BlockStore(capacity_blocks=2)
    put(store, "A")
    put(store, "Z")  # A is the LRU leaf, but B needs it
    result = store.reserve(keys_of("A", "B"), [None, k("A")])
    assert result.slots == [None, 1] and names(result.evicted) == ["Z"]
    store.commit(keys_of("B"))
    store.check_invariants()


def test_reserve_never_evicts_the_parent_given_outside_keys() -> None:
    store = BlockStore(capacity_blocks=2)
    put(store, "A")
    put(store, "Z")
    result = store.reserve(keys_of("B"), [k("A")])
    assert result.slots == [1] and names(result.evicted) == ["Z"]


def test_reserve_never_evicts_a_present_key_of_the_call_even_off_chain() -> None:
    store = BlockStore(capacity_blocks=2)
    put(store, "A")
    put(store, "Z")
    result = store.reserve(keys_of("A", "X"), [None, None])  # two roots: A is no parent of X
    assert result.slots == [None, 1] and names(result.evicted) == ["Z"]


def test_a_lone_leaf_cannot_be_evicted_for_its_own_child() -> None:
    store = BlockStore(capacity_blocks=1)
    put(store, "A")
    result = store.reserve(keys_of("A", "B"), [None, k("A")])
    assert result == ReserveResult(slots=[None, None], evicted=[])
    assert k("A") in store
    store.check_invariants()


def test_a_child_is_never_stored_without_its_parent() -> None:
    store = BlockStore(capacity_blocks=4)
    assert store.reserve(keys_of("B", "C"), [k("A"), k("B")]).slots == [None, None]
    assert len(store) == 0


# -- two-phase write -----------------------------------------------------------------------------


def test_writing_blocks_are_invisible_until_commit() -> None:
    store = BlockStore(capacity_blocks=4)
    keys = keys_of("A", "B")
    assert store.reserve(keys, chain_parents(keys)).slots == [0, 1]
    assert store.match_prefix(keys) == 0
    assert store.acquire(keys) == []
    assert store.reserve(keys, chain_parents(keys)).slots == [None, None]  # being written: skip
    assert store.evict(4) == []
    store.commit(keys_of("A"))
    assert store.match_prefix(keys) == 1
    store.commit(keys_of("B"))
    assert store.match_prefix(keys) == 2
    b = info(store, k("B"))
    assert b.state is BlockState.READY and b.refcount == 0
    stats = store.stats()
    assert (stats.acquire_queries_blocks, stats.acquire_hits_blocks) == (2, 0)
    store.check_invariants()


def test_another_writers_block_stops_the_chain() -> None:
    """A child under a block someone else is still writing would be orphaned by their abort."""
    store = BlockStore(capacity_blocks=4)
    store.reserve(keys_of("A"), [None])
    assert store.reserve(keys_of("A", "B"), [None, k("A")]).slots == [None, None]
    store.commit(keys_of("A"))
    assert store.reserve(keys_of("A", "B"), [None, k("A")]).slots == [None, 1]


def test_abort_frees_the_slots() -> None:
    store = BlockStore(capacity_blocks=2)
    keys = keys_of("A", "B")
    store.reserve(keys, chain_parents(keys))
    store.abort(keys)
    store.check_invariants()
    assert len(store) == 0 and store.stats().free_blocks == 2 and store.stats().pinned_blocks == 0
    assert store.reserve(keys_of("X", "Y"), [None, k("X")]).slots == [0, 1]


def test_abort_of_a_parent_without_its_children_is_a_bug() -> None:
    store = BlockStore(capacity_blocks=2)
    keys = keys_of("A", "B")
    store.reserve(keys, chain_parents(keys))
    with pytest.raises(AssertionError, match="orphan"):
        store.abort(keys_of("A"))


def test_commit_before_the_parent_is_a_bug() -> None:
    store = BlockStore(capacity_blocks=2)
    keys = keys_of("A", "B")
    store.reserve(keys, chain_parents(keys))
    with pytest.raises(AssertionError, match="before its parent"):
        store.commit(keys_of("B"))


# -- reads and counters --------------------------------------------------------------------------


def test_match_and_acquire_stop_at_the_first_miss() -> None:
    store = BlockStore(capacity_blocks=8)
    put(store, "ABC")
    query = keys_of("A", "B", "X", "C")
    assert store.match_prefix(query) == 2
    assert store.stats().acquire_queries_blocks == 0  # match_prefix counts nothing
    assert store.acquire(query) == [0, 1]
    stats = store.stats()
    assert (stats.acquire_queries_blocks, stats.acquire_hits_blocks) == (4, 2)
    assert stats.pinned_blocks == 2 and stats.ready_blocks == 3 and stats.used_blocks == 3


def test_acquire_gives_increasing_ticks_along_the_chain() -> None:
    store = BlockStore(capacity_blocks=8)
    put(store, "ABC")
    store.acquire(keys_of("A", "B", "C"))
    ticks = [info(store, key).last_access_tick for key in keys_of("A", "B", "C")]
    assert ticks == sorted(ticks) and len(set(ticks)) == 3


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        BlockStore(capacity_blocks=0)


# -- soft pins -----------------------------------------------------------------------------------


def test_soft_pinned_blocks_go_only_when_nothing_else_can() -> None:
    store = BlockStore(capacity_blocks=8)
    put(store, "QR")  # oldest, but soft-pinned below
    put(store, "SP")
    put(store, "x", parent="P")
    assert store.soft_pin_prefix(keys_of("Q", "R", "nope")) == 2
    store.check_invariants()
    assert names(store.evict(1)) == ["x"]  # the older, soft-pinned R survives
    assert names(store.evict(10)) == ["P", "S", "R", "Q"]


def test_soft_unpin_restores_plain_lru() -> None:
    store = BlockStore(capacity_blocks=8)
    put(store, "A")
    put(store, "B")
    store.soft_pin_prefix(keys_of("A"))
    store.soft_unpin_prefix(keys_of("A"))
    assert store.stats().soft_pinned_blocks == 0
    store.check_invariants()
    assert names(store.evict(10)) == ["A", "B"]


def test_heap_stays_bounded_under_churn() -> None:
    store = BlockStore(capacity_blocks=4)
    put(store, "AB")
    for _ in range(5000):
        store.release(keys_of("A", "B")[: len(store.acquire(keys_of("A", "B")))])
    store.check_invariants()
    assert len(store._heap) <= 2 * 1 + 1024 + 1


# -- random sequences ----------------------------------------------------------------------------

# Keys are paths in a binary tree of depth 4: "" is the root's child "r", "r0", "r01", ...
TREE_PATHS = [
    "r" + "".join(bits) for depth in range(4) for bits in itertools.product("01", repeat=depth)
]
paths = st.sampled_from(TREE_PATHS)


def chain_of(path: str) -> list[BlockKey]:
    return [k(path[: i + 1]) for i in range(len(path))]


class BlockStoreMachine(RuleBasedStateMachine):
    """Random reserve/commit/abort/acquire/release/evict/soft-pin sequences on a tiny store."""

    def __init__(self) -> None:
        super().__init__()
        self.store = BlockStore(1)
        self.pinned_by_us: dict[BlockKey, int] = {}  # refcounts we expect, writers' pins included
        self.open_writes: list[list[BlockKey]] = []  # reserved keys of each unfinished write
        self.open_holds: list[list[BlockKey]] = []  # acquired keys of each unreleased hold

    @initialize(capacity=st.integers(1, 6))
    def start(self, capacity: int) -> None:
        self.store = BlockStore(capacity)

    def _pin(self, keys: Sequence[BlockKey], delta: int) -> None:
        for key in keys:
            self.pinned_by_us[key] = self.pinned_by_us.get(key, 0) + delta
            if self.pinned_by_us[key] == 0:
                del self.pinned_by_us[key]

    def _check_evicted(self, evicted: Sequence[BlockKey]) -> None:
        for key in evicted:
            assert key not in self.pinned_by_us, "a pinned block was evicted"
            assert key not in self.store
            # Ancestor never before its descendants: nothing below an evicted key survives.
            assert not any(p.startswith(_path(key)) for p in map(_path, self.present()))

    def present(self) -> list[BlockKey]:
        return [k(p) for p in TREE_PATHS if k(p) in self.store]

    @precondition(lambda self: len(self.open_writes) < 3)  # else the store fills with pins
    @rule(path=paths, skip=st.integers(0, 3))
    def reserve(self, path: str, skip: int) -> None:
        chain = chain_of(path)[min(skip, len(path) - 1) :]  # sometimes continue an existing prefix
        first_parent = k(path[: len(path) - len(chain)]) if len(chain) < len(path) else None
        parents = [first_parent, *chain[:-1]]
        before = set(self.present())
        result = self.store.reserve(chain, parents)
        self._check_evicted(result.evicted)
        assert set(result.evicted) <= before - set(chain) - {p for p in parents if p is not None}
        reserved = [key for key, slot in zip(chain, result.slots) if slot is not None]
        # Present keys get None; the chain stops at the first new key it cannot store.
        stopped = False
        for key, slot in zip(chain, result.slots):
            if key in before:
                assert slot is None
            elif slot is None:
                stopped = True
            assert not (stopped and slot is not None), "a block was stored after its chain stopped"
            if slot is not None:
                assert info(self.store, key).state is BlockState.WRITING
        self._pin(reserved, +1)
        self.open_writes.append(reserved)

    @rule(path=paths)
    def put(self, path: str) -> None:
        """Reserve and commit at once, the common case."""
        chain = chain_of(path)
        result = self.store.reserve(chain, [None, *chain[:-1]])
        self._check_evicted(result.evicted)
        self.store.commit([key for key, slot in zip(chain, result.slots) if slot is not None])

    @precondition(lambda self: self.open_writes)
    @rule(index=st.integers(0, 100), num_commit=st.one_of(st.just(4), st.integers(0, 3)))
    def finish_write(self, index: int, num_commit: int) -> None:
        """Commit a prefix of one write's reserved run and abort the rest."""
        reserved = self.open_writes.pop(index % len(self.open_writes))
        committed, aborted = reserved[:num_commit], reserved[num_commit:]
        self.store.commit(committed)
        self.store.abort(aborted)
        self._pin(reserved, -1)
        assert all(key not in self.store for key in aborted)
        assert all(info(self.store, key).state is BlockState.READY for key in committed)

    @precondition(lambda self: len(self.open_holds) < 3)
    @rule(path=paths)
    def acquire(self, path: str) -> None:
        chain = chain_of(path)
        expected = self.store.match_prefix(chain)
        slots = self.store.acquire(chain)
        assert len(slots) == expected
        assert slots == [info(self.store, key).slot for key in chain[:expected]]
        self._pin(chain[:expected], +1)
        self.open_holds.append(chain[:expected])

    @precondition(lambda self: self.open_holds)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        keys = self.open_holds.pop(index % len(self.open_holds))
        self.store.release(keys)
        self._pin(keys, -1)

    @rule(num_blocks=st.integers(0, 4), one_by_one=st.booleans())
    def evict(self, num_blocks: int, one_by_one: bool) -> None:
        """One by one, each victim must be the evictable block with the smallest (soft pin, tick),
        judged from public snapshots alone."""
        if not one_by_one:
            evicted = self.store.evict(num_blocks)
            assert len(evicted) <= num_blocks
            self._check_evicted(evicted)
            return
        for _ in range(num_blocks):
            candidates = [
                i
                for i in (info(self.store, key) for key in self.present())
                if i.state is BlockState.READY and i.refcount == 0 and i.num_children == 0
            ]
            first = min(candidates, key=lambda i: (i.soft_pinned, i.last_access_tick), default=None)
            expected = [first.key] if first else []
            evicted = self.store.evict(1)
            assert evicted == expected
            self._check_evicted(evicted)

    @rule(path=paths, pin=st.booleans())
    def soft_pin(self, path: str, pin: bool) -> None:
        chain = chain_of(path)
        if pin:
            self.store.soft_pin_prefix(chain)
        else:
            self.store.soft_unpin_prefix(chain)

    @invariant()
    def consistent(self) -> None:
        self.store.check_invariants()
        stats = self.store.stats()
        assert stats.used_blocks <= stats.capacity_blocks
        assert stats.used_blocks + stats.free_blocks == stats.capacity_blocks
        for key, count in self.pinned_by_us.items():
            assert key in self.store, "a pinned block vanished"
            assert info(self.store, key).refcount == count
        assert stats.pinned_blocks == len(self.pinned_by_us)


def _path(key: BlockKey) -> str:
    return key.rstrip(b".").decode()


BlockStoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockStoreMachine = BlockStoreMachine.TestCase
