"""Growing and shrinking the prefill and decode pools, inside the conductor actor.

The conductor is the only place that knows what is placed where, so it is the one that can take
an instance out safely. Leaving is always a drain: the instance is marked draining (the snapshot
shows it not ready, so no policy places on it), the requests booked on it run to their end (the
conductor's own books, closed by the router's ``prefill_done``/``finished``, and the worker's
own running/waiting counts must both reach zero), then the actor is shut down, killed and
removed. Joining is: create the detached worker actor with its pool's custom resource (a pending
actor is what asks the Ray autoscaler for a node of that group), wait for its engine, mark it
ready. ``baton scale``, ``baton drain`` and the autoscaling loop all come through here.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import msgspec
import ray

from conductor.state import ConductorState
from engine.config import EngineConfig
from engine.models import PreparedModel
from kvstore.attach import NodeStoreSpec
from protos.errors import DrainTimeout, ScaleRefused, UnknownInstance
from protos.wire import DrainResult, InstanceRow, PoolStatus, ScaleResult, StoreRow
from worker.base import ConductorWiring

log = logging.getLogger(__name__)

PREFILL_RESOURCE = "baton_prefill"
DECODE_RESOURCE = "baton_decode"
POOL_RESOURCES = {"prefill": PREFILL_RESOURCE, "decode": DECODE_RESOURCE}
DRAIN_POLL_S = 0.05


class LaunchSpec(msgspec.Struct, frozen=True):
    """What the conductor needs to start a worker: set once by ``baton up``."""

    cluster_name: str
    engine: EngineConfig
    model: PreparedModel
    store: NodeStoreSpec
    conductor: ConductorWiring
    num_gpus_per_instance: float = 0.0


@dataclass
class _Member:
    role: str
    phase: str  # starting | ready | draining
    actor: object
    ready_task: asyncio.Task | None = None


def instance_index(instance_id: str) -> int:
    match = re.search(r"-(\d+)$", instance_id)
    return int(match.group(1)) if match else -1


class PoolManager:
    """Members of both pools and the two verbs that change them. Runs on the conductor's event
    loop; ``state`` is the conductor's own ``ConductorState``."""

    def __init__(self, state: ConductorState, namespace: str) -> None:
        self._state = state
        self._namespace = namespace
        self.spec: LaunchSpec | None = None
        self._members: dict[str, _Member] = {}
        self._locks = {"prefill": asyncio.Lock(), "decode": asyncio.Lock()}
        self.log: list[str] = []
        """Every change, newest last, with its reason (also logged)."""

    def _note(self, message: str) -> None:
        log.info("pools: %s", message)
        self.log.append(f"{time.strftime('%H:%M:%S')} {message}")
        del self.log[:-200]

    def phase(self, instance_id: str) -> str | None:
        member = self._members.get(instance_id)
        return member.phase if member is not None else None

    def member_ids(self, role: str | None = None) -> list[str]:
        return sorted((i for i, m in self._members.items() if role in (None, m.role)),
                      key=lambda i: (self._members[i].role, instance_index(i)))

    def size(self, role: str) -> int:
        """Instances in the pool that are not leaving (starting or ready)."""
        return sum(1 for m in self._members.values() if m.role == role and m.phase != "draining")

    # ------------------------------------------------------------------ joining

    def _start_worker(self, role: str) -> str:
        from decode_worker.worker import DecodeWorker
        from engine.builder import engine_env
        from prefill_worker.worker import PrefillWorker

        spec = self.spec
        assert spec is not None
        used = [instance_index(i) for i in self._members if self._members[i].role == role]
        used += [instance_index(i) for i in self._state.instance_ids(role)]
        instance_id = f"{spec.cluster_name}-{role}-{max(used, default=-1) + 1}"
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        bind = spec.engine.omp_threads_bind if spec.engine.omp_threads_bind != "auto" else "nobind"
        actor = (
            ray.remote(cls)
            .options(name=instance_id, namespace=self._namespace, lifetime="detached", num_cpus=0,
                     num_gpus=spec.num_gpus_per_instance, resources={POOL_RESOURCES[role]: 1},
                     max_concurrency=1000,
                     runtime_env={"env_vars": engine_env(spec.engine, bind)},
                     # every streamed token is a task event otherwise, sent to the GCS and kept
                     # for the dashboard; Baton's own metrics and `baton status` report requests
                     enable_task_events=False)
            .remote(instance_id, spec.engine, spec.model, spec.store, spec.conductor)
        )
        member = _Member(role, "starting", actor)
        self._members[instance_id] = member
        member.ready_task = asyncio.get_running_loop().create_task(self._join(instance_id, member))
        return instance_id

    async def _join(self, instance_id: str, member: _Member) -> str | None:
        """Wait for the engine, then let the conductor place on it. Returns an error or None."""
        try:
            start_s = await member.actor.ready.remote()
        except Exception as exc:  # the engine failed to start, or the actor was killed
            if self._members.get(instance_id) is member:
                del self._members[instance_id]
                self._state.remove(instance_id)
                self._note(f"{instance_id} failed to start: {exc}")
                try:
                    ray.kill(member.actor)
                except Exception:
                    pass
            return f"{type(exc).__name__}: {str(exc)[:300]}"
        if member.phase == "starting":
            member.phase = "ready"
            self._state.set_ready(instance_id, True)
            self._note(f"{instance_id} ready (engine start {start_s:.1f} s)")
        return None

    # ------------------------------------------------------------------ scaling

    async def scale(self, role: str, size: int, timeout_s: float, reason: str) -> ScaleResult:
        """Bring ``role``'s pool to ``size`` instances: start new ones and wait up to
        ``timeout_s`` for their engines, or drain the surplus (the newest and least busy first)
        and wait for them to leave."""
        if role not in POOL_RESOURCES:
            raise ScaleRefused(f"unknown pool '{role}': use prefill or decode")
        if self.spec is None:
            raise ScaleRefused("this cluster was not started with `baton up`, so the conductor "
                               "cannot start workers; restart `baton serve` with --prefill/--decode")
        if size < 1:
            raise ScaleRefused(f"{role} pool size {size}: a pool needs at least one instance")
        async with self._locks[role]:
            before = self.size(role)
            added, removed, pending, failed = [], [], [], []
            if size > before:
                self._note(f"scale {role} {before} -> {size}: {reason}")
                added = [self._start_worker(role) for _ in range(size - before)]
                tasks = {i: self._members[i].ready_task for i in added}
                await asyncio.wait([t for t in tasks.values() if t is not None], timeout=timeout_s)
                for instance_id, task in tasks.items():
                    if not task.done():
                        pending.append(instance_id)
                    elif task.result() is not None:
                        failed.append(f"{instance_id}: {task.result()}")
            elif size < before:
                self._note(f"scale {role} {before} -> {size}: {reason}")
                victims = self._victims(role, before - size)
                results = await asyncio.gather(
                    *(self._drain(i, timeout_s) for i in victims), return_exceptions=True)
                for instance_id, result in zip(victims, results):
                    if isinstance(result, BaseException):
                        failed.append(f"{instance_id}: {result}")
                    else:
                        removed.append(instance_id)
            return ScaleResult(role, before, self.size(role), added, removed, pending, failed)

    def _victims(self, role: str, count: int) -> list[str]:
        """Who leaves first: instances still starting, then the least busy, newest first."""
        def cost(instance_id: str) -> tuple:
            prefills, decodes = self._state.in_flight_on(instance_id)
            starting = self._members[instance_id].phase == "starting"
            return (not starting, prefills + decodes, -instance_index(instance_id))

        candidates = [i for i, m in self._members.items() if m.role == role and m.phase != "draining"]
        return sorted(candidates, key=cost)[:count]

    async def drain(self, instance_id: str, timeout_s: float) -> DrainResult:
        """Take one instance out of service without failing a request (``baton drain``)."""
        member = self._members.get(instance_id)
        if member is None:
            known = ", ".join(self.member_ids()) or "none"
            raise UnknownInstance(f"no instance '{instance_id}' in this cluster (instances: {known})")
        others = [i for i, m in self._members.items()
                  if m.role == member.role and m.phase == "ready" and i != instance_id]
        if member.phase == "ready" and not others:
            raise ScaleRefused(f"{instance_id} is the last ready {member.role} instance: start "
                               f"another first (`baton scale --{member.role} 2`), then drain it")
        async with self._locks[member.role]:
            self._note(f"drain {instance_id}: operator request")
            return await self._drain(instance_id, timeout_s)

    async def _drain(self, instance_id: str, timeout_s: float) -> DrainResult:
        member = self._members[instance_id]
        started = time.monotonic()
        was_starting = member.phase == "starting"
        member.phase = "draining"
        booked = len(self._state.requests_on(instance_id))
        if not was_starting and instance_id in self._state.instance_ids():
            self._state.set_draining(instance_id)
            await self._wait_idle(instance_id, member, started + timeout_s)
        try:
            await asyncio.wait_for(member.actor.shutdown.remote(), timeout=10)
        except Exception:
            pass  # it is killed next either way
        try:
            ray.kill(member.actor, no_restart=True)
        except Exception:
            pass
        self._state.remove(instance_id)
        self._members.pop(instance_id, None)
        drain_s = time.monotonic() - started
        self._note(f"{instance_id} left after {drain_s:.1f} s ({booked} requests finished first)")
        return DrainResult(instance_id, booked, drain_s)

    async def _wait_idle(self, instance_id: str, member: _Member, deadline: float) -> None:
        """Until the conductor's books and the worker's own queue are both empty."""
        while True:
            prefills, decodes = self._state.in_flight_on(instance_id)
            if prefills == decodes == 0:
                try:
                    stats = await asyncio.wait_for(member.actor.stats.remote(), timeout=5)
                    if stats.num_running_reqs == stats.num_waiting_reqs == 0:
                        return
                except Exception:
                    return  # the worker is gone: nothing left to finish there
            if time.monotonic() > deadline:
                raise DrainTimeout(
                    f"{instance_id} still has {prefills} prefills and {decodes} decodes in flight; "
                    "it stays draining (no new work). Run `baton drain` again with a longer "
                    "--timeout, or wait for its requests to end.")
            await asyncio.sleep(DRAIN_POLL_S)
