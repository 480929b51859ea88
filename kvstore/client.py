"""A worker's handle on its node's KV store: control calls to the store actor, data through
the shared-memory arena.

The store actor (``kvstore.node.KVStoreNode``) decides which slot holds which block; the client
only moves bytes into and out of those slots. vLLM calls the connector from its (synchronous)
scheduler and model runner, so a call whose answer decides what the engine does next waits for
it (``acquire``); the others do not wait where they are made:

- ``reserve_later`` is sent before the forward pass and answered by the time its KV is copied;
- ``commit_later`` is awaited before this client's next grant (read-your-writes: a chunk's
  parents, a prefix it stored itself) and by whoever hands the blocks to another process
  (``unsettled_commits``: the prefill worker, before its result returns);
- ``release``, ``abort``, ``lease`` and ``release_lease`` are never awaited. Their answers (and the commits') are looked at
  during later calls, so a store found gone detaches the client as a waited call would.

Nothing here depends on Ray running one caller's calls in order: a call that must see an
earlier one's effect waits for that one's answer first.

The store node can die (its process killed, its machine lost) and be replaced by a new one under
the same actor name, with a new arena file. The client outlives it:

- a call that fails because the store actor is gone, or that gets no answer within
  ``call_timeout_s``, detaches the client. While detached, ``acquire`` finds nothing (the engine
  recomputes), ``reserve`` grants no slot (the save is dropped and counted), and ``release``,
  ``commit`` and ``abort`` do nothing: the dead store's pins and reservations died with it;
- a call that finds its store dead looks the actor up again at once, and while detached each
  call does (at most every ``reattach_interval_s``): a client that was idle while the node was
  replaced moves to the new one without missing. A new store means a new arena, which the
  client maps instead of the old one (the old mapping goes once no view of it is left);
- every slot handed out is tagged with the arena it belongs to (``StoreSlots.arena_path``, which
  names one store process): a pin or reservation of a store that is gone is never released or
  committed in its successor (that would free another request's pin), and no byte is read from
  or written to a slot of the wrong arena.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from kvstore.host_arena import HostArena
from kvstore.keys import BlockKey
from kvstore.leases import LeaseInfo, check_lease
from protos.errors import StoreError
from protos.wire import CallCounts

log = logging.getLogger(__name__)

_STORE_GONE = (RayActorError, GetTimeoutError)
"""What a call to a dead, restarting or hung store actor raises (``ActorDiedError`` and
``ActorUnavailableError`` are ``RayActorError``s)."""


class StoreUnavailable(StoreError):
    """No store actor by that name answered within the attach timeout."""


@dataclass(frozen=True)
class StoreSlots:
    """Slots one store granted, and the arena they index. ``arena_path`` is '' when the client
    was detached: then nothing was granted."""

    arena_path: str
    slots: list
    promoted: tuple[int, ...] = ()
    """A lookup's answer: indices into ``slots`` of the blocks the store brought back from its
    disk tier to answer it (``KVStoreNode.acquire_many``)."""


class PendingSlots:
    """A reservation sent without waiting for its answer (``StoreClient.reserve_later``):
    ``result`` waits for it, once. Sent before the forward pass whose KV the slots will hold,
    it is normally answered by the time that KV is copied."""

    def __init__(self, client: "StoreClient | None", ref, arena_path: str, args: tuple,
                 done: StoreSlots | None = None) -> None:
        self._client, self._ref, self.arena_path = client, ref, arena_path
        self._args, self._done = args, done  # (keys, parents), to ask a new store on a loss

    def result(self) -> StoreSlots:
        """The granted slots (as ``StoreClient.reserve`` returns them)."""
        if self._done is None:
            self._done = self._client._resolve(self._ref, self.arena_path, *self._args)
            self._client = self._ref = self._args = None
        return self._done


class PendingRuns:
    """Lookups sent without waiting (``StoreClient.acquire_many_later``), one run of pinned
    slots per key list once answered. ``ready`` asks without waiting; ``result`` waits (once)."""

    def __init__(self, client: "StoreClient | None", ref, arena_path: str, key_lists: list,
                 done: list[StoreSlots] | None = None) -> None:
        self._client, self._ref, self.arena_path = client, ref, arena_path
        self._key_lists, self._done = key_lists, done  # to ask a new store on a loss

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the answer is here, waiting at most ``timeout_s`` for it."""
        if self._done is not None:
            return True
        ready, _ = ray.wait([self._ref], num_returns=1, timeout=timeout_s)
        return bool(ready)

    def result(self) -> list[StoreSlots]:
        if self._done is None:
            self._done = self._client._resolve_runs(self._ref, self.arena_path, self._key_lists)
            self._client = self._ref = self._key_lists = None
        return self._done


@dataclass
class _InFlight:
    """A call sent without waiting, until its answer is seen (``StoreClient._reap``)."""

    method: str
    ref: object
    arena_path: str
    num_keys: int
    on_lost: Callable[[int], None] | None = None
    """Told the number of keys when the call turns out to have found its store gone."""


@dataclass
class StoreClientStats:
    failed_calls: int = 0
    """Calls that found the store gone (or timed out)."""
    reattaches: int = 0
    """Times the client moved to a new store process (a new arena)."""


def _slots_of_each(arena_path: str, answers: list) -> list[StoreSlots]:
    return [StoreSlots(arena_path, slots) for slots in answers]


def _runs_of_each(arena_path: str, runs: list) -> list[StoreSlots]:
    """``acquire_many``'s answers (``AcquiredRun``s; a plain slot list from a store that does not
    say what it promoted) as ``StoreSlots``."""
    return [StoreSlots(arena_path, run) if isinstance(run, list) else
            StoreSlots(arena_path, list(run.slots), tuple(run.promoted)) for run in runs]


def _checksum_args(keys: Sequence[BlockKey], checksums: Sequence[int] | None) -> tuple:
    """The commit's arguments after its keys: none, or the blocks' XXH3s (one per key)."""
    if checksums is None:
        return ()
    assert len(checksums) == len(keys), "one checksum per committed block"
    return (list(checksums),)


def _first_run(arena_path: str, runs: list) -> StoreSlots:
    return _runs_of_each(arena_path, runs)[0]


class StoreClient:
    """Connects to the named store actor and maps its arena; survives its replacement."""

    def __init__(self, actor_name: str, namespace: str, attach_timeout_s: float = 60.0,
                 call_timeout_s: float = 30.0, reattach_interval_s: float = 0.5) -> None:
        self._actor_name = actor_name
        self._namespace = namespace
        self._call_timeout_s = call_timeout_s
        self._reattach_interval_s = reattach_interval_s
        self._lock = threading.RLock()
        self._actor = None
        self._next_attempt = 0.0
        self.arena: HostArena | None = None
        """The current (or, while detached, the last) store's arena."""
        self.stats = StoreClientStats()
        self.calls = CallCounts()
        """Every call this client made to a store actor (``kvstore.*`` and ``gcs.get_actor``)."""
        self.holder = _process_holder
        """The name the store files this client's reservations and pins under (``''``: not
        filed): the worker's instance id (``set_process_holder``)."""
        self._commits: list[_InFlight] = []  # commits sent, not yet seen answered
        self._casts: list[_InFlight] = []  # releases and aborts sent
        deadline = time.monotonic() + attach_timeout_s
        while not self._attach():
            if time.monotonic() > deadline:
                raise StoreUnavailable(
                    f"KV store actor {actor_name!r} (namespace {namespace!r}) did not answer "
                    f"within {attach_timeout_s:.0f} s: is the store node up?")
            time.sleep(reattach_interval_s)

    @property
    def arena_path(self) -> str:
        """The arena of the store the client is attached to ('' while detached)."""
        return str(self.arena.path) if self._actor is not None and self.arena is not None else ""

    @property
    def attached(self) -> bool:
        return self._actor is not None

    # ------------------------------------------------------------------ store calls

    def acquire(self, keys: Sequence[BlockKey]) -> StoreSlots:
        """Pin the leading run of ``keys`` the store holds; their slots, and which of them it
        brought back from disk (asked as a batch of one lookup, whose answer says so). Waits for
        this client's commits in flight first, so it finds what the client itself stored."""
        return self._granting("acquire_many", [list(keys)], wrap=_first_run)

    def reserve(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> StoreSlots:
        """Slots to write ``keys`` into (None where the store has no room or the block is
        already there); commit or abort them with the same ``arena_path``."""
        granted = self._granting("reserve", list(keys), list(parents))
        if not granted.arena_path:
            return StoreSlots("", [None] * len(keys))
        return granted

    def reserve_later(self, keys: Sequence[BlockKey],
                      parents: Sequence[BlockKey | None]) -> PendingSlots:
        """``reserve``, sent without waiting: the answer is awaited when the slots are needed
        (``PendingSlots.result``). Waits for this client's commits in flight first (a chunk's
        parents are the previous chunk's blocks)."""
        with self._lock:
            self._settle_commits()
            if not self._ensure_attached():
                return PendingSlots(None, None, "", (), StoreSlots("", [None] * len(keys)))
            keys, parents = list(keys), list(parents)
            self.calls.count("store.reserve", "deferred")
            ref = self._remote("reserve", keys, parents)
            return PendingSlots(self, ref, self.arena_path, (keys, parents))

    def acquire_many_later(self, key_lists: Sequence[Sequence[BlockKey]]) -> PendingRuns:
        """``acquire`` for several key lists in one call, sent without waiting: the connector's
        scheduler half sends an engine step's new lookups together and never waits on its
        scheduler thread while other sequences step. Does not wait for this client's commits
        in flight (a block committed a moment ago may be missed: recomputed, not wrong)."""
        lists = [list(keys) for keys in key_lists]
        with self._lock:
            self._reap()
            if not lists or not self._ensure_attached():
                return PendingRuns(None, None, "", lists, [StoreSlots("", [])] * len(lists))
            self.calls.count("store.acquire_many", "deferred")
            ref = self._remote("acquire_many", lists)
            return PendingRuns(self, ref, self.arena_path, lists)

    def reserve_many(self, chains: Sequence[tuple[Sequence[BlockKey], Sequence[BlockKey | None]]]
                     ) -> list[StoreSlots]:
        """``reserve`` for several chains in one round trip (an engine step's saves), waited for
        without holding the client's lock: called off the engine's step, by the connector's
        saving thread, while the step goes on using the client. Waits for this client's commits
        in flight first (a chunk's parents are the previous chunk's blocks)."""
        chains = [(list(k), list(p)) for k, p in chains]
        none = [StoreSlots("", [None] * len(k)) for k, _ in chains]
        commits = [sent.ref for sent in list(self._commits)]
        if commits:
            ray.wait(commits, num_returns=len(commits), timeout=self._call_timeout_s)
        with self._lock:
            self._reap()
            if not chains or not self._ensure_attached():
                return none
            path = self.arena_path
            self.calls.count("store.reserve_many", "deferred")
            ref = self._remote("reserve_many", chains)
        return self._answer(ref, path, "reserve_many", (chains,), _slots_of_each, none)

    def release(self, keys: Sequence[BlockKey], arena_path: str) -> None:
        """Unpin ``keys``, sent without waiting: nothing waits on an unpin (a failure means the
        store is gone, and its pins with it)."""
        self._send("release", keys, arena_path)

    def commit(self, keys: Sequence[BlockKey], arena_path: str,
               checksums: Sequence[int] | None = None) -> bool:
        """True when the store committed the blocks (False: it is gone, they are dropped).
        ``checksums[i]``, when given, is block ``i``'s XXH3-64 as written
        (``transfer_wire.block_checksum``): the store keeps it instead of hashing the block
        when it serves or demotes it."""
        return self._settling("commit", keys, arena_path, _checksum_args(keys, checksums))

    def commit_later(self, keys: Sequence[BlockKey], arena_path: str,
                     on_lost: Callable[[int], None] | None = None,
                     checksums: Sequence[int] | None = None) -> None:
        """``commit``, sent without waiting. Its answer is awaited before this client's next
        grant (``acquire``, ``reserve_later``), or by whoever must know the blocks are readable
        from other processes (``unsettled_commits``); ``on_lost(len(keys))`` when it turns out
        the store was gone (the blocks are dropped)."""
        if keys and not self._send("commit", keys, arena_path, on_lost,
                                   _checksum_args(keys, checksums)) and on_lost is not None:
            on_lost(len(keys))

    def unsettled_commits(self) -> list:
        """The ``ObjectRef``s of the commits sent and not yet seen answered: awaiting them (from
        any thread or event loop) means every block this client committed so far is readable by
        any other process (an answered commit is applied)."""
        return [sent.ref for sent in list(self._commits)]

    def abort(self, keys: Sequence[BlockKey], arena_path: str) -> None:
        """Give reserved slots back, sent without waiting."""
        self._send("abort", keys, arena_path)

    def arena_for(self, arena_path: str) -> HostArena | None:
        """The arena ``arena_path`` names, if the client still maps it: the current store's, or
        the last one's while detached (its pinned slots cannot be granted to anyone else, so
        their bytes stay valid). A path the client has not seen yet makes it look for a new
        store first. None when that arena is no longer mapped (a load from it fails)."""
        with self._lock:
            if not arena_path:
                return None
            if self.arena is None or str(self.arena.path) != arena_path:
                self._attach()
            if self.arena is not None and str(self.arena.path) == arena_path:
                return self.arena
            return None

    # ------------------------------------------------------------------ leases

    def lease(self, lease_id: str, tenant: str, keys: Sequence[BlockKey], ttl_s: float) -> None:
        """Ask the store to keep ``keys`` past plain LRU blocks for ``ttl_s`` seconds
        (``KVStoreNode.lease``: replaces the lease's keys, renews it; keys saved later are
        leased when they land), sent without waiting: no engine step waits on it. While the
        client is detached nothing is sent (the store is gone, and its blocks with it). Raises
        ``InvalidLease`` at once for an empty id or a TTL that is not positive."""
        check_lease(lease_id, ttl_s)
        keys = list(keys)
        self._cast("lease", len(keys), lease_id, tenant, keys, float(ttl_s))

    def lease_now(self, lease_id: str, tenant: str, keys: Sequence[BlockKey],
                  ttl_s: float) -> LeaseInfo | None:
        """``lease``, waited for: the lease as the store holds it, or None when the store is
        gone."""
        check_lease(lease_id, ttl_s)
        return self._asking("lease", lease_id, tenant, list(keys), float(ttl_s))

    def release_lease(self, lease_id: str) -> None:
        """End a lease now (its blocks become plain LRU blocks), sent without waiting."""
        self._cast("release_lease", 0, lease_id)

    def release_lease_now(self, lease_id: str) -> int:
        """``release_lease``, waited for: the blocks it made plain (0 when the store is gone)."""
        released = self._asking("release_lease", lease_id)
        return 0 if released is None else released

    # ------------------------------------------------------------------ mechanism

    def _cast(self, method: str, num_keys: int, *args) -> None:
        """Send a call that grants and settles nothing without waiting; its answer is looked
        at later, like a release's (a store found gone detaches the client)."""
        with self._lock:
            self._reap()
            if not self._ensure_attached():
                return
            self.calls.count(f"store.{method}", "sent")
            ref = getattr(self._actor, method).remote(*args)
            self._casts.append(_InFlight(method, ref, self.arena_path, num_keys))

    def _asking(self, method: str, *args):
        """A waited call that grants nothing: its answer, or None when the store is gone."""
        with self._lock:
            self._reap()
            if not self._ensure_attached():
                return None
            try:
                return self._call(method, *args)
            except _STORE_GONE as exc:
                self._detach(method, exc)
                return None

    def _granting(self, method: str, *args,
                  wrap: Callable[[str, Any], StoreSlots] = StoreSlots) -> StoreSlots:
        """A call that grants slots. When it finds the store dead, a new store that is already
        up (the client was idle while the node was replaced) is asked at once."""
        with self._lock:
            self._settle_commits()
            if not self._ensure_attached():
                return StoreSlots("", [])
            self.calls.count(f"store.{method}")
            ref = self._remote(method, *args)
            return self._answer(ref, self.arena_path, method, args, wrap, StoreSlots("", []))

    def _settling(self, method: str, keys: Sequence[BlockKey], arena_path: str,
                  args: tuple = ()) -> bool:
        if not keys:
            return True
        with self._lock:
            if not self._ensure_attached() or arena_path != self.arena_path:
                return False  # granted by a store that is gone: nothing to settle
            try:
                self._call(method, list(keys), *args)
            except _STORE_GONE as exc:
                self._detach(method, exc)
                return False
            return True

    def _send(self, method: str, keys: Sequence[BlockKey], arena_path: str,
              on_lost: Callable[[int], None] | None = None, args: tuple = ()) -> bool:
        """Send a settling call without waiting (``args`` after the keys); False when it is not
        sent (nothing to settle: it was granted by a store that is gone)."""
        if not keys:
            return True
        with self._lock:
            self._reap()
            if not self._ensure_attached() or arena_path != self.arena_path:
                return False
            kind = "deferred" if method == "commit" else "sent"
            self.calls.count(f"store.{method}", kind)
            ref = self._remote(method, list(keys), *args)
            sent = _InFlight(method, ref, arena_path, len(keys), on_lost)
            (self._commits if method == "commit" else self._casts).append(sent)
            return True

    def _resolve(self, ref, arena_path: str, keys: list[BlockKey],
                 parents: list[BlockKey | None]) -> StoreSlots:
        """The answer to a reservation sent by ``reserve_later`` (see ``_answer``)."""
        return self._answer(ref, arena_path, "reserve", (keys, parents), StoreSlots,
                            StoreSlots("", [None] * len(keys)))

    def _resolve_runs(self, ref, arena_path: str, key_lists: list) -> list[StoreSlots]:
        """The answer to ``acquire_many_later`` (see ``_answer``; a miss where no store answers)."""
        return self._answer(ref, arena_path, "acquire_many", (key_lists,), _runs_of_each,
                            [StoreSlots("", [])] * len(key_lists))

    def _answer(self, ref, arena_path: str, method: str, args: tuple,
                wrap: Callable[[str, Any], Any], nothing: Any) -> Any:
        """``wrap(arena_path, answer)`` of a call sent to the store whose arena is
        ``arena_path``. When that store is found gone (or silent past the call timeout) and a
        new one is already up (the client was idle while the node was replaced), the new one is
        asked the same at once and waited for; with no new store, ``nothing``. The one
        store-gone retry of every call that grants slots."""
        try:
            return wrap(arena_path, ray.get(ref, timeout=self._call_timeout_s))
        except _STORE_GONE as exc:
            with self._lock:
                if arena_path == self.arena_path:
                    self._detach(method, exc)
                if self._attach() and self.arena_path not in ("", arena_path):
                    path = self.arena_path
                    try:
                        return wrap(path, self._call(method, *args))
                    except _STORE_GONE as again:
                        self._detach(method, again)
            return nothing

    def _settle_commits(self) -> None:
        """Wait for the commits in flight (normally answered already), then see their answers."""
        if self._commits:
            ray.wait([sent.ref for sent in self._commits], num_returns=len(self._commits),
                     timeout=self._call_timeout_s)
        self._reap()

    def _reap(self) -> None:
        """See the answers that arrived to calls sent without waiting: a store found gone
        detaches the client (as a call waited on would have), and lost commits are told."""
        for in_flight in (self._commits, self._casts):
            if not in_flight:
                continue
            refs = [sent.ref for sent in in_flight]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if not ready:
                continue
            answered = set(ready)
            still = []
            for sent in in_flight:
                if sent.ref not in answered:
                    still.append(sent)
                    continue
                try:
                    ray.get(sent.ref, timeout=0)
                except _STORE_GONE as exc:
                    if sent.arena_path == self.arena_path:
                        self._detach(sent.method, exc)
                    if sent.on_lost is not None:
                        sent.on_lost(sent.num_keys)
                except RayTaskError:  # the store refused it (a bug there): say so, go on
                    log.exception("KV store %s refused a %s of %d blocks", self._actor_name,
                                  sent.method, sent.num_keys)
                    if sent.on_lost is not None:
                        sent.on_lost(sent.num_keys)
            in_flight[:] = still

    def _call(self, method: str, *args):
        self.calls.count(f"store.{method}")
        return ray.get(self._remote(method, *args), timeout=self._call_timeout_s)

    def _remote(self, method: str, *args):
        """Send ``method`` to the store; the calls that pin or settle pins name this process's
        holder, so the store can release what the process holds if it dies."""
        call = getattr(self._actor, method)
        if self.holder and method in _HOLDING_CALLS:
            return call.remote(*args, holder=self.holder)
        return call.remote(*args)

    def _ensure_attached(self) -> bool:
        if self._actor is not None:
            return True
        if time.monotonic() < self._next_attempt:
            return False
        self._next_attempt = time.monotonic() + self._reattach_interval_s
        return self._attach()

    def _attach(self) -> bool:
        try:
            self.calls.count("gcs.get_actor")
            actor = ray.get_actor(self._actor_name, namespace=self._namespace)
            self.calls.count("store.arena_info")
            info = ray.get(actor.arena_info.remote(), timeout=self._call_timeout_s)
        except (ValueError, *_STORE_GONE):  # no actor by that name (yet), or it died again
            return False
        if self.arena is None or str(self.arena.path) != info.path:
            if self.arena is not None:
                self.stats.reattaches += 1
                log.warning("KV store %s is back (new arena %s): using it", self._actor_name,
                            info.path)
            # the old arena is not closed: a view of it may still exist; it is unmapped once
            # the last one goes
            self.arena = HostArena(info.path, info.slot_bytes, info.num_slots, create=False)
        self._actor = actor
        return True

    def _detach(self, method: str, exc: BaseException) -> None:
        self.stats.failed_calls += 1
        if self._actor is not None:
            log.warning("KV store %s is gone (%s failed: %s): recomputing and dropping saves "
                        "until it is back", self._actor_name, method, type(exc).__name__)
        self._actor = None
        self._next_attempt = time.monotonic() + self._reattach_interval_s


_SHARED: dict[tuple[str, str], StoreClient] = {}
_SHARED_LOCK = threading.Lock()
_HOLDING_CALLS = frozenset({"acquire", "acquire_many", "reserve", "reserve_many", "commit",
                            "abort", "release"})
_process_holder = ""


def set_process_holder(name: str) -> None:
    """Name this process to the store nodes (before its first store client is made): a worker
    names itself by its instance id, its Ray actor's name, so that a store node that finds no
    live actor by that name releases what the process reserved or pinned
    (``kvstore.node_holders``)."""
    global _process_holder
    _process_holder = name
    for client in _SHARED.values():
        client.holder = name


def shared_store_client(actor_name: str, namespace: str) -> StoreClient:
    """The process's one client of that store: vLLM builds a scheduler-side and a worker-side
    connector in the same process, and both must agree on which store is current."""
    with _SHARED_LOCK:
        client = _SHARED.get((actor_name, namespace))
        if client is None:
            client = _SHARED[(actor_name, namespace)] = StoreClient(actor_name, namespace)
        return client
