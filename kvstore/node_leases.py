"""Leases on a store node: ``KVStoreNode.lease``, ``release_lease`` and ``lease_stats``, and the
glue that keeps the tiers' lease marks in line with the node's ``LeaseRegistry``.

The registry (``kvstore.leases``) decides which keys are leased; this mixin re-files the blocks
whose status changed in the host tier and the disk tier, marks a block leased when it arrives
(``commit``, a promotion, a demotion to disk), and counts leased blocks the node lost anyway.
Expiry is lazy: every node method whose answer or eviction order depends on it calls
``_expire_leases`` first (a heap peek when nothing lapsed). Leases live in the node's memory: a
node that dies takes its leases with it, and their sessions recompute what was there.

A mixin of ``kvstore.node.KVStoreNode``, whose ``__init__`` sets the attributes declared below;
its public methods take the node's lock, as the node's own do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvstore.block_store import BlockStore
from kvstore.disk_tier import DiskTier
from kvstore.keys import BlockKey
from kvstore.leases import LeaseChange, LeaseInfo, LeaseRegistry, LeaseStats

if TYPE_CHECKING:
    import threading

    from kvstore.host_arena import HostArena


class NodeLeases:
    """``KVStoreNode``'s leases."""

    _lock: threading.RLock
    arena: HostArena
    disk: DiskTier | None
    store: BlockStore
    _leases: LeaseRegistry
    dropped_leased_blocks: int
    """Leased blocks that left the node: evicted from host with no disk tier to take them (or
    one that refused them); those evicted from the disk tier are its ``leased_evictions``."""

    def lease(self, lease_id: str, tenant: str, keys: Sequence[BlockKey],
              ttl_s: float) -> LeaseInfo:
        """Keep ``keys`` past plain LRU blocks for ``ttl_s`` seconds, under ``lease_id``
        (counted against ``tenant``'s cap): replaces the keys the lease named before and renews
        it as the newest lease. Keys not stored yet are leased when they are committed. Raises
        ``InvalidLease`` for a TTL that is not a positive number of seconds."""
        with self._lock:
            keys = list(keys)
            change = self._leases.lease(lease_id, tenant, keys, ttl_s)
            self._apply_lease_change(change)
            named = self._leases.keys_of(lease_id)
            num_present = sum(map(self._holds, named))
            return LeaseInfo(
                lease_id=lease_id, num_keys=len(named), num_present_blocks=num_present,
                leased_bytes=num_present * self.arena.slot_bytes,
                expires_in_s=self._leases.expires_in_s(lease_id),
                num_cut_keys=len(dict.fromkeys(keys)) - len(named))

    def release_lease(self, lease_id: str) -> int:
        """End a lease now; returns how many of the node's blocks became plain by it (blocks
        another live lease names stay leased). An unknown or expired id releases nothing."""
        with self._lock:
            change = self._leases.release(lease_id)
            self._apply_lease_change(change)
            return sum(map(self._holds, change.unleased))

    def lease_stats(self) -> LeaseStats:
        """Leased blocks and bytes held now (in total and by tenant), leases, lease evictions."""
        with self._lock:
            self._expire_leases()
            block_bytes = self.arena.slot_bytes
            leased_blocks = sum(map(self._holds, self._leases.leased_keys()))
            by_tenant = {tenant: sum(map(self._holds, keys)) * block_bytes
                         for tenant, keys in sorted(self._leases.tenant_keys().items())}
            dropped = self.dropped_leased_blocks
            if self.disk is not None:
                dropped += self.disk.stats().leased_evictions
            cap_evicted = self._leases.cap_evicted_leases
            return LeaseStats(
                leased_blocks=leased_blocks, leased_bytes=leased_blocks * block_bytes,
                by_tenant=by_tenant, num_leases=self._leases.num_leases,
                lease_evictions=cap_evicted + dropped, cap_evicted_leases=cap_evicted,
                dropped_leased_blocks=dropped, charged_bytes=self._leases.charged_bytes(),
                max_bytes=self._leases.max_bytes,
                max_bytes_per_tenant=self._leases.max_bytes_per_tenant)

    # -- for the node ------------------------------------------------------------------------

    def _expire_leases(self) -> None:
        """End lapsed leases before a decision that depends on them (caller holds the lock)."""
        self._apply_lease_change(self._leases.expire())

    def _extend_lease(self, lease_id: str, tenant: str, keys: Sequence[BlockKey],
                      ttl_s: float) -> None:
        """Join a lease that arrived with pulled blocks (caller holds the lock)."""
        self._apply_lease_change(self._leases.extend(lease_id, tenant, keys, ttl_s))

    def _mark_leased(self, keys: Sequence[BlockKey]) -> None:
        """Blocks just stored in host memory: lease those a live lease names."""
        leased = [key for key in keys if self._leases.is_leased(key)]
        if leased:
            self.store.set_leased(leased, True)

    def _apply_lease_change(self, change: LeaseChange) -> None:
        if change.leased:
            self.store.set_leased(change.leased, True)
        if change.unleased:
            self.store.set_leased(change.unleased, False)
        if self.disk is not None:
            for key in change.leased:
                self.disk.set_leased(key, True)
            for key in change.unleased:
                self.disk.set_leased(key, False)

    def _holds(self, key: BlockKey) -> bool:
        return key in self.store or (self.disk is not None and self.disk.contains(key))
