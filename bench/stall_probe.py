"""How late a sleeping process wakes on this machine while a stack serves: a probe of stalls that
no stack's own figures show.

``python -m bench.stall_probe`` runs in its own process (no import of the stack, its own
interpreter lock), sleeps in ``STEP_S`` steps and records by how much each wake-up was late,
until SIGTERM, then prints one JSON object (``summarise``). On an idle or a merely busy machine
the lateness stays within a few milliseconds (the scheduler wakes a sleeper on a busy core at
once); more means processes outside the stack, the benchmark's client among them, were kept from
running. That is how it found the stalls of stacks started in sessions of their own under the
kernel's autogroup (``sched_autogroup``; ``bench.peers_stacks.Stack._spawn`` now keeps them in
the benchmark's session). ``baton bench peers`` runs one probe beside every workload of every
stack (``HostStallProbe``) and reports it per stack.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STEP_S = 0.01
"""Each sleep of the probe (s)."""
STALL_MS = 100.0
"""A wake-up this late or later counts as a stall (ms)."""


def summarise(late_ms: Sequence[float]) -> dict[str, Any]:
    """The probe's figures from the lateness of each wake-up (ms): how many, the worst, the
    99th percentile (nearest rank), the stalls (wake-ups ``STALL_MS`` or more late) and the time
    they lost (s)."""
    ordered = sorted(late_ms)
    stalls = [ms for ms in ordered if ms >= STALL_MS]
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0
    return {"wakeups": len(ordered), "late_ms_max": round(ordered[-1], 1) if ordered else 0.0,
            "late_ms_p99": round(p99, 1), "stalls": len(stalls),
            "stalled_s": round(sum(stalls) / 1000.0, 3)}


AUTOGROUP_SYSCTL = Path("/proc/sys/kernel/sched_autogroup_enabled")


def sched_autogroup(path: Path = AUTOGROUP_SYSCTL) -> bool | None:
    """Whether the kernel schedules each session as a group of its own (autogroup); None where
    the kernel has no such switch. With it on, processes in other sessions than a stack's
    shared the cores with that stack's whole session as one group (``Stack._spawn``)."""
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return None


def run() -> None:
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    late_ms: list[float] = []
    while not stopping:
        before = time.perf_counter()
        time.sleep(STEP_S)
        late_ms.append(max(0.0, (time.perf_counter() - before - STEP_S) * 1000.0))
    print(json.dumps(summarise(late_ms)), flush=True)


class HostStallProbe:
    """``with HostStallProbe() as probe: ...``, then ``probe.result`` (``summarise``'s dict, or
    None when the probe gave no answer)."""

    def __init__(self) -> None:
        self.result: dict[str, Any] | None = None
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> HostStallProbe:
        self._process = subprocess.Popen([sys.executable, "-m", "bench.stall_probe"],
                                         stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        process = self._process
        if process is None:
            return
        process.terminate()
        try:
            out, _ = process.communicate(timeout=10)
            self.result = json.loads(out) if out.strip() else None
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            process.kill()
            process.communicate()


if __name__ == "__main__":
    run()
