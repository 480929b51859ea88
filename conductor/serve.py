"""``baton serve``: a whole cluster plus the fronts (gRPC Inference and Admin, OpenAI HTTP), in
the foreground.

The gateway binds first and answers ``UNAVAILABLE`` (health NOT_SERVING) while the engines
load, so clients and load balancers see a clear state instead of a refused connection.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable

from conductor.admin import AdminServicer
from conductor.auth import KeySet, read_admin_keys, read_key_file
from conductor.cluster import LocalCluster
from conductor.config import ClusterConfig
from conductor.gateway import InferenceServicer, RunningGateway, start_gateway
from conductor.gateway_actor import FrontAddresses
from conductor.live_router import LiveRouter
from conductor.metrics import PoolGaugePoller
from conductor.tokenization import PromptTokenizer

log = logging.getLogger(__name__)


def _read_api_keys(path: str | None) -> KeySet:
    """Accepted API keys, one per line of ``path`` (blank lines and ``#`` comments skipped)."""
    return read_key_file(path, "auth.api_key_file")


class BatonServer:
    """Cluster + router + gateway. ``await start()``, then ``await stop()``."""

    def __init__(self, config: ClusterConfig, progress: Callable[[str], None] = lambda _m: None):
        self.config = config
        self.progress = progress
        self.cluster = LocalCluster(config, progress=progress)
        self.gateway: RunningGateway | None = None
        self.http = None
        self.router: LiveRouter | None = None
        self.start_seconds: float | None = None
        self.gauges: PoolGaugePoller | None = None

    @property
    def port(self) -> int:
        assert self.gateway is not None, "the gRPC gateway is disabled (gateway.enabled: false)"
        return self.gateway.port

    @property
    def http_port(self) -> int:
        assert self.http is not None, "the HTTP front is disabled (http.enabled: false)"
        return self.http.port

    @property
    def target(self) -> str:
        return f"{self.config.gateway.host}:{self.port}"

    async def start(self, wait_ready: bool = True) -> None:
        started = time.perf_counter()
        # secrets and certificates first: a bad one is a config error before anything starts
        api_keys = _read_api_keys(self.config.auth.api_key_file)
        admin_keys = read_admin_keys(self.config.gateway.admin_key_file, api_keys)
        grpc_tls = self.config.gateway.tls_credentials()
        http_tls = self.config.http.tls_files()
        await asyncio.to_thread(self.cluster.start, False)
        model = self.cluster.model
        assert model is not None
        tokenizer = await asyncio.to_thread(PromptTokenizer, model.path)
        max_len = min(self.config.engine.max_model_len_tokens or model.max_model_len,
                      model.max_model_len)
        self.router = LiveRouter(self.cluster.conductor, self.cluster.namespace)
        self.router.start()
        self.gauges = PoolGaugePoller(self.cluster.conductor)
        self.gauges.start()
        servicer = InferenceServicer(self.router, tokenizer, model.name, max_len,
                                     api_keys=api_keys)
        if self.config.gateway.enabled:
            admin = AdminServicer(self.cluster.conductor, tokenizer, admin_keys, self.config.name,
                                  fronts=self._fronts)
            self.gateway = await start_gateway(
                servicer, self.config.gateway.host, self.config.gateway.port,
                tls=grpc_tls, admin=admin,
            )
            await self.gateway.set_serving(False)
            self.progress(f"gateway listening on {self.target} (not serving until workers are ready)")
        if self.config.http.enabled:
            from conductor.openai_http import build_app, start_http

            app = build_app(self.router, tokenizer, model.name, max_len, api_keys=api_keys)
            self.http = await start_http(app, self.config.http.host, self.config.http.port,
                                         tls=http_tls)
            self.progress(f"OpenAI-compatible HTTP on {self.http_url}")
        if wait_ready:
            await self.wait_ready()
        self.start_seconds = time.perf_counter() - started

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.http.tls_cert_file else "http"
        return f"{scheme}://{self.config.http.host}:{self.http_port}/v1"

    def _fronts(self) -> FrontAddresses:
        return FrontAddresses(
            self.config.gateway.host, self.gateway.port if self.gateway else None,
            self.http.port if self.http else None, self.config.http.tls_cert_file is not None)

    async def wait_ready(self) -> None:
        await asyncio.to_thread(self.cluster.wait_ready)
        while not self.router.is_ready():  # the router polls the conductor
            await asyncio.sleep(0.05)
        if self.gateway is not None:
            await self.gateway.set_serving(True)
            self.progress(f"serving on {self.target}")
        if self.http is not None:
            self.progress(f"serving HTTP on {self.http_url}")

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop(grace_s=5)
            self.gateway = None
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self.router is not None:
            self.router.stop()
        if self.gauges is not None:
            self.gauges.stop()
        await asyncio.to_thread(self.cluster.stop)


def _install_stop_handlers(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop``. Called again once Ray is up, because Ray's core worker
    installs its own fatal-signal handler that would otherwise kill the process on SIGTERM."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve_forever(config: ClusterConfig, progress: Callable[[str], None]) -> None:
    """Run until SIGINT (Ctrl-C) or SIGTERM, then shut everything down."""
    stop = asyncio.Event()
    _install_stop_handlers(stop)
    server = BatonServer(config, progress)
    try:
        starting = asyncio.create_task(server.start())
        stopping = asyncio.create_task(stop.wait())
        while not starting.done():
            await asyncio.wait({starting, stopping}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            _install_stop_handlers(stop)
            if stop.is_set():
                starting.cancel()
                break
        if not stop.is_set():
            starting.result()
            progress(f"ready in {server.start_seconds:.1f} s; Ctrl-C to stop")
            await stopping
    finally:
        progress("shutting down")
        await server.stop()
        progress("stopped")
