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

from cluster.config import ClusterConfig
from cluster.local import LocalCluster
from gateway.fronts import Fronts, FrontsConfig, FrontSecrets
from protos.wire import FrontAddresses

log = logging.getLogger(__name__)


def fronts_config(config: ClusterConfig) -> FrontsConfig:
    """The fronts' part of the cluster config."""
    return FrontsConfig(config.name, config.ray.namespace, config.gateway, config.http,
                        config.auth, config.engine.max_model_len_tokens,
                        config.engine.structured_outputs_backend, config.engine_grpc,
                        config.engine.dtype,
                        config.engine.max_num_seqs * config.decode.num_instances,
                        config.sessions)


class BatonServer:
    """Cluster + fronts (``gateway.fronts``). ``await start()``, then ``await stop()``."""

    def __init__(self, config: ClusterConfig, progress: Callable[[str], None] = lambda _m: None,
                 store_nodes: int = 1):
        """``store_nodes``: see ``cluster.local`` (2: prefill and decode on two store nodes)."""
        self.config = config
        self.progress = progress
        self.cluster = LocalCluster(config, progress=progress, store_nodes=store_nodes)
        self.fronts: Fronts | None = None
        self.start_seconds: float | None = None
        self._stopped = False

    @property
    def router(self):
        return self.fronts.router if self.fronts else None

    @property
    def gateway(self):
        return self.fronts.gateway if self.fronts else None

    @property
    def http(self):
        return self.fronts.http if self.fronts else None

    @property
    def gauges(self):
        return self.fronts.gauges if self.fronts else None

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
        config = fronts_config(self.config)
        secrets = FrontSecrets.read(config)
        try:
            await asyncio.to_thread(self.cluster.start, False)
            model = self.cluster.model
            assert model is not None
            self.fronts = Fronts(config, secrets, self.progress)
            await self.fronts.start(self.cluster.conductor, model, self._fronts)
            if wait_ready:
                await self.wait_ready()
        except BaseException:  # a worker that cannot start: nothing is left running
            await self.stop()
            raise
        self.start_seconds = time.perf_counter() - started

    @property
    def http_url(self) -> str:
        return self.fronts.http_url

    def _fronts(self) -> FrontAddresses:
        return FrontAddresses(
            self.config.gateway.host, self.gateway.port if self.gateway else None,
            self.http.port if self.http else None, self.config.http.tls_cert_file is not None,
            grpc_host=self.config.gateway.host, http_host=self.config.http.host)

    async def wait_ready(self) -> None:
        await asyncio.to_thread(self.cluster.wait_ready)
        while not self.router.is_ready():  # the router polls the conductor
            await asyncio.sleep(0.05)
        if self.gateway is not None:
            await self.fronts.set_serving(True)
            self.progress(f"serving on {self.target}")
        if self.http is not None:
            self.progress(f"serving HTTP on {self.http_url}")

    async def stop(self) -> None:
        """Stop the fronts and the cluster. Once only: a second call (a start that failed has
        stopped everything already) must not touch Ray, whose next call would start a fresh
        connection to the cluster just shut down and hang on it."""
        if self._stopped:
            return
        self._stopped = True
        if self.fronts is not None:
            await self.fronts.stop()
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
