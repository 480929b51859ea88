"""The lease class in the tiers' eviction order: plain LRU blocks first, then leased blocks, then
operator soft pins, LRU within each; a lease mark changed leaves a block's recency as it was.
Host tier (BlockStore) and disk tier (DiskTier), exact orders, invariants after every step."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block_store import BlockStore
from kvstore.disk_tier import HEADER_BYTES, DiskTier
from kvstore.keys import BlockKey

BLOCK_BYTES = 64


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def names(keys) -> list[str]:
    return [key.rstrip(b".").decode() for key in keys]


def put_root(store: BlockStore, name: str) -> None:
    """One single-block chain (a root leaf), committed: each gets the next tick."""
    result = store.reserve([k(name)], [None])
    assert result.slots[0] is not None
    store.commit([k(name)])
    store.check_invariants()


def evict_one_at_a_time(store: BlockStore) -> list[str]:
    order = []
    while evicted := store.evict(1):
        order += names(evicted)
        store.check_invariants()
    return order


# -- host tier ---------------------------------------------------------------------------------


def test_plain_blocks_go_first_then_leased_then_soft_pinned() -> None:
    store = BlockStore(capacity_blocks=8)
    for name in "ABCD":  # A plain (older), B leased, C soft-pinned, D plain (newer)
        put_root(store, name)
    assert store.set_leased([k("B")], True) == 1
    store.check_invariants()
    assert store.soft_pin_prefix([k("C")]) == 1
    store.check_invariants()
    assert evict_one_at_a_time(store) == ["A", "D", "B", "C"]


def test_a_soft_pin_ranks_above_a_lease_on_the_same_block() -> None:
    store = BlockStore(capacity_blocks=8)
    for name in "ABC":
        put_root(store, name)
    store.set_leased([k("A"), k("B")], True)
    store.soft_pin_prefix([k("A")])  # A leased and soft-pinned: the soft pin's class
    store.check_invariants()
    assert evict_one_at_a_time(store) == ["C", "B", "A"]


def test_unleasing_puts_a_block_back_in_lru_order_by_its_own_tick() -> None:
    store = BlockStore(capacity_blocks=8)
    for name in "ABCD":
        put_root(store, name)
    store.set_leased([k("A"), k("C")], True)
    store.check_invariants()
    tick = store.block_info(k("A")).last_access_tick
    assert store.set_leased([k("A")], False) == 1  # the lease lapsed
    store.check_invariants()
    assert store.block_info(k("A")).last_access_tick == tick and not store.block_info(k("A")).leased
    assert evict_one_at_a_time(store) == ["A", "B", "D", "C"]


def test_set_leased_skips_absent_keys_and_counts_present_ones() -> None:
    store = BlockStore(capacity_blocks=4)
    put_root(store, "A")
    assert store.set_leased([k("A"), k("Z")], True) == 1
    assert store.set_leased([k("A")], True) == 1  # a flag, not a count
    store.check_invariants()
    stats = store.stats()
    assert (stats.leased_blocks, stats.evicted_leased_blocks) == (1, 0)
    assert store.block_info(k("A")).leased
    assert store.evict(1) == [k("A")]
    stats = store.stats()
    assert (stats.leased_blocks, stats.evicted_leased_blocks) == (0, 1)
    store.check_invariants()


def test_a_full_store_evicts_a_leased_block_only_when_nothing_plain_is_left() -> None:
    store = BlockStore(capacity_blocks=3)
    for name in "ABC":
        put_root(store, name)
    store.set_leased([k("A"), k("B")], True)
    result = store.reserve([k("D")], [None])
    assert names(result.evicted) == ["C"]
    store.commit([k("D")])
    store.set_leased([k("D")], True)  # everything leased: the least recently used lease goes
    result = store.reserve([k("E")], [None])
    assert names(result.evicted) == ["A"]
    store.commit([k("E")])
    store.check_invariants()


def test_a_leased_trunk_still_outlives_its_plain_twigs() -> None:
    """Leaf-LRU holds within the class order: a leased parent is not evictable while it has
    children, and a plain child of it goes before any leased leaf."""
    store = BlockStore(capacity_blocks=8)
    store.reserve([k("T"), k("x")], [None, k("T")])
    store.commit([k("T"), k("x")])
    put_root(store, "L")
    store.set_leased([k("T"), k("L")], True)
    store.check_invariants()
    assert evict_one_at_a_time(store) == ["x", "T", "L"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["plain", "leased", "soft", "both"]), min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_eviction_follows_class_then_tick(classes, random) -> None:
    """Root leaves with random marks, set in random order: all evicted in (class, tick) order."""
    store = BlockStore(capacity_blocks=16)
    labels = [f"b{i}" for i in range(len(classes))]
    for label in labels:
        put_root(store, label)
    marks = list(zip(labels, classes))
    random.shuffle(marks)
    for label, cls in marks:
        if cls in ("leased", "both"):
            store.set_leased([k(label)], True)
        if cls in ("soft", "both"):
            store.soft_pin_prefix([k(label)])
        store.check_invariants()
    rank = {"plain": 0, "leased": 1, "soft": 2, "both": 2}
    expected = sorted(labels, key=lambda label: (rank[classes[labels.index(label)]],
                                                 labels.index(label)))
    assert evict_one_at_a_time(store) == expected


# -- disk tier ---------------------------------------------------------------------------------


def payload(name: str) -> bytes:
    return (name.encode() * BLOCK_BYTES)[:BLOCK_BYTES]


@pytest.fixture
def make_tier(tmp_path: Path):
    tiers = []

    def make(num_blocks: int) -> DiskTier:
        tier = DiskTier(tmp_path / f"disk{len(tiers)}", num_blocks * (HEADER_BYTES + BLOCK_BYTES),
                        BLOCK_BYTES)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def disk_put(tier: DiskTier, name: str, leased: bool = False) -> bool:
    ok = tier.put(k(name), None, payload(name), leased=leased)
    tier.check_invariants()
    return ok


def test_disk_evicts_plain_blocks_before_leased_ones(make_tier) -> None:
    tier = make_tier(4)
    disk_put(tier, "A")
    disk_put(tier, "B", leased=True)
    disk_put(tier, "C")
    disk_put(tier, "D", leased=True)
    # a leased newcomer makes room from the plain blocks first (LRU), then from leased ones
    disk_put(tier, "E", leased=True)
    assert [n for n in "ABCDE" if k(n) in tier] == ["B", "C", "D", "E"]
    disk_put(tier, "F", leased=True)
    assert [n for n in "ABCDEF" if k(n) in tier] == ["B", "D", "E", "F"]
    disk_put(tier, "G", leased=True)
    assert [n for n in "ABCDEFG" if k(n) in tier] == ["D", "E", "F", "G"]
    stats = tier.stats()
    assert (stats.evictions, stats.leased_evictions, stats.leased_blocks) == (3, 1, 4)


def test_a_plain_block_never_displaces_a_leased_one_on_disk(make_tier) -> None:
    tier = make_tier(2)
    disk_put(tier, "A", leased=True)
    disk_put(tier, "B", leased=True)
    assert not disk_put(tier, "C")  # rejected: dropped, the leases stay
    assert k("A") in tier and k("B") in tier and k("C") not in tier
    assert tier.stats().rejected_puts == 1
    tier.set_leased(k("A"), False)  # A's lease ended: now a plain block may take its place
    tier.check_invariants()
    assert disk_put(tier, "C")
    assert [n for n in "ABC" if k(n) in tier] == ["B", "C"]


def test_disk_unleasing_keeps_recency_and_a_hit_renews_it(make_tier) -> None:
    tier = make_tier(3)
    disk_put(tier, "A", leased=True)
    disk_put(tier, "B")
    disk_put(tier, "C", leased=True)
    assert tier.set_leased(k("A"), False) and not tier.set_leased(k("Z"), True)
    tier.check_invariants()
    disk_put(tier, "D", leased=True)  # A (plain, oldest) goes before B
    assert [n for n in "ABCD" if k(n) in tier] == ["B", "C", "D"]
    assert tier.get(k("C")) == payload("C")  # C: most recent of the leased blocks now
    tier.check_invariants()
    disk_put(tier, "E", leased=True)  # B plain goes
    disk_put(tier, "F", leased=True)  # then the least recent lease: D
    assert [n for n in "BCDEF" if k(n) in tier] == ["C", "E", "F"]


def test_put_of_a_present_block_takes_the_new_mark(make_tier) -> None:
    tier = make_tier(2)
    disk_put(tier, "A")
    assert disk_put(tier, "A", leased=True)
    assert tier.stats().leased_blocks == 1
    assert tier.put_many([(k("B"), None, payload("B"))], leased=True) == [True]
    tier.check_invariants()
    assert tier.stats().leased_blocks == 2
    assert tier.put_many([(k("C"), None, payload("C"))]) == [False]  # plain: no room
