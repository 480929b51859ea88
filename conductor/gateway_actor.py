"""The fronts as a detached Ray actor, so ``baton up`` can return while they keep serving.

The same pieces ``baton serve`` runs in its own process: a ``LiveRouter`` to the conductor, the
gRPC gateway (``baton.v1.Inference`` and the key-guarded ``baton.v1.Admin``) and the OpenAI HTTP
front (whose ``/metrics`` serves Baton's metrics), plus the pool-gauge poller, all on the actor's
event loop.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import ray

from conductor.config import ClusterConfig
from engine.models import PreparedModel

log = logging.getLogger(__name__)


class FrontAddresses(msgspec.Struct, frozen=True):
    host_ip: str
    grpc_port: int | None
    http_port: int | None
    http_tls: bool = False
    """The HTTP front serves HTTPS (``http.tls_cert_file``)."""


class GatewayHost:
    """Async Ray actor: ``await start()`` once; ``addresses()`` says where it serves."""

    def __init__(self, config: ClusterConfig, model: PreparedModel, conductor_name: str) -> None:
        logging.basicConfig(level=logging.INFO)
        self._config = config
        self._model = model
        self._conductor_name = conductor_name
        self._addresses: FrontAddresses | None = None
        self._gateway = None
        self._http = None
        self._router = None
        self._gauges = None
        self._tokenizer = None

    async def start(self) -> FrontAddresses:
        if self._addresses is not None:
            return self._addresses
        from conductor.admin import AdminServicer
        from conductor.auth import read_admin_keys
        from conductor.gateway import InferenceServicer, start_gateway
        from conductor.live_router import LiveRouter
        from conductor.metrics import PoolGaugePoller
        from conductor.serve import _read_api_keys
        from conductor.tokenization import PromptTokenizer

        cfg, model = self._config, self._model
        conductor = ray.get_actor(self._conductor_name, namespace=cfg.ray.namespace)
        tokenizer = self._tokenizer = await asyncio.to_thread(PromptTokenizer, model.path)
        max_len = min(cfg.engine.max_model_len_tokens or model.max_model_len, model.max_model_len)
        self._router = LiveRouter(conductor, cfg.ray.namespace)
        self._router.start()
        self._gauges = PoolGaugePoller(conductor)
        self._gauges.start()
        api_keys = _read_api_keys(cfg.auth.api_key_file)
        admin_keys = read_admin_keys(cfg.gateway.admin_key_file, api_keys)
        http_tls = cfg.http.tls_files()
        grpc_port = http_port = None
        if cfg.gateway.enabled:
            servicer = InferenceServicer(self._router, tokenizer, model.name, max_len, api_keys=api_keys)
            admin = AdminServicer(conductor, tokenizer, admin_keys, cfg.name,
                                  fronts=lambda: self._addresses)
            self._gateway = await start_gateway(servicer, cfg.gateway.host, cfg.gateway.port,
                                                 tls=cfg.gateway.tls_credentials(), admin=admin)
            grpc_port = self._gateway.port
            asyncio.get_running_loop().create_task(self._serving_when_ready())
        if cfg.http.enabled:
            from conductor.openai_http import build_app, start_http

            app = build_app(self._router, tokenizer, model.name, max_len, api_keys=api_keys)
            self._http = await start_http(app, cfg.http.host, cfg.http.port, tls=http_tls)
            http_port = self._http.port
        self._addresses = FrontAddresses(ray.util.get_node_ip_address(), grpc_port, http_port,
                                         http_tls is not None)
        log.info("fronts up: %s", self._addresses)
        return self._addresses

    async def _serving_when_ready(self) -> None:
        """gRPC health follows the pools: NOT_SERVING until a prefill and a decode are ready."""
        serving = None
        while self._gateway is not None:
            ready = self._router.is_ready()
            if ready != serving:
                await self._gateway.set_serving(ready)
                serving = ready
            await asyncio.sleep(0.5)

    async def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids, as the fronts tokenize a prompt (for ``baton pin``)."""
        if self._tokenizer is None:
            raise RuntimeError("the fronts have not started yet")
        return self._tokenizer.encode_text(text)

    async def addresses(self) -> FrontAddresses | None:
        return self._addresses

    async def stop(self) -> None:
        if self._gateway is not None:
            gateway, self._gateway = self._gateway, None
            await gateway.stop(grace_s=5)
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._router is not None:
            self._router.stop()
        if self._gauges is not None:
            self._gauges.stop()
