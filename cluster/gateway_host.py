"""The fronts as a detached Ray actor, so ``baton up`` can return while they keep serving.

The same fronts ``baton serve`` runs in its own process (``gateway.fronts``), on the actor's
event loop; gRPC health follows the pools' readiness.
"""

from __future__ import annotations

import logging

import ray

from cluster.config import ClusterConfig
from cluster.serve import fronts_config
from engine.models import PreparedModel
from gateway.fronts import Fronts, FrontSecrets
from protos.wire import FrontAddresses

log = logging.getLogger(__name__)


class GatewayHost:
    """Async Ray actor: ``await start()`` once; ``addresses()`` says where it serves."""

    def __init__(self, config: ClusterConfig, model: PreparedModel, conductor_name: str) -> None:
        logging.basicConfig(level=logging.INFO)
        self._config = config
        self._model = model
        self._conductor_name = conductor_name
        self._addresses: FrontAddresses | None = None
        self._fronts: Fronts | None = None

    async def start(self) -> FrontAddresses:
        if self._addresses is not None:
            return self._addresses
        cfg = self._config
        conductor = ray.get_actor(self._conductor_name, namespace=cfg.ray.namespace)
        config = fronts_config(cfg)
        self._fronts = fronts = Fronts(config, FrontSecrets.read(config))
        await fronts.start(conductor, self._model, lambda: self._addresses, follow_readiness=True)
        self._addresses = FrontAddresses(
            ray.util.get_node_ip_address(), fronts.gateway.port if fronts.gateway else None,
            fronts.http.port if fronts.http else None, fronts.secrets.http_tls is not None,
            grpc_host=cfg.gateway.host, http_host=cfg.http.host)
        log.info("fronts up: %s", self._addresses)
        return self._addresses

    async def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids, as the fronts tokenize a prompt (for ``baton pin``)."""
        if self._fronts is None or self._fronts.tokenizer is None:
            raise RuntimeError("the fronts have not started yet")
        return self._fronts.tokenizer.encode_text(text)

    async def addresses(self) -> FrontAddresses | None:
        return self._addresses

    async def stop(self) -> None:
        if self._fronts is not None:
            await self._fronts.stop()
