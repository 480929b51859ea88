"""Leases: which blocks a store node keeps past plain LRU blocks, until when, within which caps.

A lease (``protos.wire.Lease`` names one for a request) is an id, a tenant, a set of block keys
and an expiry. Naming it again replaces its keys and renews its expiry; a key is *leased* while
at least one live lease names it. The tiers only see that flag (``BlockStore.set_leased``,
``DiskTier.set_leased``): leased blocks are evicted after plain LRU ones and before operator
soft pins, and demoted host → disk rather than dropped. This module is the policy's book: pure
logic, no I/O, an injectable clock, single-threaded (the owning node serialises calls).

Keys need not be present: a lease names the blocks of a prompt before (or while) the engine's
asynchronous saves land, so a block committed later whose key a live lease names is leased on
commit. Every call answers with a ``LeaseChange``: the keys that became leased or plain, for the
owner to re-file in its tiers.

Caps. A lease is charged for the keys it names, present or not (``block_bytes`` each; a key
named by several leases is charged once globally and once per tenant that names it), so whether
a lease fits never depends on how far its blocks have arrived, and the leased bytes a node holds
never exceed the charge. When a lease would exceed the per-tenant cap, that tenant's oldest
leases (by last renewal) give way first; then the global cap, the oldest leases of any tenant.
A lease that gives way loses its lease status only (its blocks become plain LRU blocks, their
recency unchanged). A lease alone over a cap keeps its leading keys up to the cap: a prefix is
what a next step can reuse.

Expiry is lazy: ``expire`` drops every lease whose TTL lapsed (a heap: O(1) when none did); the
owner calls it before any decision that depends on it (an eviction, a stats read).

Invariants (``check_invariants``): the key index is exactly the union of the live leases' keys,
per tenant too; a lease's keys are distinct; the charge is within both caps.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from kvstore.keys import BlockKey
from protos.errors import InvalidRequest


_EXPIRY_SLACK_ENTRIES = 1024
"""Stale expiry entries (of renewed leases) tolerated beyond twice the live leases."""


class InvalidLease(InvalidRequest):
    """A lease the caller got wrong (a TTL that is not a positive number of seconds, no id):
    the request that named it is at fault, as the fronts answer (400 / INVALID_ARGUMENT)."""


def check_lease(lease_id: str, ttl_s: float) -> None:
    """Raise ``InvalidLease`` unless the id is non-empty and the TTL a positive, finite number
    of seconds (callers check before sending; the registry checks again)."""
    if not lease_id:
        raise InvalidLease("a lease needs a non-empty lease_id")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not (
            math.isfinite(ttl_s) and ttl_s > 0):
        raise InvalidLease(f"lease {lease_id!r}: ttl_s must be a positive number of seconds, "
                           f"got {ttl_s!r}")


class LeaseGrant(msgspec.Struct, frozen=True):
    """A lease as it travels with pulled blocks (the block server's ``ReadReply.leases``): the
    puller leases ``served_keys[i]`` for each ``i`` in ``block_indices`` under the same id and
    tenant, for the ``ttl_s`` seconds the lease has left on the source."""

    lease_id: str
    tenant: str
    ttl_s: float
    block_indices: list[int]


class LeaseInfo(msgspec.Struct, frozen=True):
    """What ``KVStoreNode.lease`` did: the lease as it stands now on that node."""

    lease_id: str
    num_keys: int
    """Keys the lease names (after a cap cut it short)."""
    num_present_blocks: int
    """Of those, the blocks in the node's tiers now (host or disk)."""
    leased_bytes: int
    """``num_present_blocks`` in bytes."""
    expires_in_s: float
    num_cut_keys: int = 0
    """Trailing keys asked for but not leased: the lease alone was over a cap."""


class LeaseStats(msgspec.Struct, frozen=True):
    """A node's leases now (levels) and the lease evictions since it started (counters)."""

    leased_blocks: int
    """Blocks in the node's tiers that a live lease names (a block in host and disk: once)."""
    leased_bytes: int
    by_tenant: dict[str, int]
    """Leased bytes present, by tenant (a block two tenants lease counts for both)."""
    num_leases: int
    lease_evictions: int
    """``cap_evicted_leases + dropped_leased_blocks``: leases that gave way to a cap, and leased
    blocks that left the node anyway (nothing else was evictable, or no disk tier took them)."""
    cap_evicted_leases: int = 0
    dropped_leased_blocks: int = 0
    charged_bytes: int = 0
    """What the global cap counts: the bytes of every key a live lease names, present or not."""
    max_bytes: int = 0
    max_bytes_per_tenant: int = 0


@dataclass
class LeaseChange:
    """Keys whose lease status flipped in one call, and the leases that gave way to a cap."""

    leased: list[BlockKey] = field(default_factory=list)
    unleased: list[BlockKey] = field(default_factory=list)
    gave_way: list[str] = field(default_factory=list)


@dataclass
class _Lease:
    lease_id: str
    tenant: str
    keys: list[BlockKey]
    expires_at: float
    renewal: int


class LeaseRegistry:
    """The live leases of one node, the keys they name, and the caps on them."""

    def __init__(self, block_bytes: int, max_bytes: int, max_bytes_per_tenant: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert block_bytes > 0 and max_bytes >= 0 and max_bytes_per_tenant >= 0
        self.block_bytes = block_bytes
        self.max_bytes = max_bytes
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._clock = clock
        self._leases: OrderedDict[str, _Lease] = OrderedDict()  # oldest renewal first
        self._by_tenant: dict[str, OrderedDict[str, _Lease]] = {}  # the same, per tenant
        self._key_leases: dict[BlockKey, set[str]] = {}  # key -> ids of live leases naming it
        self._tenant_keys: dict[str, dict[BlockKey, int]] = {}  # tenant -> key -> its leases
        self._expiry: list[tuple[float, int, str]] = []  # (expires_at, renewal, id), lazy
        self._renewals = itertools.count(1)
        self._touched: dict[BlockKey, bool] = {}  # this call's keys -> leased before it
        self._change = LeaseChange()  # this call's answer (``_begin``)
        self.cap_evicted_leases = 0

    # -- the API ---------------------------------------------------------------------------------

    def lease(self, lease_id: str, tenant: str, keys: Sequence[BlockKey],
              ttl_s: float) -> LeaseChange:
        """Make ``lease_id`` name exactly ``keys`` (duplicates dropped, order kept) for
        ``ttl_s`` seconds from now, as the newest lease; then apply the caps."""
        return self._install(lease_id, tenant, keys, ttl_s, merge=False)

    def extend(self, lease_id: str, tenant: str, keys: Sequence[BlockKey],
               ttl_s: float) -> LeaseChange:
        """Add ``keys`` to ``lease_id`` (created if it is not live) and keep it at least
        ``ttl_s`` seconds more: how a lease arriving with pulled blocks joins the one this node
        may already hold (the workers here named it too). Renews it as the newest lease."""
        return self._install(lease_id, tenant, keys, ttl_s, merge=True)

    def release(self, lease_id: str) -> LeaseChange:
        """End a lease now (unknown or expired ids: nothing changes)."""
        change = self._begin()
        self._expire_due()
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._drop(lease)
        return self._end(change)

    def expire(self) -> LeaseChange:
        """End every lease whose TTL has lapsed (``now >= expires_at``)."""
        change = self._begin()
        self._expire_due()
        return self._end(change)

    def is_leased(self, key: BlockKey) -> bool:
        return key in self._key_leases

    def keys_of(self, lease_id: str) -> list[BlockKey]:
        lease = self._leases.get(lease_id)
        return list(lease.keys) if lease is not None else []

    def expires_in_s(self, lease_id: str) -> float:
        lease = self._leases.get(lease_id)
        return max(0.0, lease.expires_at - self._clock()) if lease is not None else 0.0

    def lease_ids(self) -> list[str]:
        """Live leases, oldest renewal first."""
        return list(self._leases)

    def tenant_keys(self) -> dict[str, list[BlockKey]]:
        """Each tenant's leased keys."""
        return {tenant: list(keys) for tenant, keys in self._tenant_keys.items()}

    def leased_keys(self) -> list[BlockKey]:
        return list(self._key_leases)

    def grants_for(self, keys: Sequence[BlockKey]) -> list[LeaseGrant]:
        """The live leases naming any of ``keys``, with the indices they name: what a pull of
        ``keys`` carries to the puller. Call ``expire`` first."""
        indices: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            for lease_id in self._key_leases.get(key, ()):
                indices.setdefault(lease_id, []).append(i)
        now = self._clock()
        grants = []
        for lease_id, named in indices.items():
            lease = self._leases[lease_id]
            grants.append(LeaseGrant(lease_id, lease.tenant, lease.expires_at - now, named))
        return sorted(grants, key=lambda grant: self._leases[grant.lease_id].renewal)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def charged_bytes(self, tenant: str | None = None) -> int:
        """What a cap counts: every key the live leases (of ``tenant``) name, once."""
        if tenant is None:
            return len(self._key_leases) * self.block_bytes
        return len(self._tenant_keys.get(tenant, ())) * self.block_bytes

    def check_invariants(self) -> None:
        key_leases: dict[BlockKey, set[str]] = {}
        tenant_keys: dict[str, dict[BlockKey, int]] = {}
        for lease in self._leases.values():
            assert len(set(lease.keys)) == len(lease.keys), f"lease {lease.lease_id} repeats keys"
            assert self._by_tenant[lease.tenant][lease.lease_id] is lease
            for key in lease.keys:
                key_leases.setdefault(key, set()).add(lease.lease_id)
                counts = tenant_keys.setdefault(lease.tenant, {})
                counts[key] = counts.get(key, 0) + 1
        assert key_leases == self._key_leases, "key index differs from the leases' keys"
        assert tenant_keys == self._tenant_keys, "tenant key index differs from the leases'"
        assert sum(map(len, self._by_tenant.values())) == len(self._leases)
        renewals = [lease.renewal for lease in self._leases.values()]
        assert renewals == sorted(renewals), "leases out of renewal order"
        assert self.charged_bytes() <= self.max_bytes, "leases over the global cap"
        for tenant in self._tenant_keys:
            assert self.charged_bytes(tenant) <= self.max_bytes_per_tenant, (
                f"tenant {tenant!r} over its cap")

    # -- internals -------------------------------------------------------------------------------

    def _install(self, lease_id: str, tenant: str, keys: Sequence[BlockKey], ttl_s: float,
                 merge: bool) -> LeaseChange:
        check_lease(lease_id, ttl_s)
        change = self._begin()
        self._expire_due()
        now = self._clock()
        expires_at = now + ttl_s
        wanted = list(dict.fromkeys(keys))
        old = self._leases.get(lease_id)
        if old is not None:
            if merge and old.tenant == tenant:
                named = set(old.keys)
                wanted = old.keys + [key for key in wanted if key not in named]
                expires_at = max(expires_at, old.expires_at)
            self._drop(old)  # then added back: the new key set, the newest renewal
        lease = _Lease(lease_id, tenant, [], expires_at, next(self._renewals))
        self._leases[lease_id] = lease
        self._by_tenant.setdefault(tenant, OrderedDict())[lease_id] = lease
        self._add_keys(lease, wanted)
        heapq.heappush(self._expiry, (expires_at, lease.renewal, lease_id))
        if len(self._expiry) > 2 * len(self._leases) + _EXPIRY_SLACK_ENTRIES:
            self._expiry = [entry for entry in self._expiry if self._is_current(entry)]
            heapq.heapify(self._expiry)
        self._apply_caps(lease)
        return self._end(change)

    def _expire_due(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            entry = heapq.heappop(self._expiry)
            if self._is_current(entry):  # else renewed or gone since
                self._drop(self._leases[entry[2]])

    def _is_current(self, entry: tuple[float, int, str]) -> bool:
        lease = self._leases.get(entry[2])
        return lease is not None and lease.renewal == entry[1]

    def _apply_caps(self, lease: _Lease) -> None:
        """Make room for ``lease`` (just installed, the newest): the tenant's oldest leases give
        way to its cap, then anyone's oldest to the global cap; a lease alone over a cap is cut
        to its leading keys."""
        tenant_leases = self._by_tenant[lease.tenant]
        while self.charged_bytes(lease.tenant) > self.max_bytes_per_tenant:
            oldest = next(iter(tenant_leases.values()))
            if oldest is lease:
                self._cut(lease, self.max_bytes_per_tenant // self.block_bytes)
                break
            self._give_way(oldest)
        while self.charged_bytes() > self.max_bytes:
            oldest = next(iter(self._leases.values()))
            if oldest is lease:
                self._cut(lease, self.max_bytes // self.block_bytes)
                break
            self._give_way(oldest)

    def _give_way(self, lease: _Lease) -> None:
        self.cap_evicted_leases += 1
        self._drop(lease)
        self._change.gave_way.append(lease.lease_id)

    def _cut(self, lease: _Lease, num_keys: int) -> None:
        """Keep the lease's first ``num_keys`` keys (it is alone, so they are its charge)."""
        self._remove_keys(lease, lease.keys[num_keys:])
        del lease.keys[num_keys:]

    def _drop(self, lease: _Lease) -> None:
        self._remove_keys(lease, lease.keys)
        del self._leases[lease.lease_id]
        tenant_leases = self._by_tenant[lease.tenant]
        del tenant_leases[lease.lease_id]
        if not tenant_leases:
            del self._by_tenant[lease.tenant]

    def _add_keys(self, lease: _Lease, keys: list[BlockKey]) -> None:
        if not keys:
            return
        counts = self._tenant_keys.setdefault(lease.tenant, {})
        for key in keys:
            self._touch(key)
            self._key_leases.setdefault(key, set()).add(lease.lease_id)
            counts[key] = counts.get(key, 0) + 1
        lease.keys.extend(keys)

    def _remove_keys(self, lease: _Lease, keys: list[BlockKey]) -> None:
        if not keys:
            return
        counts = self._tenant_keys[lease.tenant]
        for key in keys:
            self._touch(key)
            holders = self._key_leases[key]
            holders.discard(lease.lease_id)
            if not holders:
                del self._key_leases[key]
            if counts[key] == 1:
                del counts[key]
            else:
                counts[key] -= 1
        if not counts:
            del self._tenant_keys[lease.tenant]

    def _touch(self, key: BlockKey) -> None:
        if key not in self._touched:
            self._touched[key] = key in self._key_leases

    def _begin(self) -> LeaseChange:
        assert not self._touched, "lease calls do not nest"
        self._change = LeaseChange()
        return self._change

    def _end(self, change: LeaseChange) -> LeaseChange:
        for key, was_leased in self._touched.items():
            if was_leased != (key in self._key_leases):
                (change.unleased if was_leased else change.leased).append(key)
        self._touched = {}
        return change
