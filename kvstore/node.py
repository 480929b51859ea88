"""The store node: one Ray actor per machine that owns the host tier's slot bookkeeping.

Workers on the node ask it which slot to write or read (``reserve``/``commit``,
``acquire``/``release``) and move the bytes themselves through the shared arena. The node also
records in Redis which blocks it holds, so any process in the cluster can find them, and, when
``config.transfer`` is set, serves its blocks to other nodes (``kvstore.transfer_server``) from a
second thread: every public method takes the node's lock. Pulls of blocks from other nodes (a
transfer plan's execution) are ``kvstore.node_pulls``'; leases (blocks kept past plain LRU ones,
across tiers and pulls) are ``kvstore.node_leases``'.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import msgspec

from kvstore.block_store import BlockState, BlockStore, ReserveResult, StoreStats
from kvstore.config import KVStoreConfig
from kvstore.disk_tier import DiskTier
from kvstore.events import MEDIUM_DISK, MEDIUM_HOST, BlockRemoved, BlockStored, StoreEventPublisher
from kvstore.host_arena import HostArena
from kvstore.keys import BlockKey
from kvstore.leases import LeaseRegistry
from kvstore.metadata import BlockDirectory
from kvstore.node_holders import NodeHolders
from kvstore.node_leases import NodeLeases
from kvstore.node_pulls import NO_TRANSFER, NodePulls, PullResult, TransferPlan
from kvstore.transfer_server import BlockServer, PeerAddress, PinnedRun
from kvstore.transfer_wire import block_checksum
from protos.wire import TierCounters

__all__ = ["NO_TRANSFER", "AcquiredRun", "ArenaInfo", "KVStoreNode", "PullResult", "TransferPlan"]

log = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable)


def _locked(method: _F) -> _F:
    """Serialise a public method with the block server's thread."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]



def _remove_stale_arenas(folder: Path, prefix: str) -> None:
    """Delete arenas left by store nodes of this cluster whose process is gone (a crash or a
    kill -9): in /dev/shm they would hold their memory until reboot."""
    for stale in folder.glob(prefix + "*.arena"):
        try:
            pid = int(stale.stem.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("removing stale arena %s (its store process %d is gone)", stale, pid)
            stale.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            continue


def _stored(keys: list[BlockKey], parent: BlockKey | None, medium: str,
            block_size_tokens: int) -> BlockStored:
    """A store-side ``BlockStored``: the store knows keys, not tokens, so ``token_ids`` is empty."""
    return BlockStored(block_hashes=keys, parent_block_hash=parent, token_ids=[],
                       block_size=block_size_tokens, lora_id=None, medium=medium, lora_name=None)


class _DemotingStore(BlockStore):
    """The host tier, whose evictions during one ``reserve`` (or ``evict``) call reach
    ``demote`` together, before the call returns: the disk tier then writes them as one batch.
    That is safe because an evicted slot is handed out again (to a block being written) by the
    same call, but nobody writes into it before the call has returned."""

    def __init__(self, capacity_blocks: int,
                 demote: Callable[[list[tuple[BlockKey, BlockKey | None, int]]], None]) -> None:
        super().__init__(capacity_blocks, on_evict=self._collect)
        self._demote = demote
        self._evicted: list[tuple[BlockKey, BlockKey | None, int]] = []  # (key, parent, slot)

    def reserve(self, keys: Sequence[BlockKey],
                parents: Sequence[BlockKey | None]) -> ReserveResult:
        try:
            return super().reserve(keys, parents)
        finally:
            self._flush()

    def evict(self, num_blocks: int) -> list[BlockKey]:
        try:
            return super().evict(num_blocks)
        finally:
            self._flush()

    def _collect(self, key: BlockKey, parent: BlockKey | None, slot: int) -> None:
        self._evicted.append((key, parent, slot))

    def _flush(self) -> None:
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            self._demote(evicted)


class AcquiredRun(msgspec.Struct, frozen=True):
    """One lookup's answer in ``acquire_many``: the pinned slots of the leading run of its keys
    in host memory, and which of them the call brought back from the disk tier."""

    slots: list[int]
    promoted: tuple[int, ...] = ()
    """Indices into ``slots`` (the lookup's block positions) of the blocks promoted from disk."""


class ArenaInfo(msgspec.Struct, frozen=True):
    path: str
    slot_bytes: int
    num_slots: int


class KVStoreNode(NodePulls, NodeLeases, NodeHolders):
    """Host-tier owner for one node. Methods are called through Ray, one at a time."""

    def __init__(
        self,
        node_id: str,
        cluster_name: str,
        config: KVStoreConfig,
        block_bytes: int,
        redis_url: str | None,
        block_size_tokens: int = 0,
        lease_clock: Callable[[], float] = time.monotonic,
        holder_alive: Callable[[str], bool] | None = None,
    ) -> None:
        """``lease_clock`` tells lease expiry (seconds, monotonic): tests pass their own.
        ``holder_alive(name)``: whether the client process that named itself ``name`` still
        runs (``kvstore.node_holders``; the cluster passes ``ray_actor_alive``); None: a holder
        is forgotten only when told (``forget_holder``)."""
        num_slots = config.host_capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kvstore.host_capacity_bytes={config.host_capacity_bytes} holds no block of "
                f"{block_bytes} bytes; raise it"
            )
        self.node_id = node_id
        self._config = config
        self._lock = threading.RLock()
        _remove_stale_arenas(Path(config.arena_dir), f"baton-{cluster_name}-{node_id}-")
        path = Path(config.arena_dir) / f"baton-{cluster_name}-{node_id}-{os.getpid()}.arena"
        self.arena = HostArena(path, block_bytes, num_slots, create=True)
        self.disk: DiskTier | None = None
        if config.disk_dir:
            folder = Path(config.disk_dir) / f"{cluster_name}-{node_id}"
            self.disk = DiskTier(folder, config.disk_capacity_bytes, block_bytes)
        self._events: StoreEventPublisher | None = None
        if config.events_endpoint:
            self._events = StoreEventPublisher(
                config.events_endpoint, config.events_replay_endpoint, f"baton.store.{node_id}"
            )
        self._block_size_tokens = block_size_tokens
        self.store = _DemotingStore(num_slots, demote=self._demote)
        self.promoted_blocks = 0
        # XXH3s of host blocks known without hashing again (sent by their writer at commit,
        # served, or pulled and verified), until evicted: a demotion hands its block's to the
        # disk tier
        self._checksums: dict[BlockKey, int] = {}
        self.demoted_blocks = 0
        self._directory: BlockDirectory | None = None
        self._soft_pin_keys: set[BlockKey] = set()  # operator-pinned prefixes' blocks
        self._leases = LeaseRegistry(block_bytes, *config.lease_caps_bytes(), clock=lease_clock)
        self.dropped_leased_blocks = 0
        self._corrupt_budget = 0  # drill: blocks left to corrupt as they are committed
        self._init_holders(holder_alive, config.holder_sweep_interval_s)
        self._transfer_client = None  # created at the first pull
        self._warned_no_transfer = False
        self._crash_mid_pull = False  # drill: die in the middle of the next pull
        self.pulled_blocks = self.pulled_bytes = self.pull_failures = 0  # pulls from other nodes
        self._stop_heartbeat = threading.Event()
        self.transfer_server: BlockServer | None = None
        if config.transfer is not None:
            self.transfer_server = BlockServer(self, config.transfer)
            self.transfer_server.start()
        self._registered = self._registered_once = False
        self._publish_failing = False
        if redis_url and config.publish_to_redis:
            self._directory = BlockDirectory.from_url(redis_url)
            try:
                self._reregister(self._directory, config, reason="started")
            except Exception as exc:  # noqa: BLE001 - Redis down: the heartbeat registers later
                log.warning("store node %s could not register in Redis (%s); retrying at every "
                            "heartbeat", node_id, exc)
            threading.Thread(
                target=self._heartbeat_forever,
                args=(BlockDirectory.from_url(redis_url), config),
                name="baton-store-heartbeat",
                daemon=True,
            ).start()
        log.info("store node %s: %d slots of %d bytes in %s", node_id, num_slots, block_bytes, path)

    def arena_info(self) -> ArenaInfo:
        return ArenaInfo(str(self.arena.path), self.arena.slot_bytes, self.arena.num_slots)

    @_locked
    def acquire(self, keys: Sequence[BlockKey], holder: str = "") -> list[int]:
        """Pin and return the slots of the leading run of ``keys`` in host memory, first
        promoting the blocks that continue that run on disk (a disk hit is copied back to host;
        a block that fails its checksum is a miss and ends the run). ``holder``: the calling
        process's name, under which the pins are filed until released (``node_holders``)."""
        self._expire_leases()
        if self.disk is not None:
            self._promote(keys)
        slots = self.store.acquire(keys)
        self._file_acquired(holder, keys, len(slots))
        return slots

    @_locked
    def acquire_many(self, key_lists: Sequence[Sequence[BlockKey]],
                     holder: str = "") -> list[AcquiredRun]:
        """``acquire`` for several requests in one call (an engine step's new requests), each
        run with the positions of the blocks this call brought back from disk: a block one
        request's lookup promoted counts as promoted for every lookup of the call that pins it
        (their requests load it as it came up from disk in this step)."""
        self._expire_leases()
        promoted: set[BlockKey] = set()
        runs = []
        for keys in key_lists:
            if self.disk is not None:
                promoted.update(self._promote(keys))
            slots = self.store.acquire(keys)
            self._file_acquired(holder, keys, len(slots))
            runs.append(AcquiredRun(slots, tuple(
                i for i, key in enumerate(keys[:len(slots)]) if key in promoted)))
        return runs

    @_locked
    def release(self, keys: Sequence[BlockKey], holder: str = "") -> None:
        self.store.release(keys)
        self._unfile_released(holder, keys)

    @_locked
    def reserve(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None],
                holder: str = "") -> list[int | None]:
        self._expire_leases()
        slots = self.store.reserve(keys, parents).slots  # evictions were published by _demote
        self._file_reserved(holder, keys, slots)
        return slots

    @_locked
    def reserve_many(self, chains: Sequence[tuple[Sequence[BlockKey], Sequence[BlockKey | None]]],
                     holder: str = "") -> list[list[int | None]]:
        """``reserve`` for several chains in one call (an engine step's saves): each chain
        stops at its own first block that cannot be stored, as ``reserve`` does."""
        self._expire_leases()
        granted = []
        for keys, parents in chains:
            granted.append(self.store.reserve(keys, parents).slots)
            self._file_reserved(holder, keys, granted[-1])
        return granted

    @_locked
    def commit(self, keys: Sequence[BlockKey], checksums: Sequence[int] | None = None,
               holder: str = "") -> None:
        """Make written blocks readable. ``checksums[i]``, when the writer sends them, is block
        ``i``'s XXH3-64 as written: kept until the block leaves host memory, so serving it to
        a peer or demoting it to disk does not hash it (a wrong one reads as corrupt there,
        never as good bytes)."""
        if checksums is not None:
            assert len(checksums) == len(keys), "one checksum per committed block"
            self._checksums.update(zip(keys, checksums))
        self._commit(keys, holder)

    def _commit(self, keys: Sequence[BlockKey], holder: str = "", pulled: bool = False) -> None:
        """Commit under the lock; ``pulled``: blocks read from a peer (the drill's corruption
        spares them: the peer's copy is the one it corrupted)."""
        self.store.commit(keys)
        self._unfile_written(holder, keys)
        if self._corrupt_budget > 0 and not pulled:
            self._corrupt(keys[:self._corrupt_budget])
        self._apply_soft_pins(keys)
        self._mark_leased(keys)
        self._record(stored_host=keys)
        self._record_disk_removals()

    @_locked
    def corrupt_on_commit(self, num_blocks: int) -> None:
        """Drill hook, for ``baton chaos --corrupt-kv`` (the positive control of its ``wrong``
        count): invert every byte of the next ``num_blocks`` blocks committed by this node's
        workers (not those pulled from a peer), once their writer has finished, as a bad copy or
        a bad DIMM would. The host tier keeps no checksums, so a reader loads them as they are;
        only the answers can tell."""
        self._corrupt_budget += num_blocks

    def _corrupt(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            info = self.store.block_info(key)
            if info is not None:
                self.arena.slot(info.slot).bitwise_not_()
                self._checksums.pop(key, None)  # a pulled block's no longer matches
                self._corrupt_budget -= 1

    @_locked
    def set_soft_pins(self, keys: Sequence[BlockKey]) -> int:
        """Make ``keys`` (the blocks of the prefixes operators pinned, e.g. system prompts) the
        node's soft-pinned set: those present now and those stored later are evicted from host
        memory only when nothing else can be. Replaces the previous set; returns how many of
        the keys are in host memory now."""
        wanted = set(keys)
        for key in self._soft_pin_keys - wanted:
            self.store.soft_unpin_prefix([key])
        self._soft_pin_keys = wanted
        self._apply_soft_pins(list(wanted))
        return sum(key in self.store for key in wanted)

    def _apply_soft_pins(self, keys: Sequence[BlockKey]) -> None:
        if self._soft_pin_keys:
            for key in keys:
                if key in self._soft_pin_keys:
                    self.store.soft_pin_prefix([key])

    @_locked
    def abort(self, keys: Sequence[BlockKey], holder: str = "") -> None:
        self.store.abort(keys)
        self._unfile_written(holder, keys)

    @_locked
    def stats(self) -> StoreStats:
        self._expire_leases()
        return self.store.stats()

    @_locked
    def tiers(self, keys: Sequence[BlockKey]) -> list[str | None]:
        """Where this node holds each key, read-only (no pin, no LRU touch): ``"host"`` for a
        readable host-tier block, ``"disk"`` for one only on the disk tier, None when it holds
        neither. What the Redis directory should say of this node, block by block."""
        return self._tiers(keys)

    def _tiers(self, keys: Sequence[BlockKey]) -> list[str | None]:
        out: list[str | None] = []
        for key in keys:
            info = self.store.block_info(key)
            if info is not None and info.state is BlockState.READY:
                out.append("host")
            elif self.disk is not None and self.disk.contains(key):
                out.append("disk")
            else:
                out.append(None)
        return out

    @_locked
    def tier_counters(self) -> TierCounters:
        """Blocks moved between tiers, and the disk tier's own counters."""
        stats = self.store.stats()
        counters = TierCounters(
            promoted_blocks=self.promoted_blocks, demoted_blocks=self.demoted_blocks,
            host_full_rejected_blocks=stats.reserve_rejected_blocks,
            soft_pinned_blocks=stats.soft_pinned_blocks, pulled_blocks=self.pulled_blocks,
            pulled_bytes=self.pulled_bytes, pull_failures=self.pull_failures)
        leases = self.lease_stats()
        counters = msgspec.structs.replace(
            counters, leased_blocks=leases.leased_blocks, leased_bytes=leases.leased_bytes,
            lease_evictions=leases.lease_evictions)
        if self.disk is None:
            return counters
        disk = self.disk.stats()
        return msgspec.structs.replace(
            counters, disk_blocks=disk.used_blocks, disk_hits=disk.hits,
            disk_corrupt_blocks=disk.corrupt_blocks, disk_evictions=disk.evictions,
            disk_write_errors=disk.write_errors, disk_rejected_puts=disk.rejected_puts)

    def transfer_address(self) -> PeerAddress | None:
        """Where this node's block server listens (None without ``config.transfer``)."""
        return self.transfer_server.address if self.transfer_server is not None else None

    @_locked
    def pin_for_transfer(self, keys: Sequence[BlockKey]) -> PinnedRun:
        """``acquire`` for the block server, saying which blocks came up from the disk tier."""
        num_in_host = self.store.match_prefix(keys)
        slots = self.acquire(keys)
        served = list(keys[: len(slots)])
        leases = self._leases.grants_for(served)  # acquire expired the lapsed ones
        checksums = []
        for key, slot in zip(served, slots):
            # a READY block's bytes never change until it is evicted (which drops this entry),
            # so it is hashed once, at its first serve, not on every send
            checksum = self._checksums.get(key)
            if checksum is None:
                checksum = self._checksums[key] = block_checksum(self.arena.slot(slot).numpy())
            checksums.append(checksum)
        from_disk = [i >= num_in_host for i in range(len(slots))]
        return PinnedRun(keys=served, slots=slots, from_disk=from_disk, checksums=checksums,
                         leases=leases)

    def _demote(self, evicted: Sequence[tuple[BlockKey, BlockKey | None, int]]) -> None:
        """``_DemotingStore`` hook: the blocks one store call evicted, whose slots still hold
        them; copy them to disk in one ``put_many`` (blocks in adjacent disk slots go in one
        write). A leased block goes there leased, and may displace plain disk blocks; a plain
        one never displaces a leased one. A block's checksum goes along when the node knows
        it (the disk tier then does not hash it again)."""
        keys = [key for key, _, _ in evicted]
        leased = [self._leases.is_leased(key) for key in keys]
        checksums = [self._checksums.pop(key, None) for key in keys]
        stored = [False] * len(evicted)
        if self.disk is not None:
            stored = self.disk.put_many(
                [(key, parent, self.arena.slot(slot)) for key, parent, slot in evicted],
                payload_xxh3s=checksums, leased_flags=leased)
        self.demoted_blocks += sum(stored)
        self.dropped_leased_blocks += sum(is_leased and not ok
                                          for is_leased, ok in zip(leased, stored))
        self._record(removed_host=keys, stored_disk=[
            (key, parent) for (key, parent, _), ok in zip(evicted, stored) if ok])

    def _promote(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Copy the blocks that continue ``keys``' leading run in host memory from disk back to
        host, up to the first one disk lacks (or that fails its checksum); the keys promoted."""
        promoted: list[BlockKey] = []
        start = self.store.match_prefix(keys)
        for index in range(start, len(keys)):
            key = keys[index]
            if not self.disk.contains(key):
                break
            parent = keys[index - 1] if index > 0 else None
            result = self.store.reserve([key], [parent])
            slot = result.slots[0]
            if slot is None:
                break  # host memory is full of pinned blocks: serve what is there
            if not self.disk.get_into(key, self.arena.slot(slot)):
                # failed its checksum: counted and deleted by the disk tier
                self.store.abort([key])
                break
            self.store.commit([key])
            self._apply_soft_pins([key])
            self._mark_leased([key])
            self.promoted_blocks += 1
            promoted.append(key)
            self._record(stored_host=[key])
        self._record_disk_removals()
        return promoted

    def _record(
        self,
        stored_host: Sequence[BlockKey] = (),
        removed_host: Sequence[BlockKey] = (),
        stored_disk: Sequence[tuple[BlockKey, BlockKey | None]] = (),
        removed_disk: Sequence[BlockKey] = (),
    ) -> None:
        """Tell Redis and event subscribers what moved. Redis keeps one tier per node and
        block (the fastest); events say exactly which tier gained or lost it."""
        if self._events is not None:
            events: list = []
            for key in stored_host:
                info = self.store.block_info(key)
                parent = info.parent if info else None
                events.append(_stored([key], parent, MEDIUM_HOST, self._block_size_tokens))
            if removed_host:
                events.append(BlockRemoved(block_hashes=list(removed_host), medium=MEDIUM_HOST))
            events.extend(_stored([key], parent, MEDIUM_DISK, self._block_size_tokens)
                          for key, parent in stored_disk)
            if removed_disk:
                events.append(BlockRemoved(block_hashes=list(removed_disk), medium=MEDIUM_DISK))
            self._events.publish(events)
        if self._directory is None:
            return
        try:
            self._directory.publish(self.node_id, stored=stored_host, tier="host")
            demoted = [key for key, _ in stored_disk]
            self._directory.publish(self.node_id, stored=demoted, tier="disk")
            dropped = [k for k in removed_host if k not in demoted]
            dropped += [k for k in removed_disk if k not in self.store]
            self._directory.publish(self.node_id, removed=dropped)
        except Exception as exc:  # noqa: BLE001 - metadata is advisory; serving goes on without it
            if not self._publish_failing:  # once per outage, not once per block
                log.warning("could not publish block metadata to Redis (%s); serving goes on, "
                            "the node re-registers when Redis is back", exc)
            self._publish_failing = True  # until the heartbeat re-registers what it holds

    def _record_disk_removals(self) -> None:
        if self.disk is not None:
            self._record(removed_disk=self.disk.drain_removed_keys())

    def _heartbeat_forever(self, directory: BlockDirectory, config: KVStoreConfig) -> None:
        """Renew this node's liveness and remove the entries of nodes that stopped doing so."""
        while not self._stop_heartbeat.wait(config.heartbeat_interval_s):
            try:
                if not directory.heartbeat(self.node_id, config.heartbeat_ttl_s):
                    self._reregister(directory, config)
                elif not self._registered or self._publish_failing:
                    # Redis kept its data but missed what this node published meanwhile
                    self._reregister(directory, config, reason="Redis was unreachable")
                for dead in directory.reap_dead_nodes():
                    log.warning("store node %s stopped heartbeating; removed its block entries", dead)
            except Exception:
                log.warning("Redis heartbeat failed; retrying", exc_info=True)

    def _reregister(self, directory: BlockDirectory, config: KVStoreConfig,
                    reason: str = "Redis had lost it (restarted or flushed?)") -> None:
        """Put this node into Redis with exactly what it holds: after a Redis restart (no
        persistence) or a flush the metadata is rebuilt by the nodes themselves, and a node
        that starts again under the same id (its process was lost) first drops the entries its
        previous process left."""
        with self._lock:
            host = self.store.ready_keys()
            disk = [k for k in self.disk.keys() if k not in self.store] if self.disk else []
        if not self._registered_once:  # drop what a previous process of this node left
            directory.deregister(self.node_id)
        self._registered = False
        # the blocks first, the node last: a node the directory lists has all its blocks there
        for start in range(0, len(host), 1024):
            directory.publish(self.node_id, stored=host[start:start + 1024], tier="host")
        for start in range(0, len(disk), 1024):
            directory.publish(self.node_id, stored=disk[start:start + 1024], tier="disk")
        if self.transfer_server is not None:
            directory.set_transfer_address(self.node_id, msgspec.json.encode(self.transfer_address()))
        directory.register(self.node_id, str(self.arena.path), config.heartbeat_ttl_s)
        with self._lock:
            self._reconcile(directory, [*host, *disk], ["host"] * len(host) + ["disk"] * len(disk))
        self._registered = self._registered_once = True
        self._publish_failing = False
        log.log(logging.INFO if reason == "started" else logging.WARNING,
                "store node %s registered in Redis (%s) with %d host and %d disk blocks",
                self.node_id, reason, len(host), len(disk))

    def _reconcile(self, directory: BlockDirectory, published: Sequence[BlockKey],
                   tiers: Sequence[str]) -> None:
        """Under the lock, after ``published`` went out at ``tiers`` without it: put right what
        moved meanwhile (a block evicted or demoted had its change published, then overwritten
        by the snapshot's), and drop every entry of this node it does not hold (removals that
        failed while Redis was unreachable, which a Redis that kept its data still has)."""
        now = self._tiers(published)
        for tier in ("host", "disk"):
            directory.publish(self.node_id, tier=tier, stored=[
                key for key, was, is_ in zip(published, tiers, now) if is_ == tier and was != tier])
        held = set(self.store.ready_keys())
        if self.disk is not None:
            held.update(self.disk.keys())
        stale = directory.node_block_keys(self.node_id) - held
        directory.publish(self.node_id, removed=sorted(stale))

    def shutdown(self) -> None:
        self._stop_heartbeat.set()
        self._stop_sweep.set()
        if self._transfer_client is not None:
            self._transfer_client.close()
        if self.transfer_server is not None:
            self.transfer_server.close()  # unpins what in-flight sends held
        if self._events is not None:
            self._events.close()
        if self._directory is not None:
            try:
                self._directory.deregister(self.node_id)
            except Exception:
                log.warning("could not deregister from Redis", exc_info=True)
        if self.disk is not None:
            with self._lock:  # no disk read or write is in flight when its file closes
                self.disk.close()
        self.arena.close()
        self.arena.unlink()
