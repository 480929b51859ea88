"""The engines' KV event batches as the conductor received them, kept for the fronts that stream
them on (the engine gRPC contract's ``SubscribeKvEvents``).

One cluster-wide sequence number (1, 2, 3, ...) orders the batches of every engine; a bounded
buffer keeps the most recent ones, so a subscriber that falls behind by more than the buffer
resumes at the oldest kept batch (its next batch then skips sequence numbers: a gap it can see).
The conductor's own index does not read from here; this is a tap beside it, and it keeps nothing
until a subscriber first asks (``arm``), so a cluster without one pays nothing for it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from protos.wire import KvFeedBatch

DEFAULT_CAPACITY_BATCHES = 1024


class KvEventFeed:
    """``record`` each engine batch; ``wait_after(seq, ...)`` answers the batches after ``seq``."""

    def __init__(self, capacity_batches: int = DEFAULT_CAPACITY_BATCHES) -> None:
        assert capacity_batches > 0
        self._batches: deque[KvFeedBatch] = deque(maxlen=capacity_batches)
        self._last_seq = 0
        self._arrived = asyncio.Event()
        self.armed = False
        """Batches are kept once a subscriber has asked for them (``arm``)."""

    def arm(self) -> None:
        """Keep batches from now on."""
        self.armed = True

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch recorded (0: none yet)."""
        return self._last_seq

    def record(self, instance_id: str, payload: bytes) -> int | None:
        """Keep one batch from ``instance_id``; returns its sequence number (None before
        ``arm``)."""
        if not self.armed:
            return None
        self._last_seq += 1
        self._batches.append(KvFeedBatch(self._last_seq, instance_id, payload))
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()
        return self._last_seq

    def after(self, seq: int, max_batches: int) -> list[KvFeedBatch]:
        """Up to ``max_batches`` kept batches numbered above ``seq``, oldest first."""
        if not self._batches or seq >= self._last_seq:
            return []
        first_kept = self._batches[0].seq
        start = max(seq + 1 - first_kept, 0)
        end = min(start + max_batches, len(self._batches))
        return [self._batches[i] for i in range(start, end)]

    async def wait_after(self, seq: int, wait_s: float, max_batches: int) -> list[KvFeedBatch]:
        """``after(seq)``, waiting up to ``wait_s`` seconds for a batch when none is there yet
        (a long poll: an idle subscriber costs one call per ``wait_s``)."""
        batches = self.after(seq, max_batches)
        if batches or wait_s <= 0:
            return batches
        try:
            await asyncio.wait_for(self._arrived.wait(), wait_s)
        except asyncio.TimeoutError:
            return []
        return self.after(seq, max_batches)
