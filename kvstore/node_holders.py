"""Who holds what on a store node: the reservations and read pins of each client process, so
that a worker that dies mid-transfer does not leave them behind.

A writer reserves slots (``reserve``: the blocks are WRITING and pinned until it commits or
aborts them) and a reader pins blocks while it copies them (``acquire``, until ``release``). A
process killed between the two calls (an engine crash in the middle of a KV transfer) never
makes the second one: without this ledger its blocks would stay pinned for the node's lifetime,
their slots lost to the tier, and a WRITING block would even keep its key from being stored by
anyone else.

Each ``StoreClient`` names its process's holder (``kvstore.client.set_process_holder``: a worker
names itself by its instance id, which is also its Ray actor's name) in every pinning call. The
node files what each call pinned under that name, and unfiles what the settling call settles.
``forget_holder`` aborts a holder's reservations and drops its read pins; a sweep thread calls
it for every holder whose actor is gone (``holder_alive``: the cluster passes
``ray_actor_alive`` bound to its own namespace, where its workers are named), so a crashed
worker's blocks come back within ``holder_sweep_interval_s`` without anyone having to notice the
crash. Calls without a holder (tests, tools) are not filed.

A mixin of ``kvstore.node.KVStoreNode``, whose ``__init__`` sets the attributes declared below
(``_init_holders``); its public methods take the node's lock, as the node's own do.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.block_store import BlockState, BlockStore
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)


@dataclass
class _Holds:
    writing: dict[BlockKey, None] = field(default_factory=dict)
    """Keys the holder reserved and has not committed or aborted, in reservation order (a
    chain's parents before their children)."""
    reading: Counter = field(default_factory=Counter)
    """Read pins (``acquire``) not yet released, by key."""

    def __bool__(self) -> bool:
        return bool(self.writing) or bool(self.reading)


def ray_actor_alive(name: str, namespace: str | None = None, timeout_s: float = 5.0) -> bool:
    """Whether the Ray actor named ``name`` in ``namespace`` (the cluster's, where its workers
    are named) still runs: asked with Ray's own readiness call, since a dead actor's name still
    resolves. True when Ray cannot tell (no answer in time, unreachable for a moment): a holder
    is never forgotten on a guess."""
    import ray
    from ray.exceptions import ActorDiedError

    try:
        handle = ray.get_actor(name, namespace=namespace)
        ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
    except (ValueError, ActorDiedError):  # no actor by that name, or a dead one
        return False
    except Exception as exc:  # noqa: BLE001 - busy or unreachable: ask again next sweep
        log.info("could not tell whether store holder %s is alive (%s): keeping its blocks",
                 name, type(exc).__name__)
        return True
    return True


class NodeHolders:
    """``KVStoreNode``'s ledger of holders."""

    _lock: threading.RLock
    store: BlockStore
    _holders: dict[str, _Holds]
    reclaimed_writing_blocks: int
    """Reservations aborted because their holder died before committing them."""
    reclaimed_read_pins: int
    """Read pins dropped because their holder died before releasing them."""

    def _init_holders(self, holder_alive: Callable[[str], bool] | None,
                      sweep_interval_s: float) -> None:
        self._holders = {}
        self.reclaimed_writing_blocks = self.reclaimed_read_pins = 0
        self._stop_sweep = threading.Event()
        if holder_alive is not None and sweep_interval_s > 0:
            threading.Thread(target=self._sweep_forever, args=(holder_alive, sweep_interval_s),
                             name="baton-store-holders", daemon=True).start()

    # -- filing (called by the node's own methods, under its lock) -------------------------------

    def _file_reserved(self, holder: str, keys: Sequence[BlockKey],
                       slots: Sequence[int | None]) -> None:
        reserved = [key for key, slot in zip(keys, slots) if slot is not None]
        if holder and reserved:
            self._holders.setdefault(holder, _Holds()).writing.update(dict.fromkeys(reserved))

    def _file_acquired(self, holder: str, keys: Sequence[BlockKey], num_pinned: int) -> None:
        if holder and num_pinned:
            self._holders.setdefault(holder, _Holds()).reading.update(keys[:num_pinned])

    def _unfile_written(self, holder: str, keys: Sequence[BlockKey]) -> None:
        holds = self._holders.get(holder) if holder else None
        if holds is not None:
            for key in keys:
                holds.writing.pop(key, None)
            self._drop_if_empty(holder, holds)

    def _unfile_released(self, holder: str, keys: Sequence[BlockKey]) -> None:
        holds = self._holders.get(holder) if holder else None
        if holds is not None:
            holds.reading.subtract(keys)
            for key in keys:
                if holds.reading[key] <= 0:
                    del holds.reading[key]
            self._drop_if_empty(holder, holds)

    def _drop_if_empty(self, holder: str, holds: _Holds) -> None:
        if not holds:
            del self._holders[holder]

    # -- the node's methods ----------------------------------------------------------------------

    def holder_counts(self) -> dict[str, tuple[int, int]]:
        """Each holder's (reserved, read-pinned) block counts: what it would leave behind."""
        with self._lock:
            return {holder: (len(h.writing), sum(h.reading.values()))
                    for holder, h in self._holders.items()}

    def reclaimed(self) -> tuple[int, int]:
        """(reservations aborted, read pins dropped) for holders that died, since start."""
        with self._lock:
            return self.reclaimed_writing_blocks, self.reclaimed_read_pins

    def forget_holder(self, holder: str) -> tuple[int, int]:
        """``holder`` is gone: abort what it reserved and still writes, drop its read pins.
        Returns (reservations aborted, read pins dropped)."""
        with self._lock:
            holds = self._holders.pop(holder, None)
            if holds is None:
                return 0, 0
            writing = [key for key in holds.writing
                       if (info := self.store.block_info(key)) is not None
                       and info.state is BlockState.WRITING]
            self.store.abort(writing)  # children after parents: aborted deepest first
            reading = [key for key, n in holds.reading.items() for _ in range(n)
                       if key in self.store]
            self.store.release(reading)
            self.reclaimed_writing_blocks += len(writing)
            self.reclaimed_read_pins += len(reading)
            return len(writing), len(reading)

    def _sweep_forever(self, holder_alive: Callable[[str], bool], interval_s: float) -> None:
        while not self._stop_sweep.wait(interval_s):
            with self._lock:
                holders = list(self._holders)
            for holder in holders:
                if holder_alive(holder):
                    continue
                aborted, dropped = self.forget_holder(holder)
                if aborted or dropped:
                    log.warning("store holder %s is gone: aborted its %d reserved blocks and "
                                "dropped its %d read pins", holder, aborted, dropped)
