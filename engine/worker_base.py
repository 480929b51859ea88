"""What prefill and decode workers share: building the engine inside a Ray actor, and stats."""

from __future__ import annotations

import logging
import time

from engine.builder import Role, StoreWiring, build_engine_args
from engine.config import EngineConfig
from engine.messages import InstanceStats
from engine.models import PreparedModel
from engine.runner import EngineRunner

log = logging.getLogger(__name__)


class EngineWorker:
    """Base of the worker actors: one vLLM engine for one role, plus its connector's stats.

    Ray actor classes subclass this; the constructor runs in the actor's own process, where the
    engine environment (``engine.builder.engine_env``) was set through the actor's runtime env.
    """

    role: Role = "plain"

    def __init__(
        self,
        instance_id: str,
        config: EngineConfig,
        model: PreparedModel,
        store: StoreWiring | None,
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self.instance_id = instance_id
        self.model = model
        started = time.perf_counter()
        args = build_engine_args(config, model, self.role, instance_id, store)
        self.runner = EngineRunner(args)
        self.engine_start_s = time.perf_counter() - started
        log.info("%s %s ready in %.1f s", self.role, instance_id, self.engine_start_s)

    def ready(self) -> float:
        """Seconds the engine took to start; returning at all means the engine is up."""
        return self.engine_start_s

    def stats(self) -> InstanceStats:
        running, waiting = self.runner.num_running_and_waiting()
        return InstanceStats(
            instance_id=self.instance_id,
            role=self.role,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_finished_reqs=self.runner.num_finished_reqs,
            ready=self.runner.alive,
        )

    def connector_counters(self) -> dict[str, int]:
        """The KV connector's counters (blocks looked up, hit, loaded, saved)."""
        from kvstore.connector import connector_stats

        s = connector_stats(self.instance_id)
        return {
            "lookups_blocks": s.lookups_blocks,
            "hits_blocks": s.hits_blocks,
            "loaded_blocks": s.loaded_blocks,
            "saved_blocks": s.saved_blocks,
        }

    def shutdown(self) -> None:
        self.runner.shutdown()
