"""Where a stack's CPU went during a workload: CPU seconds per role of its processes.

On a 2-core box every CPU second a router, a gateway or Ray's own daemons take is a second the
engines do not get, so ``baton bench peers`` reports, beside the latencies, what each stack's
process tree spent by role: ``engine`` (the processes that run a model: Baton's worker actors,
vLLM's engine cores), ``frontend`` (vLLM's API servers, Baton's gateway, SMG), ``conductor``,
``store``, ``ray`` (GCS, raylet, agents, idle workers), ``redis``. Read from the kernel's
per-process counters (psutil): a snapshot before and one after the workload, the difference per
process, summed by role.

Within the engine role, the thread that runs the model (each engine process's busiest thread:
the forward pass is nearly all of an engine's work) is counted apart (``model_thread_seconds``):
with both stacks' cores saturated, what the model threads got against what everything else took
is the stack's own CPU tax on the engines (docs/benchmarks.md, "Where the private race's time
goes").
"""

from __future__ import annotations

from collections.abc import Iterable

import psutil

ROLES = ("engine", "frontend", "conductor", "store", "ray", "redis", "other")

_BY_MARKER = (  # the first marker found in a process's command line (or name) decides its role
    ("ray::DecodeWorker", "engine"), ("ray::PrefillWorker", "engine"),
    ("ray::PlainWorker", "engine"), ("EngineCore", "engine"),
    ("Conductor", "conductor"), ("ray::KVStoreNode", "store"),
    ("ray::Gateway", "frontend"), ("vllm.entrypoints", "frontend"), ("cli.main", "frontend"),
    ("smg", "frontend"),
    ("redis-server", "redis"),
    ("gcs_server", "ray"), ("raylet", "ray"), ("ray/", "ray"), ("ray::", "ray"),
    ("default_worker.py", "ray"),
)


def role_of(name: str, cmdline: str) -> str:
    """The role of a process from its name and command line (``ROLES``)."""
    for marker, role in _BY_MARKER:
        if marker in cmdline or marker in name:
            return role
    return "other"


def _tree(root_pids: Iterable[int]) -> list[psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    for pid in root_pids:
        try:
            root = psutil.Process(pid)
            for p in (root, *root.children(recursive=True)):
                procs[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    return list(procs.values())


def snapshot(root_pids: Iterable[int]) -> dict[int, tuple[str, float]]:
    """Per process of the trees under ``root_pids``: (role, CPU seconds so far, user + system,
    its own threads only)."""
    out: dict[int, tuple[str, float]] = {}
    for p in _tree(root_pids):
        try:
            with p.oneshot():
                times = p.cpu_times()
                role = role_of(p.name(), " ".join(p.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[p.pid] = (role, times.user + times.system)
    return out


def engine_threads(root_pids: Iterable[int]) -> dict[tuple[int, int], float]:
    """CPU seconds so far of every thread of the engine-role processes under ``root_pids``,
    keyed by (process id, thread id)."""
    out: dict[tuple[int, int], float] = {}
    for p in _tree(root_pids):
        try:
            with p.oneshot():
                if role_of(p.name(), " ".join(p.cmdline())) != "engine":
                    continue
                threads = p.threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for thread in threads:
            out[(p.pid, thread.id)] = thread.user_time + thread.system_time
    return out


def model_thread_seconds(before: dict[tuple[int, int], float],
                         after: dict[tuple[int, int], float]) -> float:
    """CPU seconds the model threads spent between two ``engine_threads`` snapshots: per engine
    process, its busiest thread over the interval (a thread born in between counts from zero),
    summed over processes."""
    busiest: dict[int, float] = {}
    for (pid, tid), cpu in after.items():
        spent = max(0.0, cpu - before.get((pid, tid), 0.0))
        busiest[pid] = max(busiest.get(pid, 0.0), spent)
    return round(sum(busiest.values()), 2)


def by_role(before: dict[int, tuple[str, float]],
            after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots (a process born in between counts
    from zero; one gone by ``after`` is not counted, so short-lived helpers are missed)."""
    spent = dict.fromkeys(ROLES, 0.0)
    for pid, (role, cpu) in after.items():
        start = before.get(pid, (role, 0.0))[1]
        spent[role] += max(0.0, cpu - start)
    return {role: round(seconds, 2) for role, seconds in spent.items()}


def shares(spent: dict[str, float], duration_s: float, num_cores: int) -> dict[str, float]:
    """Each role's CPU seconds as a fraction of the cores' time over ``duration_s``."""
    capacity = max(duration_s, 1e-9) * max(num_cores, 1)
    return {role: round(seconds / capacity, 3) for role, seconds in spent.items()}
