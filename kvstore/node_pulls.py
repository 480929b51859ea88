"""Pulls: a store node reading blocks it lacks from another node's block server into its own
host tier (``KVStoreNode.pull`` and ``execute``, the transfer plan's execution).

Whoever knows where the blocks are decides the source (``TransferPlan``); the node reads the
blocks after its own leading run over the transfer engine into reserved slots, and commits
what arrived whole. The source's leases on the pulled blocks come with them (same id, tenant and
remaining TTL; joined to the lease if this node holds it already; a lease naming the first block
read covers the leading blocks this node already had, as on the source). A pull fails soft (``PullResult.error``): the rest is recomputed.

A mixin of ``kvstore.node.KVStoreNode``, whose ``__init__`` sets the attributes declared below
and whose ``_commit`` and lock it uses. Its messages are logged as the node's.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Callable, Sequence

import msgspec

from kvstore.block_store import BlockStore
from kvstore.config import KVStoreConfig
from kvstore.disk_tier import DiskTier
from kvstore.host_arena import HostArena
from kvstore.keys import BlockKey
from kvstore.metadata import BlockDirectory
from kvstore.transfer_server import BlockServer, PeerAddress
from kvstore.transfer_wire import TransferError

if TYPE_CHECKING:
    import threading

    from kvstore.transfer import TransferClient

log = logging.getLogger("kvstore.node")  # the node's logger: operators and tests read it there


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


class NodePulls:
    """``KVStoreNode``'s pulls from other nodes."""

    node_id: str
    _config: KVStoreConfig
    _lock: threading.RLock
    arena: HostArena
    disk: DiskTier | None
    store: BlockStore
    _directory: BlockDirectory | None
    _transfer_client: TransferClient | None
    _warned_no_transfer: bool
    pulled_blocks: int
    pulled_bytes: int
    pull_failures: int
    _crash_mid_pull: bool
    transfer_server: BlockServer | None
    _commit: Callable[..., None]  # kvstore.node.KVStoreNode._commit, under the lock
    _extend_lease: Callable[[str, str, Sequence[BlockKey], float], None]  # kvstore.node_leases
    _expire_leases: Callable[[], None]

    def crash_mid_pull(self) -> None:
        """Drill hook (``baton chaos``): this node's process dies without a word (SIGKILL) in
        the middle of the next pull it takes part in. As the reader: once the blocks arrived in
        the slots it reserved, before any is committed. As the source: with half of a streamed
        reply's blocks sent (``BlockServer.die_mid_stream``)."""
        self._crash_mid_pull = True
        if self.transfer_server is not None:
            self.transfer_server.die_mid_stream = True

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
            self._expire_leases()
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
        if self._crash_mid_pull:
            log.warning("store node %s: dying mid-pull (%d blocks from %s read, none committed), "
                        "as the drill asked", self.node_id, got, source)
            os.kill(os.getpid(), signal.SIGKILL)
        with self._lock:
            for grant in result.leases:  # the lease travels with its blocks
                # a lease names a prompt's leading blocks, and a key names its whole chain:
                # one naming the first block read names the blocks this node had before it too
                local = keys[:num_local] if 0 in grant.block_indices else []
                self._extend_lease(grant.lease_id, grant.tenant,
                                   local + [wanted[i] for i in grant.block_indices if i < got],
                                   grant.ttl_s)
            self._checksums.update(zip(wanted[:got], result.checksums))  # verified: reused
            self._commit(wanted[:got], pulled=True)
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
