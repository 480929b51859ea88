"""The autoscaling loop: samples the conductor's pools, asks the planner, applies its decisions.

Runs inside the conductor actor (``cluster.control.ClusterConductor``), on its event loop, beside
the placement service, because the signals are the conductor's own: its queue book and priced
queues (``conductor.pricing.queue_ms``), the worker stats it polls, the pool manager's phases.
The decision is ``conductor.planner.plan`` (pure); applying it is ``PoolManager.scale``, the path
``baton scale`` takes: a new worker asks Ray for its pool's custom resource (so Ray's autoscaler
adds a node of that group when none has room) and a leaving one is drained first (no request
fails). Nothing here provisions nodes.

Disabled, the loop still samples and decides, so ``baton status`` shows what it would do; it
only stops applying. ``set_enabled`` turns it on and off live (``baton autoscale off``).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable

import msgspec

from cluster.pools import PoolManager
from conductor.planner import POOLS, ClusterSample, PlannerConfig, PoolSample, plan
from conductor.pricing import queue_ms
from conductor.state import ConductorState
from protos.wire import AutoscaleStatus, InstanceStats, PoolDecision, ScaleResult

log = logging.getLogger(__name__)

MAX_CHANGES_KEPT = 50


def sample_pools(state: ConductorState, last_stats: dict[str, InstanceStats], pools: PoolManager,
                 at_s: float) -> ClusterSample:
    """Both pools now, from the conductor's state, its last worker stats and the pool manager.
    Sizes are the pool manager's phases (what ``PoolManager.scale`` resizes); the signals come
    from the instances the snapshot shows ready."""
    snapshot = state.snapshot()
    views = {"prefill": snapshot.prefill, "decode": snapshot.decode}
    samples = {}
    for pool in POOLS:
        ready = [v for v in views[pool] if v.ready]
        phases = Counter(pools.phase(i) for i in pools.member_ids(pool))
        busy = [last_stats[v.instance_id] for v in ready if v.instance_id in last_stats
                and (last_stats[v.instance_id].num_running_reqs
                     or last_stats[v.instance_id].num_waiting_reqs)]
        if pool == "prefill":
            queued = sum(state.in_flight_on(v.instance_id)[0] for v in ready)
            recent = [s.recent_ttft_ms for s in busy if s.recent_ttft_ms is not None]
            ttft = 0.0
            if ready and (queued or recent):
                ttft = min(queue_ms(v, state.config) for v in ready) + (
                    statistics.median(recent) if recent else 0.0)
            samples[pool] = PoolSample(phases["ready"], phases["starting"], phases["draining"],
                                       predicted_ttft_ms=ttft, num_queued_prefills=queued)
        else:
            recent = [s.recent_itl_ms for s in busy if s.recent_itl_ms is not None]
            samples[pool] = PoolSample(
                phases["ready"], phases["starting"], phases["draining"],
                itl_ms=statistics.median(recent) if recent else 0.0,
                kv_usage_frac=statistics.fmean(v.kv_usage_frac for v in ready) if ready else 0.0)
    return ClusterSample(at_s, samples["prefill"], samples["decode"])


class Autoscaler:
    """The loop. ``sample`` returns the pools now; ``pools`` applies changes."""

    def __init__(self, config: PlannerConfig, pools: PoolManager,
                 sample: Callable[[float], ClusterSample],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._pools = pools
        self._sample = sample
        self._clock = clock
        self._window: deque[ClusterSample] = deque()
        self._last_change_s: dict[str, float] = {}
        self._last: list[PoolDecision] = []
        self._changes: deque[PoolDecision] = deque(maxlen=MAX_CHANGES_KEPT)
        self._totals: Counter[str] = Counter()
        self._applying: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def set_enabled(self, enabled: bool) -> None:
        """Apply decisions (True) or only make and show them (False). Changes under way finish."""
        self.config = self.config.model_copy(update={"enabled": enabled})
        log.info("autoscale: %s", "enabled" if enabled else "disabled: decisions are not applied")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except Exception:  # one bad sample must not stop the loop
                log.exception("autoscale step failed")

    async def step(self) -> list[PoolDecision]:
        """Take a sample, decide both pools, start applying what changes one. Returns the
        decisions."""
        now = self._clock()
        self._window.append(self._sample(now))
        while self._window and self._window[0].at_s < now - self.config.window_s:
            self._window.popleft()
        wall = time.time()
        decisions = [PoolDecision(d.pool, d.action, d.size_before, d.size_after, d.reason, wall)
                     for d in plan(list(self._window), self._last_change_s, now, self.config)]
        self._last = decisions
        for decision in decisions:
            self._totals[f"{decision.pool}/{decision.action}"] += 1
            busy = self._applying.get(decision.pool)
            if decision.action == "hold" or not self.config.enabled or (busy and not busy.done()):
                continue
            self._last_change_s[decision.pool] = now
            change = msgspec.structs.replace(decision, outcome="under way")
            self._changes.append(change)
            log.info("autoscale %s %d -> %d: %s", decision.pool, decision.size_before,
                     decision.size_after, decision.reason)
            self._applying[decision.pool] = asyncio.get_running_loop().create_task(
                self._apply(change))
        return decisions

    async def _apply(self, change: PoolDecision) -> None:
        timeout_s = (self.config.start_timeout_s if change.action == "up"
                     else self.config.drain_timeout_s)
        try:
            result = await self._pools.scale(change.pool, change.size_after, timeout_s,
                                             f"autoscale: {change.reason}")
        except Exception as exc:  # noqa: BLE001 - reported, and the next decision tries again
            log.warning("autoscale %s -> %d failed: %s", change.pool, change.size_after, exc)
            self._settle(change, f"failed: {exc}")
            return
        # the pool changed when the change finished: the cool-down and the evidence start there
        self._last_change_s[change.pool] = self._clock()
        if result.failed:
            log.warning("autoscale %s: %s", change.pool, "; ".join(result.failed))
        self._settle(change, _outcome(result))

    def _settle(self, change: PoolDecision, outcome: str) -> None:
        """Say how a change ended, in place in the list of changes (unless it has left it)."""
        for i, kept in enumerate(self._changes):
            if kept is change:
                self._changes[i] = msgspec.structs.replace(change, outcome=outcome)
                return

    async def wait_applied(self) -> None:
        """Until every change started so far has finished (tests)."""
        await asyncio.gather(*self._applying.values(), return_exceptions=True)

    def status(self) -> AutoscaleStatus:
        return AutoscaleStatus(self.config.enabled, list(self._last), list(self._changes),
                               dict(self._totals))


def _outcome(result: ScaleResult) -> str:
    """``done``, or what kept the pool from the size asked for."""
    failed = "failed: " + "; ".join(result.failed)
    if result.failed and result.size_after == result.size_before:
        return failed  # nothing changed
    parts = ([failed] if result.failed else []) + (
        ["pending: " + ", ".join(result.pending)] if result.pending else [])
    return "; ".join(parts) or "done"
