"""A worker's handle on its node's KV store: control calls to the store actor, data through
the shared-memory arena.

The store actor (``kvstore.node.KVStoreNode``) decides which slot holds which block; the client
only moves bytes into and out of those slots. Every call is synchronous because vLLM calls the
connector from its (synchronous) scheduler and model runner.

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
from typing import Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from kvstore.host_arena import HostArena
from kvstore.keys import BlockKey
from protos.wire import CallCounts
from protos.errors import StoreError

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


@dataclass
class StoreClientStats:
    failed_calls: int = 0
    """Calls that found the store gone (or timed out)."""
    reattaches: int = 0
    """Times the client moved to a new store process (a new arena)."""


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
        """Pin the leading run of ``keys`` the store holds; their slots."""
        return self._granting("acquire", list(keys))

    def reserve(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> StoreSlots:
        """Slots to write ``keys`` into (None where the store has no room or the block is
        already there); commit or abort them with the same ``arena_path``."""
        granted = self._granting("reserve", list(keys), list(parents))
        if not granted.arena_path:
            return StoreSlots("", [None] * len(keys))
        return granted

    def release(self, keys: Sequence[BlockKey], arena_path: str) -> None:
        self._settling("release", keys, arena_path)

    def commit(self, keys: Sequence[BlockKey], arena_path: str) -> bool:
        """True when the store committed the blocks (False: it is gone, they are dropped)."""
        return self._settling("commit", keys, arena_path)

    def abort(self, keys: Sequence[BlockKey], arena_path: str) -> None:
        self._settling("abort", keys, arena_path)

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

    # ------------------------------------------------------------------ mechanism

    def _granting(self, method: str, *args) -> StoreSlots:
        """A call that grants slots. When it finds the store dead, a new store that is already
        up (the client was idle while the node was replaced) is asked at once."""
        with self._lock:
            if not self._ensure_attached():
                return StoreSlots("", [])
            for attempt in range(2):
                path = self.arena_path
                try:
                    return StoreSlots(path, self._call(method, *args))
                except _STORE_GONE as exc:
                    self._detach(method, exc)
                    if attempt or not self._attach() or self.arena_path == path:
                        return StoreSlots("", [])  # no new store (yet)
            raise AssertionError("unreachable")

    def _settling(self, method: str, keys: Sequence[BlockKey], arena_path: str) -> bool:
        if not keys:
            return True
        with self._lock:
            if not self._ensure_attached() or arena_path != self.arena_path:
                return False  # granted by a store that is gone: nothing to settle
            try:
                self._call(method, list(keys))
            except _STORE_GONE as exc:
                self._detach(method, exc)
                return False
            return True

    def _call(self, method: str, *args):
        self.calls.count(f"store.{method}")
        return ray.get(getattr(self._actor, method).remote(*args), timeout=self._call_timeout_s)

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


def shared_store_client(actor_name: str, namespace: str) -> StoreClient:
    """The process's one client of that store: vLLM builds a scheduler-side and a worker-side
    connector in the same process, and both must agree on which store is current."""
    with _SHARED_LOCK:
        client = _SHARED.get((actor_name, namespace))
        if client is None:
            client = _SHARED[(actor_name, namespace)] = StoreClient(actor_name, namespace)
        return client
