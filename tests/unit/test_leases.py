"""Leases: the registry's TTLs, renewals and caps (which lease gives way, exactly), and a store
node applying them to its tiers: a key leased before its block is committed, an expired or
released lease's blocks back in LRU order by their own ticks, leased blocks demoted to disk
rather than dropped, the leases a block server hands out with its blocks. In-process nodes (no
Ray, no Redis); the registry's and the tiers' invariants are checked after every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.config import KVStoreConfig
from kvstore.keys import BlockKey
from kvstore.leases import InvalidLease, LeaseGrant, LeaseInfo, LeaseRegistry
from kvstore.node import KVStoreNode

BLOCK_BYTES = 1 << 20  # the node's arena block (the config's floor: a one-block host tier)


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def ks(names: str) -> list[BlockKey]:
    return [k(n) for n in names]


def names(keys) -> list[str]:
    return [key.rstrip(b".").decode() for key in keys]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def registry(max_blocks: int = 100, per_tenant_blocks: int = 100,
             clock: Clock | None = None) -> LeaseRegistry:
    return LeaseRegistry(BLOCK_BYTES, max_blocks * BLOCK_BYTES, per_tenant_blocks * BLOCK_BYTES,
                         clock=clock or Clock())


def lease(reg: LeaseRegistry, lease_id: str, keys: str, tenant: str = "t", ttl_s: float = 60):
    change = reg.lease(lease_id, tenant, ks(keys), ttl_s)
    reg.check_invariants()
    return change


# -- the registry ------------------------------------------------------------------------------


def test_lease_replaces_its_keys_and_reports_what_flipped() -> None:
    reg = registry()
    change = lease(reg, "s1", "ABC")
    assert names(change.leased) == ["A", "B", "C"] and change.unleased == []
    change = lease(reg, "s1", "BCD")  # the next step: A is no longer named
    assert names(change.leased) == ["D"] and names(change.unleased) == ["A"]
    assert names(reg.keys_of("s1")) == ["B", "C", "D"]
    change = lease(reg, "s2", "DE")
    assert names(change.leased) == ["E"]  # D was leased already
    change = reg.release("s1")
    reg.check_invariants()
    assert names(change.unleased) == ["B", "C"]  # D stays: s2 names it
    assert reg.is_leased(k("D")) and not reg.is_leased(k("B"))
    assert reg.release("nope").unleased == []


def test_expiry_on_the_clock_and_renewal_pushes_it_back() -> None:
    clock = Clock()
    reg = registry(clock=clock)
    lease(reg, "s1", "AB", ttl_s=10)
    lease(reg, "s2", "C", ttl_s=30)
    clock.now += 5
    lease(reg, "s1", "AB", ttl_s=10)  # renewed: now expires at +15
    clock.now += 9.9  # +14.9
    assert reg.expire().unleased == []
    assert reg.expires_in_s("s1") == pytest.approx(0.1)
    clock.now += 0.1  # +15: s1's old entry (+10) was stale, this one is due
    change = reg.expire()
    reg.check_invariants()
    assert names(change.unleased) == ["A", "B"] and reg.lease_ids() == ["s2"]
    clock.now += 15
    assert names(reg.expire().unleased) == ["C"] and reg.num_leases == 0


def test_an_expiry_seen_by_another_call_is_in_its_change() -> None:
    clock = Clock()
    reg = registry(clock=clock)
    lease(reg, "s1", "AB", ttl_s=1)
    clock.now += 2
    change = lease(reg, "s2", "BC")
    assert names(change.unleased) == ["A"] and names(change.leased) == ["C"]


@pytest.mark.parametrize("ttl_s", [0, -1, float("nan"), float("inf"), "5", True])
def test_a_bad_ttl_is_refused(ttl_s) -> None:
    reg = registry()
    with pytest.raises(InvalidLease, match="ttl_s must be a positive number of seconds"):
        reg.lease("s1", "t", ks("A"), ttl_s)
    with pytest.raises(InvalidLease, match="non-empty lease_id"):
        reg.lease("", "t", ks("A"), 5)
    assert reg.num_leases == 0


def test_the_global_cap_makes_the_oldest_lease_give_way() -> None:
    reg = registry(max_blocks=5)
    lease(reg, "s1", "AB", tenant="x")
    lease(reg, "s2", "CD", tenant="y")
    change = lease(reg, "s3", "EF", tenant="z")  # 6 blocks > 5: the oldest (s1) gives way
    assert change.gave_way == ["s1"] and names(change.unleased) == ["A", "B"]
    assert reg.lease_ids() == ["s2", "s3"] and reg.charged_bytes() == 4 * BLOCK_BYTES
    assert reg.cap_evicted_leases == 1
    change = lease(reg, "s4", "GHIJ", tenant="x")  # 8 > 5: s2, then s3
    assert change.gave_way == ["s2", "s3"] and reg.lease_ids() == ["s4"]
    assert reg.charged_bytes() <= 5 * BLOCK_BYTES


def test_the_tenant_cap_evicts_only_that_tenants_oldest() -> None:
    reg = registry(max_blocks=100, per_tenant_blocks=4)
    lease(reg, "a1", "AB", tenant="a")
    lease(reg, "b1", "CD", tenant="b")  # older than a2, but another tenant's
    lease(reg, "a2", "EF", tenant="a")
    change = lease(reg, "a3", "GH", tenant="a")  # a: 6 > 4: a1 gives way, not b1
    assert change.gave_way == ["a1"]
    assert reg.lease_ids() == ["b1", "a2", "a3"]
    assert reg.charged_bytes("a") == 4 * BLOCK_BYTES and reg.charged_bytes("b") == 2 * BLOCK_BYTES


def test_renewing_moves_a_lease_to_newest() -> None:
    reg = registry(max_blocks=4)
    lease(reg, "s1", "AB")
    lease(reg, "s2", "CD")
    lease(reg, "s1", "AB")  # renewed: s2 is the oldest now
    change = lease(reg, "s3", "EF")
    assert change.gave_way == ["s2"] and reg.lease_ids() == ["s1", "s3"]


def test_a_lease_alone_over_the_cap_keeps_its_leading_keys() -> None:
    reg = registry(max_blocks=6, per_tenant_blocks=3)
    change = lease(reg, "s1", "ABCDE", tenant="a")  # over the tenant cap alone
    assert names(reg.keys_of("s1")) == ["A", "B", "C"] and names(change.leased) == ["A", "B", "C"]
    lease(reg, "s2", "FGH", tenant="b")
    change = lease(reg, "s3", "IJKLMNOP", tenant="c")  # cut to its tenant cap (3) first,
    assert names(reg.keys_of("s3")) == ["I", "J", "K"]
    assert change.gave_way == ["s1"]  # then the global cap: 9 > 6, the oldest gives way
    change = lease(reg, "s4", "QRSTUVWXYZ", tenant="d")
    assert change.gave_way == ["s2"] and reg.lease_ids() == ["s3", "s4"]
    assert names(reg.keys_of("s4")) == ["Q", "R", "S"]
    big = LeaseRegistry(BLOCK_BYTES, 4 * BLOCK_BYTES, 100 * BLOCK_BYTES, clock=Clock())
    big.lease("s1", "a", ks("AB"), 60)
    change = big.lease("s2", "b", ks("CDEFGH"), 60)  # alone over the global cap: cut to it
    big.check_invariants()
    assert change.gave_way == ["s1"] and names(big.keys_of("s2")) == ["C", "D", "E", "F"]


def test_a_shared_key_is_charged_once() -> None:
    reg = registry(max_blocks=4)
    lease(reg, "s1", "TAB", tenant="x")
    change = lease(reg, "s2", "TC", tenant="y")  # T shared: 4 distinct keys, fits
    assert change.gave_way == [] and reg.charged_bytes() == 4 * BLOCK_BYTES
    assert reg.charged_bytes("x") == 3 * BLOCK_BYTES and reg.charged_bytes("y") == 2 * BLOCK_BYTES


def test_extend_adds_keys_and_keeps_the_later_expiry() -> None:
    clock = Clock()
    reg = registry(clock=clock)
    lease(reg, "s1", "AB", ttl_s=100)
    change = reg.extend("s1", "t", ks("BC"), ttl_s=10)
    reg.check_invariants()
    assert names(change.leased) == ["C"] and names(reg.keys_of("s1")) == ["A", "B", "C"]
    assert reg.expires_in_s("s1") == pytest.approx(100)
    reg.extend("s2", "t", ks("D"), ttl_s=10)  # not held here: created
    assert reg.lease_ids() == ["s1", "s2"] and reg.expires_in_s("s2") == pytest.approx(10)


def test_grants_name_the_leases_of_the_served_keys_with_their_time_left() -> None:
    clock = Clock()
    reg = registry(clock=clock)
    lease(reg, "s1", "ABC", tenant="x", ttl_s=30)
    lease(reg, "s2", "CD", tenant="y", ttl_s=60)
    clock.now += 10
    grants = reg.grants_for(ks("BCDE"))
    assert grants == [LeaseGrant("s1", "x", 20.0, [0, 1]), LeaseGrant("s2", "y", 50.0, [1, 2])]


# -- a store node applying them ----------------------------------------------------------------


def write(node: KVStoreNode, names_: str, parent: str | None = None) -> None:
    keys = ks(names_)
    slots = node.reserve(keys, [k(parent) if parent else None, *keys[:-1]])
    assert all(slot is not None for slot in slots)
    for key, slot in zip(keys, slots):
        node.arena.slot(slot).fill_(key[0])
    node.commit(keys)
    check(node)


def check(node: KVStoreNode) -> None:
    node.store.check_invariants()
    node._leases.check_invariants()
    if node.disk is not None:
        node.disk.check_invariants()


def evict_all(node: KVStoreNode) -> list[str]:
    order = []
    while evicted := node.store.evict(1):
        order += names(evicted)
        check(node)
    return order


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_node(tmp_path, clock):
    nodes = []

    def make(host_blocks: int = 8, disk_blocks: int = 0, **config) -> KVStoreNode:
        disk = {"disk_dir": str(tmp_path / f"disk{len(nodes)}"),
                "disk_capacity_bytes": disk_blocks * (BLOCK_BYTES + 4096)} if disk_blocks else {}
        caps = {"lease_max_bytes": 100 * BLOCK_BYTES, "lease_max_bytes_per_tenant": 100 * BLOCK_BYTES}
        node = KVStoreNode(f"n{len(nodes)}", "t", KVStoreConfig(
            host_capacity_bytes=host_blocks * BLOCK_BYTES, arena_dir=str(tmp_path),
            **disk, **{**caps, **config}), BLOCK_BYTES, redis_url=None, lease_clock=clock)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.shutdown()


def test_a_key_leased_before_its_block_is_committed_is_leased_on_commit(make_node) -> None:
    node = make_node()
    info = node.lease("s1", "t", ks("AB"), ttl_s=60)
    assert info == LeaseInfo("s1", num_keys=2, num_present_blocks=0, leased_bytes=0,
                             expires_in_s=60.0)
    write(node, "A")
    write(node, "C")
    write(node, "B")  # the async save of B lands after C's
    assert node.store.block_info(k("A")).leased and node.store.block_info(k("B")).leased
    assert not node.store.block_info(k("C")).leased
    assert evict_all(node) == ["C", "A", "B"]


def test_an_expired_leases_blocks_go_back_into_lru_order_by_their_own_ticks(make_node,
                                                                            clock) -> None:
    node = make_node()
    for name in "ABCD":
        write(node, name)
    node.lease("s1", "t", ks("B"), ttl_s=10)
    node.lease("s2", "t", ks("D"), ttl_s=100)
    tick = node.store.block_info(k("B")).last_access_tick
    clock.now += 10
    assert node.stats().leased_blocks == 1  # s1 lapsed, seen at the next call
    assert node.store.block_info(k("B")).last_access_tick == tick
    assert evict_all(node) == ["A", "B", "C", "D"]


def test_lapsed_leases_are_seen_before_an_eviction(make_node, clock) -> None:
    node = make_node(host_blocks=3)
    write(node, "A")
    write(node, "B")
    write(node, "C")
    node.lease("s1", "t", ks("A"), ttl_s=5)
    node.lease("s2", "t", ks("B"), ttl_s=50)
    clock.now += 6
    write(node, "D")  # the reserve sees s1 lapsed: A (oldest, plain again) goes, not C
    assert [n for n in "ABCD" if k(n) in node.store] == ["B", "C", "D"]


def test_a_released_leases_blocks_go_back_into_lru_order(make_node) -> None:
    node = make_node()
    for name in "ABCD":
        write(node, name)
    node.lease("s1", "t", ks("AC"), ttl_s=60)
    node.lease("s2", "t", ks("C"), ttl_s=60)
    assert node.release_lease("s1") == 1  # A; C stays leased by s2
    assert node.release_lease("s1") == 0
    check(node)
    assert evict_all(node) == ["A", "B", "D", "C"]


def test_lease_stats_by_tenant_and_cap_evictions(make_node) -> None:
    node = make_node(host_blocks=16, lease_max_bytes=5 * BLOCK_BYTES,
                     lease_max_bytes_per_tenant=3 * BLOCK_BYTES)
    write(node, "ABCDEF")
    node.lease("a1", "a", ks("AB"), ttl_s=60)
    node.lease("b1", "b", ks("ABX"), ttl_s=60)  # X not stored here (yet)
    stats = node.lease_stats()
    assert (stats.leased_blocks, stats.leased_bytes) == (2, 2 * BLOCK_BYTES)
    assert stats.by_tenant == {"a": 2 * BLOCK_BYTES, "b": 2 * BLOCK_BYTES}
    assert (stats.num_leases, stats.lease_evictions, stats.charged_bytes) == (2, 0, 3 * BLOCK_BYTES)
    info = node.lease("a2", "a", ks("CD"), ttl_s=60)  # a: 4 keys > 3: a1 (a's oldest) gives way
    assert (info.num_keys, info.num_present_blocks, info.leased_bytes) == (2, 2, 2 * BLOCK_BYTES)
    check(node)
    stats = node.lease_stats()
    assert stats.by_tenant == {"a": 2 * BLOCK_BYTES, "b": 2 * BLOCK_BYTES}
    assert (stats.cap_evicted_leases, stats.lease_evictions, stats.num_leases) == (1, 1, 2)
    info = node.lease("b1", "b", ks("ABCDEF"), ttl_s=60)  # alone over its tenant cap: cut
    assert (info.num_keys, info.num_cut_keys) == (3, 3)
    stats = node.lease_stats()
    assert stats.charged_bytes == 4 * BLOCK_BYTES  # A B C (b), C D (a)
    assert stats.by_tenant == {"a": 2 * BLOCK_BYTES, "b": 3 * BLOCK_BYTES}
    assert node.stats().leased_blocks == 4
    node.lease("c1", "c", ks("EF"), ttl_s=60)  # 6 > 5 globally: the oldest, a2, gives way
    stats = node.lease_stats()
    assert (stats.by_tenant, stats.cap_evicted_leases) == (
        {"b": 3 * BLOCK_BYTES, "c": 2 * BLOCK_BYTES}, 2)
    check(node)


def test_default_caps_are_half_and_a_quarter_of_host_memory() -> None:
    config = KVStoreConfig(host_capacity_bytes=8 << 20)
    assert config.lease_caps_bytes() == (4 << 20, 2 << 20)
    assert KVStoreConfig(lease_max_bytes=0, lease_max_bytes_per_tenant=7).lease_caps_bytes() == (0, 7)


def test_without_a_disk_tier_leased_blocks_are_evicted_last_and_counted(make_node) -> None:
    node = make_node(host_blocks=3)
    write(node, "A")
    write(node, "B")
    node.lease("s1", "t", ks("AB"), ttl_s=60)
    write(node, "C")
    write(node, "D")  # C (plain) goes although A and B are older
    write(node, "E")  # only leased blocks left besides D: D goes
    assert [n for n in "ABCDE" if k(n) in node.store] == ["A", "B", "E"]
    node.lease("s2", "t", ks("E"), ttl_s=60)
    write(node, "F")  # everything leased: A (the least recent) is dropped anyway
    assert [n for n in "ABEF" if k(n) in node.store] == ["B", "E", "F"]
    stats = node.lease_stats()
    assert (stats.dropped_leased_blocks, stats.lease_evictions) == (1, 1)


def test_leased_blocks_are_demoted_to_disk_and_evicted_there_after_plain_ones(make_node) -> None:
    node = make_node(host_blocks=2, disk_blocks=3)
    write(node, "A")
    write(node, "B")
    node.lease("s1", "t", ks("A"), ttl_s=60)
    write(node, "C")  # host: B (plain) goes to disk
    write(node, "D")  # host: C plain, to disk
    write(node, "E")  # host: only A (leased) and D: D (plain) to disk; disk full: B C D
    assert [n for n in "ABCDE" if k(n) in node.store] == ["A", "E"]
    assert [n for n in "ABCDE" if node.disk.contains(k(n))] == ["B", "C", "D"]
    node.lease("s2", "t", ks("E"), ttl_s=60)
    write(node, "F")  # host: A and E leased: A (older) demoted, and the disk drops B (plain)
    assert [n for n in "ABCDEF" if node.disk.contains(k(n))] == ["A", "C", "D"]
    assert node.disk.stats().leased_blocks == 1
    node.lease("s3", "t", ks("F"), ttl_s=60)
    write(node, "G")  # host: E and F leased: E demoted, leased: the disk drops C
    write(node, "H")  # host: G plain goes, to disk: the disk drops D (plain) for it
    assert [n for n in "ACDEFG" if node.disk.contains(k(n))] == ["A", "E", "G"]
    node.lease("s4", "t", ks("H"), ttl_s=60)
    write(node, "I")  # host: F and H leased: F demoted: the disk drops G, its last plain block
    write(node, "J")  # host: I (plain) demoted: the disk holds only leased blocks: dropped
    assert [n for n in "ACDEFGHI" if node.disk.contains(k(n))] == ["A", "E", "F"]
    assert k("I") not in node.store and node.disk.stats().rejected_puts == 1
    stats = node.lease_stats()
    assert (stats.leased_blocks, stats.dropped_leased_blocks, stats.lease_evictions) == (4, 0, 0)
    assert node.tier_counters().demoted_blocks == 7  # B C D A E G F; not I
    # a leased block promoted back is leased in host memory again
    assert len(node.acquire(ks("A"))) == 1
    node.release(ks("A"))
    assert node.store.block_info(k("A")).leased
    check(node)


def test_a_lease_renewed_through_demotion_keeps_disk_marks_in_line(make_node) -> None:
    node = make_node(host_blocks=1, disk_blocks=3)
    write(node, "A")
    node.lease("s1", "t", ks("A"), ttl_s=60)
    write(node, "B")  # A demoted leased
    assert node.disk.stats().leased_blocks == 1
    assert node.release_lease("s1") == 1  # A: on disk only, plain again
    check(node)
    assert node.disk.stats().leased_blocks == 0


def test_pin_for_transfer_hands_out_the_leases_of_the_served_blocks(make_node, clock) -> None:
    node = make_node()
    write(node, "ABC")
    node.lease("s1", "x", ks("BC"), ttl_s=30)
    clock.now += 10
    run = node.pin_for_transfer(ks("ABCZ"))
    assert names(run.keys) == ["A", "B", "C"]
    assert run.leases == [LeaseGrant("s1", "x", 20.0, [1, 2])]
    node.release(run.keys)
    clock.now += 20
    run = node.pin_for_transfer(ks("AB"))
    assert run.leases == []  # lapsed
    node.release(run.keys)
    check(node)


def test_a_pulled_lease_joins_the_one_held_here(make_node) -> None:
    node = make_node()
    write(node, "AB")
    node.lease("s1", "x", ks("A"), ttl_s=5)
    with node._lock:
        node._extend_lease("s1", "x", ks("B"), 30.0)
    check(node)
    assert node.lease_stats().leased_blocks == 2
    assert node.lease("s1", "x", ks("A"), ttl_s=5).num_keys == 1  # naming it again replaces


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lease", "release", "tick"]),
                          st.sampled_from(["s1", "s2", "s3", "s4"]),
                          st.sampled_from(["a", "b"]),
                          st.lists(st.sampled_from("ABCDEFGH"), max_size=6),
                          st.integers(1, 20)), max_size=30))
def test_caps_hold_after_any_sequence(steps) -> None:
    """Whatever the leases do, the charge stays within both caps and every flip reported
    matches the key index (checked by replaying the changes into a set)."""
    clock = Clock()
    reg = LeaseRegistry(BLOCK_BYTES, 5 * BLOCK_BYTES, 3 * BLOCK_BYTES, clock=clock)
    leased: set[BlockKey] = set()
    for op, lease_id, tenant, keys, seconds in steps:
        if op == "lease":
            change = reg.lease(lease_id, tenant, ks("".join(keys)), seconds)
        elif op == "release":
            change = reg.release(lease_id)
        else:
            clock.now += seconds
            change = reg.expire()
        assert not leased & set(change.leased) and set(change.unleased) <= leased
        leased = (leased | set(change.leased)) - set(change.unleased)
        reg.check_invariants()
        assert leased == set(reg.leased_keys())
        assert reg.charged_bytes() <= 5 * BLOCK_BYTES
