"""The fronts assembled once: the live router to the conductor, the pool-gauge poller, the gRPC
gateway (``baton.v1.Inference`` and the key-guarded ``baton.v1.Admin``) and the OpenAI HTTP front,
all on the caller's event loop.

``baton serve`` (``cluster.serve``) runs them in its own process; ``baton up`` runs them inside a
detached Ray actor (``cluster.gateway_host``). Both build them here, so the two never drift.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import msgspec

from engine.models import PreparedModel
from gateway.admin import AdminServicer
from gateway.auth import KeySet, read_admin_keys, read_api_keys
from gateway.config import AuthConfig, EngineGrpcConfig, GatewayConfig, HttpConfig
from gateway.inference import InferenceServicer, RunningGateway, start_gateway
from gateway.live_router import LiveRouter
from gateway.metrics import PoolGaugePoller
from gateway.sessions import SessionsConfig
from gateway.tokenization import PromptTokenizer
from protos.wire import FrontAddresses

log = logging.getLogger(__name__)


class FrontsConfig(msgspec.Struct, frozen=True):
    """The parts of the cluster config the fronts read."""

    cluster_name: str
    namespace: str
    gateway: GatewayConfig
    http: HttpConfig
    auth: AuthConfig
    max_model_len_tokens: int | None = None
    """``engine.max_model_len_tokens`` (None: the model's own limit)."""
    structured_backend: str = "auto"
    """``engine.structured_outputs_backend``: the schemas the engines can enforce."""
    engine_grpc: EngineGrpcConfig = EngineGrpcConfig()
    """The engine gRPC contract (``gateway.engine_contract``); off unless its port is set."""
    engine_dtype: str = ""
    """``engine.dtype``, as the engine contract's ``GetServerInfo`` reports it."""
    decode_max_num_seqs: int = 0
    """Sequences the decode pool runs at once (``engine.max_num_seqs`` × decode instances)."""
    sessions: SessionsConfig = SessionsConfig()
    """``sessions``: agent session ids and ``cache_control`` at the fronts (``gateway.sessions``)."""


@dataclass(frozen=True)
class FrontSecrets:
    """Keys and certificates, read before anything starts: a bad one is a config error then."""

    api_keys: KeySet
    admin_keys: KeySet
    grpc_tls: tuple[bytes, bytes] | None
    http_tls: tuple[str, str] | None

    @classmethod
    def read(cls, config: FrontsConfig) -> "FrontSecrets":
        api_keys = read_api_keys(config.auth.api_key_file)
        return cls(api_keys, read_admin_keys(config.gateway.admin_key_file, api_keys),
                   config.gateway.tls_credentials(), config.http.tls_files())


class Fronts:
    """``await start(conductor, model)``, then ``await stop()``. The gRPC gateway binds at once
    and reports NOT_SERVING until ``set_serving(True)`` (or, with ``follow_readiness``, until the
    router sees a ready cluster, following it from then on)."""

    def __init__(self, config: FrontsConfig, secrets: FrontSecrets,
                 progress: Callable[[str], None] = lambda _m: None) -> None:
        self.config = config
        self.secrets = secrets
        self.progress = progress
        self.router: LiveRouter | None = None
        self.gauges: PoolGaugePoller | None = None
        self.gateway: RunningGateway | None = None
        self.http = None
        self.engine_contract = None
        """The engine gRPC contract's server (``gateway.engine_contract``) when it is on."""
        self.tokenizer: PromptTokenizer | None = None
        self._follower: asyncio.Task | None = None
        self._addresses: Callable[[], FrontAddresses | None] = lambda: None

    async def start(self, conductor, model: PreparedModel,
                    addresses: Callable[[], FrontAddresses | None],
                    follow_readiness: bool = False) -> None:
        """Start every enabled front against ``conductor`` (its actor handle). ``addresses``
        answers the Admin service's question of where the fronts serve."""
        cfg, secrets = self.config, self.secrets
        self._addresses = addresses
        self.tokenizer = tokenizer = await asyncio.to_thread(PromptTokenizer, model.path)
        max_len = min(cfg.max_model_len_tokens or model.max_model_len, model.max_model_len)
        self.router = LiveRouter(conductor, cfg.namespace, decode_stream=cfg.gateway.decode_stream,
                                 lookup_device_hits=cfg.gateway.lookup_device_hits)
        self.router.start()
        self.gauges = PoolGaugePoller(conductor)
        self.gauges.start()
        if cfg.gateway.enabled:
            servicer = InferenceServicer(self.router, tokenizer, model.name, max_len,
                                         api_keys=secrets.api_keys,
                                         structured_backend=cfg.structured_backend,
                                         sessions=cfg.sessions)
            admin = AdminServicer(conductor, tokenizer, secrets.admin_keys, cfg.cluster_name,
                                  fronts=addresses, router=self.router)
            self.gateway = await start_gateway(servicer, cfg.gateway.host, cfg.gateway.port,
                                               tls=secrets.grpc_tls, admin=admin)
            await self.gateway.set_serving(False)
            self.progress(f"gateway listening on {cfg.gateway.host}:{self.gateway.port} "
                          "(not serving until workers are ready)")
        if cfg.http.enabled:
            from gateway.openai_http import build_app, start_http

            app = build_app(self.router, tokenizer, model.name, max_len, api_keys=secrets.api_keys,
                            tool_call_parser=cfg.http.tool_call_parser,
                            structured_backend=cfg.structured_backend, sessions=cfg.sessions)
            self.http = await start_http(app, cfg.http.host, cfg.http.port, tls=secrets.http_tls)
            self.progress(f"OpenAI-compatible HTTP on {self.http_url}")
        if cfg.engine_grpc.port is not None:
            await self._start_engine_contract(conductor, model, max_len)
        if follow_readiness and (self.gateway is not None or self.engine_contract is not None):
            self._follower = asyncio.get_running_loop().create_task(self._follow_readiness())

    async def _start_engine_contract(self, conductor, model: PreparedModel, max_len: int) -> None:
        from gateway.engine_contract import (
            EngineContractServicer,
            RayClusterView,
            ServedModel,
            start_engine_contract,
        )

        cfg = self.config
        served = ServedModel(model.path, model.name, max_len, self.tokenizer.vocab_size,
                             cfg.engine_dtype, cfg.decode_max_num_seqs)
        servicer = EngineContractServicer(self.router, RayClusterView(conductor), self.tokenizer,
                                          served, api_keys=self.secrets.api_keys
                                          if cfg.engine_grpc.require_api_key else frozenset(),
                                          structured_backend=cfg.structured_backend,
                                          sessions=cfg.sessions)
        self.engine_contract = await start_engine_contract(
            servicer, cfg.engine_grpc.host, cfg.engine_grpc.port, tls=self.secrets.grpc_tls)
        self.progress(f"engine gRPC contract (vllm.grpc.engine) on "
                      f"{cfg.engine_grpc.host}:{self.engine_contract.port}")

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.http.tls_cert_file else "http"
        return f"{scheme}://{self.config.http.host}:{self.http.port if self.http else 0}/v1"

    async def set_serving(self, serving: bool) -> None:
        if self.gateway is not None:
            await self.gateway.set_serving(serving)
        if self.engine_contract is not None:
            await self.engine_contract.set_serving(serving)

    async def _follow_readiness(self) -> None:
        """gRPC health follows the pools: NOT_SERVING until a prefill and a decode are ready."""
        serving = None
        while True:  # until stop cancels it
            ready = self.router.is_ready()
            if ready != serving:
                await self.set_serving(ready)
                serving = ready
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            self._follower = None
        if self.gateway is not None:
            gateway, self.gateway = self.gateway, None
            await gateway.stop(grace_s=5)
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self.engine_contract is not None:
            contract, self.engine_contract = self.engine_contract, None
            await contract.stop(grace_s=5)
        if self.router is not None:
            self.router.stop()
        if self.gauges is not None:
            self.gauges.stop()
