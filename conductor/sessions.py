"""The conductor's table of live agent sessions: where each one's last step ran, its prefix,
and the gaps between its steps (its tool pauses).

An agent's next step is its last prompt plus the reply plus a tool result, so a session is a
chain of prompts each extending the one before. The table keeps, per scoped session id (the
fronts hash the client's id with its API key and tenant), the block keys of the last step's
prompt, the instances it ran on, when it finished, and the pauses seen so far. A session ends
on an explicit close, when its TTL lapses without a step, or when a step's prompt does not
extend the last one (it diverged: the old prefix is no longer the session's).

What placement takes from it: the expected pause before the next step (the client's hint or
the session's own past pauses), which the conductor uses to prefetch the session's blocks back
to host memory on the node it expects to place the next step on. Pure: the clock is injected.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

MAX_GAPS_KEPT = 16
"""Pauses remembered per session (the learned pause is their median)."""
MIN_GAPS_TO_LEARN = 2
"""Pauses seen before the session's own median stands in for a missing hint."""


class SessionView(msgspec.Struct, frozen=True):
    """One live session as the conductor sees it (for status, tests and the prefetcher)."""

    session_id: str
    num_steps: int
    prefill_instance: str
    decode_instance: str
    num_prefix_blocks: int
    idle_s: float
    """Seconds since its last step finished (0 while a step is running)."""
    expected_gap_s: float | None
    """The pause expected before its next step: the client's hint, else the median of its past
    pauses once it has made ``MIN_GAPS_TO_LEARN``; None: unknown."""
    ttl_s: float


class SessionCounters(msgspec.Struct):
    started: int = 0
    steps: int = 0
    closed: int = 0
    expired: int = 0
    diverged: int = 0
    prefetches: int = 0
    prefetched_blocks: int = 0
    """Blocks the prefetches found in host memory or brought back there from disk."""


@dataclass
class _Session:
    session_id: str
    ttl_s: float
    prefix: tuple[bytes, ...] = ()
    prefill_instance: str = ""
    decode_instance: str = ""
    num_steps: int = 0
    running: int = 0
    last_seen_s: float = 0.0
    finished_s: float | None = None
    hint_s: float = 0.0
    prefetched: bool = False
    gaps: deque = field(default_factory=lambda: deque(maxlen=MAX_GAPS_KEPT))

    def expected_gap_s(self) -> float | None:
        if self.hint_s > 0:
            return self.hint_s
        if len(self.gaps) >= MIN_GAPS_TO_LEARN:
            return statistics.median(self.gaps)
        return None


class SessionStep(msgspec.Struct, frozen=True):
    """What ``SessionTable.step`` found: whether the step began a session (new, or anew after a
    divergence: the step's lease, which replaces the session's key set, releases the old
    prefix's blocks), and the pause since the session's last step (None for the first)."""

    new: bool
    diverged: bool
    pause_s: float | None


class SessionTable:
    """Live sessions by scoped id. Every method is O(1) per session but ``expire``."""

    def __init__(self, clock: Callable[[], float], default_ttl_s: float = 300.0) -> None:
        self._clock = clock
        self._default_ttl_s = default_ttl_s
        self._sessions: dict[str, _Session] = {}
        self.counters = SessionCounters()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def step(self, session_id: str, block_keys: Sequence[bytes], ttl_s: float = 0.0,
             expected_next_step_s: float = 0.0) -> SessionStep:
        """A step of ``session_id`` is being placed, with these full-block keys. A prompt that
        does not begin with the last step's prefix ends the old session and starts it anew."""
        now = self._clock()
        self._expire_one(session_id, now)
        session = self._sessions.get(session_id)
        diverged = False
        if session is not None and tuple(block_keys[:len(session.prefix)]) != session.prefix:
            diverged = True
            self.counters.diverged += 1
            del self._sessions[session_id]
            session = None
        new = session is None
        if new:
            session = self._sessions[session_id] = _Session(session_id, ttl_s or self._default_ttl_s)
            self.counters.started += 1
        pause = None if session.finished_s is None or session.running else now - session.finished_s
        if pause is not None:
            session.gaps.append(pause)
        session.prefix = tuple(block_keys)
        session.ttl_s = ttl_s or session.ttl_s
        session.hint_s = expected_next_step_s
        session.num_steps += 1
        session.running += 1
        session.last_seen_s = now
        session.finished_s = None
        session.prefetched = False
        self.counters.steps += 1
        return SessionStep(new, diverged, pause)

    def placed(self, session_id: str, prefill_instance: str, decode_instance: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.prefill_instance = prefill_instance
            session.decode_instance = decode_instance

    def finished(self, session_id: str) -> None:
        """A step of ``session_id`` ended (however): its pause starts when its last one ends."""
        session = self._sessions.get(session_id)
        if session is None:
            return
        session.running = max(0, session.running - 1)
        now = self._clock()
        session.last_seen_s = now
        if not session.running:
            session.finished_s = now

    def close(self, session_id: str) -> _Session | None:
        """End ``session_id`` on request; the session, or None when none is live."""
        self.expire()
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self.counters.closed += 1
        return session

    def expire(self) -> list[str]:
        """End the sessions whose TTL lapsed since their last step (none with a step running)."""
        now = self._clock()
        ended = [sid for sid, s in self._sessions.items()
                 if not s.running and now - s.last_seen_s > s.ttl_s]
        for sid in ended:
            del self._sessions[sid]
        self.counters.expired += len(ended)
        return ended

    def _expire_one(self, session_id: str, now: float) -> None:
        session = self._sessions.get(session_id)
        if session is not None and not session.running and now - session.last_seen_s > session.ttl_s:
            del self._sessions[session_id]
            self.counters.expired += 1

    def view(self, session_id: str) -> SessionView | None:
        session = self._sessions.get(session_id)
        if session is None:
            return None
        now = self._clock()
        idle = 0.0 if session.running or session.finished_s is None else now - session.finished_s
        return SessionView(session.session_id, session.num_steps, session.prefill_instance,
                           session.decode_instance, len(session.prefix), idle,
                           session.expected_gap_s(), session.ttl_s)

    def prefix(self, session_id: str) -> tuple[bytes, ...]:
        session = self._sessions.get(session_id)
        return session.prefix if session is not None else ()

    def due_for_prefetch(self, lead_s: float) -> list[SessionView]:
        """Idle sessions whose expected next step is at most ``lead_s`` away (or overdue), for
        the prefetcher; each is returned once per pause."""
        due = []
        now = self._clock()
        for session in self._sessions.values():
            if session.running or session.finished_s is None or session.prefetched:
                continue
            gap = session.expected_gap_s()
            if gap is not None and now - session.finished_s >= gap - lead_s:
                session.prefetched = True  # until its next step
                due.append(self.view(session.session_id))
        return due
