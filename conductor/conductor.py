"""The conductor: the one place where placement is decided.

A Ray actor that keeps a snapshot of the pools (which instances exist, are ready, and how loaded
they are), and answers ``place`` by calling the configured policy, a pure function, on it.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from conductor.config import ConductorConfig
from conductor.policy import (
    POLICIES,
    ClusterSnapshot,
    InstanceView,
    PlacementRequest,
    PolicyConfig,
)
from engine.messages import Placement

log = logging.getLogger(__name__)


class Conductor:
    """Owns the snapshot and the placement counters. Ray async actor; one per cluster."""

    def __init__(self, config: ConductorConfig, namespace: str) -> None:
        logging.basicConfig(level=logging.INFO)
        self._config = config
        self._namespace = namespace
        self._policy = POLICIES[config.policy]
        self._policy_config = PolicyConfig()
        self._roles: dict[str, str] = {}
        self._views: dict[str, InstanceView] = {}
        self._num_placed = 0
        self._refresher: asyncio.Task | None = None

    async def register(self, instance_id: str, role: str) -> None:
        """Add an instance (not ready until ``mark_ready``)."""
        assert role in ("prefill", "decode"), role
        self._roles[instance_id] = role
        self._views[instance_id] = InstanceView(instance_id, ready=False)
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def mark_ready(self, instance_id: str) -> None:
        view = self._views[instance_id]
        self._views[instance_id] = InstanceView(
            instance_id, view.num_running_reqs, view.num_waiting_reqs, ready=True
        )

    async def is_ready(self) -> bool:
        """True when at least one prefill and one decode instance can take work."""
        ready_roles = {self._roles[i] for i, v in self._views.items() if v.ready}
        return {"prefill", "decode"} <= ready_roles

    def snapshot(self) -> ClusterSnapshot:
        def pool(role: str) -> tuple[InstanceView, ...]:
            return tuple(v for i, v in sorted(self._views.items()) if self._roles[i] == role)

        return ClusterSnapshot(pool("prefill"), pool("decode"), self._num_placed)

    async def place(self, request: PlacementRequest) -> Placement:
        """Placement for one request; raises ``NoWorkerReady`` when a pool has no ready instance."""
        placement = self._policy(self.snapshot(), request, self._policy_config)
        self._num_placed += 1
        log.debug(
            "placed %s: prefill=%s decode=%s policy=%s %s",
            request.request_id, placement.prefill_instance, placement.decode_instance,
            placement.policy, placement.reason,
        )
        return placement

    async def num_placed(self) -> int:
        return self._num_placed

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.stats_interval_s)
            for instance_id, view in list(self._views.items()):
                if not view.ready:
                    continue
                try:
                    handle = ray.get_actor(instance_id, namespace=self._namespace)
                    stats = await asyncio.wait_for(handle.stats.remote(), timeout=5)
                    self._views[instance_id] = InstanceView(
                        instance_id, stats.num_running_reqs, stats.num_waiting_reqs, stats.ready
                    )
                except Exception:
                    log.warning("instance %s stopped answering; marking it not ready", instance_id)
                    self._views[instance_id] = InstanceView(instance_id, ready=False)
