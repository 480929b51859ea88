"""The simulated KV caches: each instance's device cache, each node's host and disk tiers, and the
index of which instance and node holds which block (the conductor's KV index, always current).

Block keys are the trace's hash ids (as bytes). Eviction is LRU over leaves: a request's keys are touched
leaf first and root last, so an ancestor is always at least as recent as its descendants and goes
only after all of them (the store's rule; the shared trunk outlives the twigs). Blocks in use by a
running prefill or decode are pinned and never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

BlockKey = Hashable
"""A block key: the simulation uses the trace's hash ids as 8 bytes; tests use strings."""

UNLIMITED = 1 << 62
"""A capacity no trace reaches (blocks)."""

_EMPTY: frozenset[int] = frozenset()


def _discard(tier: dict[BlockKey, set[int]], key: BlockKey, holder: int) -> None:
    holders = tier[key]
    if len(holders) == 1:
        del tier[key]
    else:
        holders.remove(holder)


class BlockIndex:
    """Key → holders, per tier: instance indexes for device caches, node indexes for host and disk.

    ``leading_runs`` answers the question the conductor's index answers for ``prefix_hits``.
    """

    def __init__(self, node_of_instance: Sequence[BlockKey], instances_of_node: Sequence[Sequence[BlockKey]]) -> None:
        self.device: dict[BlockKey, set[int]] = {}
        self.host: dict[BlockKey, set[int]] = {}
        self.disk: dict[BlockKey, set[int]] = {}
        self._node_of = node_of_instance
        self._instances_of = instances_of_node

    def leading_runs(self, keys: Sequence[BlockKey]) -> dict[int, list[int]]:
        """For every instance holding ``keys[0]`` in some tier: [device, host, disk] block counts of
        its leading run (each block counted in the fastest tier that instance reaches it in:
        its own device cache, else its node's host tier, else its node's disk tier).

        Walks each holding device cache and each holding node store once, not each instance: the
        run of an instance is the longer of its device run and its node's run, because both sets
        are closed under prefixes (a block is only ever inserted, touched or pinned together with
        its whole prefix, and eviction goes leaf first), so their union meets a key chain in a
        prefix. ``leading_run`` walks one instance block by block; the tests hold them equal.
        """
        if not keys:
            return {}
        device, host, disk = self.device, self.host, self.disk
        first = keys[0]
        runs: dict[int, list[int]] = {}
        for i in device.get(first, _EMPTY):
            n = 1
            for key in keys[1:]:
                holders = device.get(key)
                if holders is None or i not in holders:
                    break
                n += 1
            runs[i] = [n, 0, 0]
        for node in host.get(first, _EMPTY) | disk.get(first, _EMPTY):
            tiers = []  # 1: host, 2: disk, per block of the node's run
            for key in keys:
                holders = host.get(key)
                if holders is not None and node in holders:
                    tiers.append(1)
                    continue
                holders = disk.get(key)
                if holders is not None and node in holders:
                    tiers.append(2)
                    continue
                break
            node_len = len(tiers)
            for i in self._instances_of[node]:
                counts = runs.get(i)
                device_len = counts[0] if counts is not None else 0
                if device_len >= node_len:
                    continue
                tail = tiers[device_len:]
                num_host = tail.count(1)
                runs[i] = [device_len, num_host, len(tail) - num_host]
        return runs

    def leading_run(self, instance: int, keys: Sequence[BlockKey]) -> tuple[int, int, int]:
        """(device, host, disk) blocks of one instance's leading run of ``keys``."""
        node = self._node_of[instance]
        num_device = num_host = num_disk = 0
        for key in keys:
            if instance in self.device.get(key, _EMPTY):
                num_device += 1
            elif node in self.host.get(key, _EMPTY):
                num_host += 1
            elif node in self.disk.get(key, _EMPTY):
                num_disk += 1
            else:
                break
        return num_device, num_host, num_disk


class DeviceCache:
    """One instance's device KV cache: pinned blocks (in use), unpinned blocks (the prefix cache,
    LRU over leaves) and private blocks (a running sequence's generated tokens, never shared).

    ``can_acquire``/``acquire`` pin a request's keys (inserting the absent ones) and reserve its
    private blocks, evicting unpinned blocks as needed; ``release`` undoes one ``acquire``.
    """

    def __init__(self, capacity_blocks: int, owner: int, index: BlockIndex) -> None:
        assert capacity_blocks > 0
        self.capacity_blocks = capacity_blocks
        self._owner = owner
        self._index = index
        self._unpinned: OrderedDict[BlockKey, None] = OrderedDict()
        self._pin_counts: dict[BlockKey, int] = {}
        self._pending: set[BlockKey] = set()
        """Pinned keys still being computed here (``acquire(visible=False)``): not yet held."""
        self.num_private_blocks = 0
        self.num_evicted_blocks = 0

    def __contains__(self, key: BlockKey) -> bool:
        return (key in self._pin_counts and key not in self._pending) or key in self._unpinned

    @property
    def num_cached_blocks(self) -> int:
        return len(self._unpinned) + len(self._pin_counts)

    @property
    def num_used_blocks(self) -> int:
        """Blocks in use: pinned plus private (vLLM's KV usage)."""
        return len(self._pin_counts) + self.num_private_blocks

    def can_acquire(self, keys: Sequence[BlockKey], num_private_blocks: int) -> bool:
        pins = self._pin_counts
        num_new_pins = sum(1 for key in keys if key not in pins)
        return len(pins) + num_new_pins + self.num_private_blocks + num_private_blocks <= self.capacity_blocks

    def acquire(self, keys: Sequence[BlockKey], num_private_blocks: int, visible: bool = True) -> None:
        """Pin ``keys`` and reserve the private blocks. With ``visible`` False the keys this cache
        did not hold are being computed here: pinned (their memory is taken) but neither in the
        index nor ``in`` this cache until ``publish`` (a prefill's blocks exist once it ends)."""
        pins, unpinned, device, owner = self._pin_counts, self._unpinned, self._index.device, self._owner
        for key in keys:
            count = pins.get(key)
            if count is not None:
                pins[key] = count + 1
            else:
                pins[key] = 1
                if key in unpinned:
                    del unpinned[key]
                elif not visible:
                    self._pending.add(key)
                else:
                    holders = device.get(key)
                    if holders is None:
                        device[key] = {owner}
                    else:
                        holders.add(owner)
        self.num_private_blocks += num_private_blocks
        assert len(pins) + self.num_private_blocks <= self.capacity_blocks, "acquire without can_acquire"
        overflow = len(pins) + len(unpinned) + self.num_private_blocks - self.capacity_blocks
        if overflow > 0:
            self._evict(overflow)

    def publish(self, keys: Sequence[BlockKey]) -> None:
        """The prefill computing the pending ones of ``keys`` has ended: they enter the index."""
        pending, device, owner = self._pending, self._index.device, self._owner
        for key in keys:
            if key in pending:
                pending.remove(key)
                holders = device.get(key)
                if holders is None:
                    device[key] = {owner}
                else:
                    holders.add(owner)

    def insert(self, keys: Sequence[BlockKey]) -> None:
        """Hold ``keys`` (a whole chain, root first) unpinned and most recent, leaf first, evicting
        the least recent unpinned blocks to make room. For an instance that runs one request at a
        time (a prefill instance), which has nothing to pin its blocks against."""
        pins, unpinned, device, owner = self._pin_counts, self._unpinned, self._index.device, self._owner
        assert len(keys) + len(pins) + self.num_private_blocks <= self.capacity_blocks
        for key in reversed(keys):
            if key in unpinned:
                unpinned.move_to_end(key)
            elif key not in pins:
                unpinned[key] = None
                holders = device.get(key)
                if holders is None:
                    device[key] = {owner}
                else:
                    holders.add(owner)
        overflow = len(pins) + len(unpinned) + self.num_private_blocks - self.capacity_blocks
        if overflow > 0:
            self._evict(overflow)

    def _evict(self, num_blocks: int) -> None:
        unpinned, device, owner = self._unpinned, self._index.device, self._owner
        for _ in range(num_blocks):
            key, _ = unpinned.popitem(last=False)
            holders = device[key]
            if len(holders) == 1:
                del device[key]
            else:
                holders.remove(owner)
        self.num_evicted_blocks += num_blocks

    def release(self, keys: Sequence[BlockKey], num_private_blocks: int) -> None:
        """Unpin, leaf first, so the root ends most recent."""
        pins, unpinned = self._pin_counts, self._unpinned
        for key in reversed(keys):
            count = pins[key]
            if count == 1:
                assert key not in self._pending, "released a block still being computed"
                del pins[key]
                unpinned[key] = None
            else:
                pins[key] = count - 1
        self.num_private_blocks -= num_private_blocks
        assert self.num_private_blocks >= 0

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark unpinned ``keys`` (a whole chain, root first) as just used, leaf first."""
        unpinned = self._unpinned
        for key in reversed(keys):
            if key in unpinned:
                unpinned.move_to_end(key)

    def leading_run(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            if key not in self:
                break
            n += 1
        return n

    def check_invariants(self) -> None:
        assert not (self._pin_counts.keys() & self._unpinned.keys())
        assert all(count > 0 for count in self._pin_counts.values())
        assert self.num_cached_blocks + self.num_private_blocks <= self.capacity_blocks
        assert self._pending <= self._pin_counts.keys(), "a pending block lost its pin"
        for key in list(self._pin_counts) + list(self._unpinned):
            if key in self._pending:
                assert self._owner not in self._index.device.get(key, _EMPTY)
            else:
                assert self._owner in self._index.device[key]

    def lru_order(self) -> list[BlockKey]:
        """Unpinned keys, next to be evicted first (for tests)."""
        return list(self._unpinned)


class NodeStore:
    """One node's KV store: a host DRAM tier and a disk tier, each LRU over leaves.

    ``put`` writes a request's blocks (new ones to host; disk hits promote back to host); a host
    eviction demotes to disk, a disk eviction drops the block. A block is in at most one tier.
    """

    def __init__(self, node: int, host_capacity_blocks: int, disk_capacity_blocks: int,
                 index: BlockIndex) -> None:
        self._node = node
        self.host_capacity_blocks = host_capacity_blocks
        self.disk_capacity_blocks = disk_capacity_blocks
        self._index = index
        self._host: OrderedDict[BlockKey, None] = OrderedDict()
        self._disk: OrderedDict[BlockKey, None] = OrderedDict()
        self.num_dropped_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self._host) + len(self._disk)

    def put(self, keys: Sequence[BlockKey], insert_absent: bool = True) -> None:
        """Touch (leaf first) every key held here, promoting disk blocks to host, and with
        ``insert_absent`` write the others to host; then evict down to capacity. ``keys`` is a
        whole chain from its root (touching a chain's tail alone would break leaf-first order)."""
        host, disk, node = self._host, self._disk, self._node
        host_index, disk_index = self._index.host, self._index.disk
        for key in reversed(keys):
            if key in host:
                host.move_to_end(key)
                continue
            if key in disk:
                del disk[key]
                holders = disk_index[key]
                if len(holders) == 1:
                    del disk_index[key]
                else:
                    holders.remove(node)
            elif not insert_absent:
                continue
            host[key] = None
            holders = host_index.get(key)
            if holders is None:
                host_index[key] = {node}
            else:
                holders.add(node)
        while len(host) > self.host_capacity_blocks:
            key, _ = host.popitem(last=False)
            holders = host_index[key]
            if len(holders) == 1:
                del host_index[key]
            else:
                holders.remove(node)
            if self.disk_capacity_blocks > 0:
                disk[key] = None
                holders = disk_index.get(key)
                if holders is None:
                    disk_index[key] = {node}
                else:
                    holders.add(node)
            else:
                self.num_dropped_blocks += 1
        while len(disk) > self.disk_capacity_blocks:
            key, _ = disk.popitem(last=False)
            _discard(disk_index, key, node)
            self.num_dropped_blocks += 1

    def host_order(self) -> list[BlockKey]:
        return list(self._host)

    def disk_order(self) -> list[BlockKey]:
        return list(self._disk)

    def check_invariants(self) -> None:
        assert not (self._host.keys() & self._disk.keys())
        assert len(self._host) <= self.host_capacity_blocks
        assert len(self._disk) <= self.disk_capacity_blocks
        for key in self._host:
            assert self._node in self._index.host[key]
        for key in self._disk:
            assert self._node in self._index.disk[key]
