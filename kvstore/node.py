"""The store node: one Ray actor per machine that owns the host tier's slot bookkeeping.

Workers on the node ask it which slot to write or read (``reserve``/``commit``,
``acquire``/``release``) and move the bytes themselves through the shared arena. The node also
records in Redis which blocks it holds, so any process in the cluster can find them, and, when
``config.transfer`` is set, serves its blocks to other nodes (``kvstore.transfer_server``) from a
second thread: every public method takes the node's lock.
"""

from __future__ import annotations

import logging
import os
import functools
import threading
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import msgspec

from kvstore.block_store import BlockStore, StoreStats
from kvstore.config import KVStoreConfig
from kvstore.disk_tier import DiskTier
from kvstore.events import MEDIUM_DISK, MEDIUM_HOST, BlockRemoved, BlockStored, StoreEventPublisher
from kvstore.metadata import BlockDirectory
from kvstore.host_arena import HostArena
from kvstore.keys import BlockKey
from kvstore.transfer_server import BlockServer, PeerAddress, PinnedRun
from kvstore.transfer_wire import TransferError, block_checksum
from protos.wire import TierCounters

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


class ArenaInfo(msgspec.Struct, frozen=True):
    path: str
    slot_bytes: int
    num_slots: int


NO_TRANSFER = "this node has no transfer engine (kvstore.transfer) or no Redis"


class PullResult(msgspec.Struct, frozen=True):
    """What ``KVStoreNode.pull`` did for one request's keys."""

    num_local: int
    """Leading blocks this node held (host or disk) before the pull."""
    num_pulled: int
    """Blocks read from ``source`` into this node's host tier, verified and committed."""
    source: str = ""
    """The node they came from ('' when nothing was pulled)."""
    path: str = ""
    seconds: float = 0.0
    error: str = ""
    """Why the pull stopped short, if it did: the rest is recomputed."""


class TransferPlan(msgspec.Struct, frozen=True):
    """What one pull brings to a node, decided before it by whoever knows where the blocks are
    (the conductor's placement names the node a prefill pulls a prefix from; a decode pulls
    from the node its prefill ran on): the store executes it and does not choose again."""

    source_node: str
    keys: tuple[BlockKey, ...]
    """The prompt's leading blocks to have locally, in chain order (those already here are
    not read)."""


class KVStoreNode:
    """Host-tier owner for one node. Methods are called through Ray, one at a time."""

    def __init__(
        self,
        node_id: str,
        cluster_name: str,
        config: KVStoreConfig,
        block_bytes: int,
        redis_url: str | None,
        block_size_tokens: int = 0,
    ) -> None:
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
        self.store = BlockStore(num_slots, on_evict=self._demote)
        self.promoted_blocks = 0
        self._checksums: dict[BlockKey, int] = {}  # of served blocks, until evicted
        self.demoted_blocks = 0
        self._directory: BlockDirectory | None = None
        self._soft_pin_keys: set[BlockKey] = set()  # operator-pinned prefixes' blocks
        self._transfer_client = None  # created at the first pull
        self._warned_no_transfer = False
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
    def acquire(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pin and return the slots of the leading run of ``keys`` in host memory, first
        promoting the blocks that continue that run on disk (a disk hit is copied back to host;
        a block that fails its checksum is a miss and ends the run)."""
        if self.disk is not None:
            self._promote(keys)
        return self.store.acquire(keys)

    @_locked
    def release(self, keys: Sequence[BlockKey]) -> None:
        self.store.release(keys)

    @_locked
    def reserve(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> list[int | None]:
        return self.store.reserve(keys, parents).slots  # evictions were published by _demote

    @_locked
    def commit(self, keys: Sequence[BlockKey]) -> None:
        self.store.commit(keys)
        self._apply_soft_pins(keys)
        self._record(stored_host=keys)
        self._record_disk_removals()

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
    def abort(self, keys: Sequence[BlockKey]) -> None:
        self.store.abort(keys)

    @_locked
    def stats(self) -> StoreStats:
        return self.store.stats()

    @_locked
    def tier_counters(self) -> TierCounters:
        """Blocks moved between tiers, and the disk tier's own counters."""
        stats = self.store.stats()
        counters = TierCounters(
            promoted_blocks=self.promoted_blocks, demoted_blocks=self.demoted_blocks,
            host_full_rejected_blocks=stats.reserve_rejected_blocks,
            soft_pinned_blocks=stats.soft_pinned_blocks, pulled_blocks=self.pulled_blocks,
            pulled_bytes=self.pulled_bytes, pull_failures=self.pull_failures)
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
        checksums = []
        for key, slot in zip(served, slots):
            # a READY block's bytes never change until it is evicted (which drops this entry),
            # so it is hashed once, at its first serve, not on every send
            checksum = self._checksums.get(key)
            if checksum is None:
                checksum = self._checksums[key] = block_checksum(self.arena.slot(slot).numpy())
            checksums.append(checksum)
        from_disk = [i >= num_in_host for i in range(len(slots))]
        return PinnedRun(keys=served, slots=slots, from_disk=from_disk, checksums=checksums)

    def pull(self, keys: Sequence[BlockKey], source_node: str | None = None) -> PullResult:
        """Make the leading run of ``keys`` local. With ``source_node`` that is a transfer plan,
        executed exactly (``execute``). Without one, the blocks after those this node holds are
        read from the node that holds the longest run of them, per Redis (for callers with no
        plan: drills, operators). Fails soft like ``execute``."""
        if source_node:
            return self.execute(TransferPlan(source_node, tuple(keys)))
        keys = list(keys)
        num_local, refused = self._pull_start(keys)
        if refused is not None:
            return refused
        try:
            source, run, address = self._choose_source(keys[num_local:])
        except Exception as exc:  # noqa: BLE001 - Redis down: recompute, say why
            log.warning("pull: cannot look up block holders in Redis: %s", exc)
            return self._failed_pull(num_local, f"Redis lookup failed: {exc}")
        if not run:
            return PullResult(num_local, 0, error="no live node holds the next block")
        return self._read_run(keys[:num_local + run], num_local, source, address)

    def execute(self, plan: TransferPlan) -> PullResult:
        """Make ``plan.keys`` local exactly as planned: the blocks after those this node holds
        are read from ``plan.source_node`` over the transfer engine, verified, and committed to
        this node's host tier, where the engines' connectors load them like any local block. No
        other node is asked and no holder is looked up (the plan's maker knew where they are); a
        source that no longer holds them all yields the run it still has.

        Never raises for a missing, dead or corrupting peer, a full arena or Redis trouble: the
        result says how far it got and why it stopped, and the rest is recomputed. The network
        read runs without the node's lock, so the connectors' calls go on meanwhile; the slots
        being filled are reserved (WRITING), so no one reads or evicts them half-written."""
        keys = list(plan.keys)
        num_local, refused = self._pull_start(keys)
        if refused is not None:
            return refused
        source = plan.source_node
        if source == self.node_id:
            return PullResult(num_local, 0, error=f"the plan's source is this node ({source})")
        try:
            encoded = self._directory.transfer_addresses().get(source)
        except Exception as exc:  # noqa: BLE001 - Redis down: recompute, say why
            log.warning("pull: cannot look up node %s's transfer address in Redis: %s", source, exc)
            return self._failed_pull(num_local, f"Redis lookup failed: {exc}", source)
        if encoded is None:
            return PullResult(num_local, 0, source, error=f"node {source} has no transfer address "
                              "in Redis (it is gone, or serves no transfers)")
        address = msgspec.json.decode(encoded, type=PeerAddress)
        return self._read_run(keys, num_local, source, address)

    def _pull_start(self, keys: list[BlockKey]) -> tuple[int, PullResult | None]:
        """The leading run of ``keys`` held here, and the result to return at once when nothing
        is to be pulled or this node cannot pull."""
        with self._lock:
            num_local = self._local_run(keys)
        if num_local == len(keys):
            return num_local, PullResult(num_local, 0)
        if self._directory is None or self._config.transfer is None:
            if not self._warned_no_transfer:
                self._warned_no_transfer = True
                log.warning("a request's KV is on another node, but %s: it is recomputed here. "
                            "Set kvstore.transfer to pull it instead.", NO_TRANSFER)
            return num_local, PullResult(num_local, 0, error=NO_TRANSFER)
        return num_local, None

    def _read_run(self, keys: list[BlockKey], num_local: int, source: str,
                  address: PeerAddress) -> PullResult:
        """Read ``keys[num_local:]`` from ``source`` into reserved host slots, and commit what
        arrived whole (the run up to the first block that did not)."""
        wanted = keys[num_local:]
        parents = [keys[num_local - 1] if num_local else None, *wanted[:-1]]
        with self._lock:
            slots = self.store.reserve(wanted, parents).slots
        num_slots = next((i for i, slot in enumerate(slots) if slot is None), len(slots))
        if num_slots < len(wanted):
            # full of pinned blocks, or another pull is writing these: keep what fits
            log.warning("pull: room for %d of %d blocks from %s (host arena full of pinned "
                        "blocks, or another pull is writing them); the rest is recomputed",
                        num_slots, len(wanted), source)
            with self._lock:
                self.store.abort([k for k, s in zip(wanted[num_slots:], slots[num_slots:])
                                  if s is not None])
            wanted = wanted[:num_slots]
        if not wanted:
            return PullResult(num_local, 0, error="no free host slot (or the blocks are being "
                              "written by another pull)")
        try:
            result = self._client().read(address, wanted,
                                         [self.arena.slot(s) for s in slots[:len(wanted)]])
        except (TransferError, OSError) as exc:
            with self._lock:
                self.store.abort(wanted)
            log.warning("pull of %d blocks from node %s failed: %s", len(wanted), source, exc)
            return self._failed_pull(num_local, str(exc), source)
        got = result.num_blocks
        with self._lock:
            self.commit(wanted[:got])
            self.store.abort(wanted[got:])
            self.pulled_blocks += got
            self.pulled_bytes += got * self.arena.slot_bytes
        error = ""
        if result.corrupt_blocks:
            error = f"{result.corrupt_blocks} block(s) from {source} failed their checksum"
        elif got < len(wanted):
            error = f"node {source} no longer held {len(wanted) - got} of the blocks"
        return PullResult(num_local, got, source, result.path, result.seconds, error)

    def _local_run(self, keys: Sequence[BlockKey]) -> int:
        """Leading blocks held here: in host memory, then continuing on disk."""
        run = self.store.match_prefix(keys)
        if self.disk is not None:
            while run < len(keys) and self.disk.contains(keys[run]):
                run += 1
        return run

    def _choose_source(self, wanted: Sequence[BlockKey]) -> tuple[str, int, PeerAddress | None]:
        """The live peer holding the longest leading run of ``wanted`` (ties: the first listed)."""
        holders = self._directory.locate(wanted)
        addresses = self._directory.transfer_addresses()
        runs: dict[str, int] = {}
        for node in holders[0] if holders else {}:
            if node == self.node_id or node not in addresses:
                continue
            run = 0
            while run < len(wanted) and node in holders[run]:
                run += 1
            runs[node] = run
        if not runs:
            return "", 0, None
        source = max(runs, key=runs.__getitem__)
        address = msgspec.json.decode(addresses[source], type=PeerAddress)
        return source, runs[source], address

    def _client(self):
        if self._transfer_client is None:
            from kvstore.transfer import TransferClient

            self._transfer_client = TransferClient(self._config.transfer, self.node_id)
        return self._transfer_client

    def _failed_pull(self, num_local: int, error: str, source: str = "") -> PullResult:
        with self._lock:
            self.pull_failures += 1
        return PullResult(num_local, 0, source, error=error)

    def _demote(self, key: BlockKey, parent: BlockKey | None, slot: int) -> None:
        """BlockStore eviction hook: the slot still holds the block; copy it to disk first."""
        self._checksums.pop(key, None)
        if self.disk is not None and self.disk.put(key, parent, self.arena.slot(slot)):
            self.demoted_blocks += 1
            self._record(removed_host=[key], stored_disk=[(key, parent)])
        else:
            self._record(removed_host=[key])

    def _promote(self, keys: Sequence[BlockKey]) -> None:
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
            self.promoted_blocks += 1
            self._record(stored_host=[key])
        self._record_disk_removals()

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
            self._publish_failing = True
        else:
            self._publish_failing = False

    def _record_disk_removals(self) -> None:
        if self.disk is not None:
            self._record(removed_disk=self.disk.drain_removed_keys())

    def _heartbeat_forever(self, directory: BlockDirectory, config: KVStoreConfig) -> None:
        """Renew this node's liveness and remove the entries of nodes that stopped doing so."""
        while not self._stop_heartbeat.wait(config.heartbeat_interval_s):
            try:
                if not self._registered or not directory.heartbeat(self.node_id,
                                                                   config.heartbeat_ttl_s):
                    self._reregister(directory, config)
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
        directory.register(self.node_id, str(self.arena.path), config.heartbeat_ttl_s)
        if self.transfer_server is not None:
            directory.set_transfer_address(self.node_id, msgspec.json.encode(self.transfer_address()))
        for start in range(0, len(host), 1024):
            directory.publish(self.node_id, stored=host[start:start + 1024], tier="host")
        for start in range(0, len(disk), 1024):
            directory.publish(self.node_id, stored=disk[start:start + 1024], tier="disk")
        self._registered = self._registered_once = True
        log.log(logging.INFO if reason == "started" else logging.WARNING,
                "store node %s registered in Redis (%s) with %d host and %d disk blocks",
                self.node_id, reason, len(host), len(disk))

    def shutdown(self) -> None:
        self._stop_heartbeat.set()
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
