"""The conductor actor as a cluster runs it: the placement service (``conductor.conductor``) plus
the pool manager that grows and shrinks the prefill and decode pools (``cluster.pools``).

The deciding core knows nothing of how workers are started; this subclass adds the verbs that
start and stop them (``baton scale``, ``baton drain``, ``baton status``), on the same actor and
event loop, because only the conductor knows what is placed where and so what may leave.
"""

from __future__ import annotations

import asyncio

from cluster.autoscale import Autoscaler, sample_pools
from cluster.pools import LaunchSpec, PoolManager
from conductor.conductor import Conductor
from conductor.config import ConductorConfig
from conductor.planner import PlannerConfig
from conductor.policy import PolicyConfig
from protos.errors import ScaleRefused
from protos.wire import (
    AutoscaleStatus,
    CostModelStatus,
    DrainResult,
    InstanceRow,
    PoolSizes,
    PoolStatus,
    ScaleResult,
)


class ClusterConductor(Conductor):
    """``Conductor`` with its pools: the class ``baton serve`` and ``baton up`` start as the
    conductor actor."""

    def __init__(self, config: ConductorConfig, namespace: str, policy_config: PolicyConfig,
                 events_host: str = "127.0.0.1") -> None:
        super().__init__(config, namespace, policy_config, events_host)
        self.pools = PoolManager(self.state, namespace)
        self.autoscaler: Autoscaler | None = None

    async def set_launch_spec(self, spec: LaunchSpec) -> None:
        """How to start workers (``baton up``); without it the pools cannot be resized."""
        self.pools.spec = spec

    async def start_autoscaler(self, config: PlannerConfig) -> None:
        """Run the autoscaling loop (``cluster.autoscale``) with ``config`` (``baton up``, after
        the initial scale); it applies decisions only when ``config.enabled``. Starting it
        again replaces its config."""
        if self.autoscaler is None:
            self.autoscaler = Autoscaler(
                config, self.pools, lambda at_s: sample_pools(self.state, self._last_stats,
                                                              self.pools, at_s))
            self.autoscaler.start()
        else:
            self.autoscaler.config = config

    async def set_autoscale(self, enabled: bool) -> AutoscaleStatus:
        """Apply the planner's decisions or stop applying them, live (``baton autoscale``);
        ``ScaleRefused`` when this cluster runs no planner."""
        if self.autoscaler is None:
            raise ScaleRefused("this cluster runs no autoscaling planner (`baton serve`, or a "
                               "`baton up` older than it): `baton down`, then `baton up`")
        self.autoscaler.set_enabled(enabled)
        return self.autoscaler.status()

    async def scale(self, sizes: PoolSizes, timeout_s: float,
                    reason: str = "operator request") -> list[ScaleResult]:
        """Resize the pools ``sizes`` gives side by side (``baton scale``), prefill first in the
        results."""
        return list(await asyncio.gather(
            *(self.pools.scale(role, size, timeout_s, reason) for role, size in sizes.requested())))

    async def drain(self, instance_id: str, timeout_s: float) -> DrainResult:
        """Finish an instance's work, then remove it (``baton drain``)."""
        return await self.pools.drain(instance_id, timeout_s)

    async def pool_status(self) -> PoolStatus:
        """Pools, instances, store nodes and placement counters (``baton status``)."""
        rows = []
        sizes: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}
        ids = set(self.state.instance_ids()) | set(self.pools.member_ids())
        for instance_id in sorted(ids):
            stats = self._last_stats.get(instance_id)
            phase = self.pools.phase(instance_id)
            if instance_id in self.state.instance_ids():
                role = self.state.role_of(instance_id)
                if phase is None or phase == "ready":
                    phase = "ready" if self.state.is_instance_ready(instance_id) else (
                        "not_ready" if self.state.was_ever_ready(instance_id) else "starting")
                node = self.state.node_of(instance_id)
            else:
                role, node = ("prefill" if "-prefill-" in instance_id else "decode"), ""
            booked = len(self.state.requests_on(instance_id))
            sizes[role][phase] = sizes[role].get(phase, 0) + 1
            rows.append(InstanceRow(
                instance_id, role, node, phase,
                stats.num_waiting_reqs if stats else 0, stats.num_running_reqs if stats else 0,
                booked, stats.kv_usage_frac if stats else 0.0,
                stats.num_prompt_tokens if stats else 0, stats.num_cached_tokens if stats else 0,
                stats.recent_ttft_ms if stats else None, stats.recent_itl_ms if stats else None,
                stats.kv_load_seconds if stats else 0.0))
        calibration = self.state.calibration
        cost_model = CostModelStatus(calibration is not None,
                                     calibration.prefill_error() if calibration else None,
                                     calibration.decode_error() if calibration else None,
                                     calibration.prefill_source() if calibration else "",
                                     self.state.config.handoff_overhead_ms,
                                     calibration.handoff_error() if calibration else None,
                                     calibration.decode_request_error() if calibration else None,
                                     calibration.mixed_step_error() if calibration else None,
                                     calibration.request_all_steps_error() if calibration else None)
        return PoolStatus(self._config.policy, sizes, rows, await self._store_rows(),
                          self.state.counters, self.pools.log[-20:],
                          self.autoscaler.status() if self.autoscaler is not None else None,
                          cost_model)

