"""The OpenAI HTTP front's server: an app served by uvicorn as a task on the caller's event loop.

Contract: ``start_http`` returns once the socket is bound and uvicorn has started, or raises
``ConfigError`` (nothing left listening); ``RunningHttp.stop`` drains in-flight requests for a
grace period, then cancels them. Signals and logging belong to the embedding process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from protos.errors import ConfigError


class _Server(uvicorn.Server):
    """uvicorn without its SIGINT/SIGTERM capture: the process that embeds it owns signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class RunningHttp:
    """A started HTTP front and the port it bound."""

    server: uvicorn.Server
    task: asyncio.Task
    port: int

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting; in-flight requests get ``grace_s`` seconds, then are cancelled
        (which closes their router streams)."""
        self.server.config.timeout_graceful_shutdown = grace_s
        self.server.should_exit = True
        await self.task


async def start_http(
    app: FastAPI, host: str, port: int, tls: tuple[str, str] | None = None
) -> RunningHttp:
    """Serve ``app`` with uvicorn on ``host:port`` as a task on the running loop; with ``tls``
    (certificate chain file, private key file: ``HttpConfig.tls_files()``) HTTPS only.

    ``port`` 0 binds an ephemeral port; the bound one is ``RunningHttp.port``. Raises
    ``ConfigError`` when the address cannot be bound. Logging is left to the embedding process.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise ConfigError(
            f"the HTTP front could not bind {host}:{port} ({e}); pick a free port"
        ) from e
    cert_file, key_file = tls if tls is not None else (None, None)
    config = uvicorn.Config(
        app, host=host, port=port, lifespan="off", ws="none", log_config=None, access_log=False,
        ssl_certfile=cert_file, ssl_keyfile=key_file,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped the start
            raise ConfigError(f"the HTTP front on {host}:{port} stopped while starting")
        await asyncio.sleep(0.005)
    return RunningHttp(server=server, task=task, port=sock.getsockname()[1])
