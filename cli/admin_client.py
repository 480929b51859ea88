"""The operator verbs through a gateway's ``baton.v1.Admin`` service: what ``baton status``,
``scale``, ``drain``, ``pin`` and ``unpin`` call with ``--endpoint``.

``AdminClient`` has the verbs of ``cluster.deployment.RayOperator`` and returns the same
structs; its failures are the ``BatonError``s the CLI already maps to exit codes (an unknown
instance or pin is ``UnknownInstance``/``InvalidRequest``, a gateway that does not answer is
``NotUp``), plus ``NotAuthorized`` for a refused admin key.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Mapping

import grpc

from cluster.deployment import NotUp
from gateway.admin_wire import (
    StatusView,
    autoscale_from_pb,
    drain_from_pb,
    scale_from_pb,
    soft_pin_from_pb,
    status_from_pb,
)
from gateway.auth import ADMIN_KEY_ENV
from gateway.client import open_channel
from protos.baton.v1 import admin_pb2 as apb
from protos.baton.v1 import admin_pb2_grpc as apb_grpc
from protos.baton.v1 import inference_pb2 as pb
from protos.errors import BatonError, ConfigError, InvalidRequest, UnknownInstance
from protos.wire import DrainResult, PoolSizes, ScaleResult, SessionEnd, SoftPin

CONNECT_TIMEOUT_S = 10.0
QUICK_CALL_TIMEOUT_S = 60.0
"""Deadline of Status, Pin and Unpin; Scale and Drain get their own timeout plus this."""


class NotAuthorized(BatonError):
    """The gateway refused the admin key, or has no Admin service enabled."""


class AdminCallFailed(BatonError):
    """The Admin service answered with an error that is not the caller's input."""


def read_admin_key(key_file: str | Path | None,
                   environ: Mapping[str, str] = os.environ) -> str:
    """The admin key: the first key line of ``key_file`` (as ``gateway.admin_key_file`` is
    written), else ``$BATON_ADMIN_KEY``. ``ConfigError`` when there is none."""
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--admin-key-file: cannot read {key_file}: {exc.strerror}") from exc
        keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        if not keys:
            raise ConfigError(f"--admin-key-file: {key_file} holds no key")
        return keys[0]
    key = environ.get(ADMIN_KEY_ENV, "").strip()
    if not key:
        raise ConfigError(f"no admin key: pass --admin-key-file FILE or set ${ADMIN_KEY_ENV}")
    return key


class AdminClient:
    """One gateway's Admin service at ``endpoint`` (``host:port``); TLS when ``tls_ca_file``
    names the PEM roots to trust."""

    def __init__(self, endpoint: str, admin_key: str, tls_ca_file: str | None = None,
                 connect_timeout_s: float | None = None) -> None:
        if tls_ca_file is not None and not os.access(tls_ca_file, os.R_OK):
            raise ConfigError(f"--tls-ca: cannot read {tls_ca_file}")
        self.endpoint = endpoint
        self._metadata = (("authorization", f"Bearer {admin_key}"),)
        self._tls_ca_file = tls_ca_file
        self._connect_timeout_s = connect_timeout_s or CONNECT_TIMEOUT_S

    def __repr__(self) -> str:
        return f"AdminClient({self.endpoint!r})"

    def status(self) -> StatusView:
        return status_from_pb(self._call("Status", apb.StatusRequest()))

    def scale(self, sizes: PoolSizes, timeout_s: float) -> list[ScaleResult]:
        request = apb.ScaleRequest(timeout_s=timeout_s, **dict(sizes.requested()))
        return scale_from_pb(self._call("Scale", request, timeout_s + QUICK_CALL_TIMEOUT_S))

    def drain(self, instance_id: str, timeout_s: float) -> DrainResult:
        request = apb.DrainRequest(instance_id=instance_id, timeout_s=timeout_s)
        return drain_from_pb(self._call("Drain", request, timeout_s + QUICK_CALL_TIMEOUT_S))

    def pin(self, pin_name: str, text: str | None = None, cache_salt: str = "",
            token_ids: list[int] | None = None) -> SoftPin:
        request = apb.PinRequest(name=pin_name, cache_salt=cache_salt)
        if token_ids is not None:
            request.token_ids.CopyFrom(pb.TokenIds(ids=token_ids))
        else:
            request.text = text or ""
        return soft_pin_from_pb(self._call("Pin", request))

    def unpin(self, pin_name: str) -> SoftPin:
        return soft_pin_from_pb(self._call("Unpin", apb.UnpinRequest(name=pin_name)))

    def close_session(self, session_id: str, tenant: str = "", api_key: str = "") -> SessionEnd:
        reply = self._call("CloseSession", apb.CloseSessionRequest(
            session_id=session_id, tenant=tenant, api_key=api_key))
        return SessionEnd(reply.session_id, reply.num_steps, reply.released_blocks)

    def set_autoscale(self, enabled: bool):
        return autoscale_from_pb(self._call("SetAutoscale", apb.SetAutoscaleRequest(enabled=enabled)))

    def _call(self, rpc: str, request, timeout_s: float = QUICK_CALL_TIMEOUT_S):
        return asyncio.run(self._acall(rpc, request, timeout_s))

    async def _acall(self, rpc: str, request, timeout_s: float):
        async with open_channel(self.endpoint, self._tls_ca_file) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), self._connect_timeout_s)
            except asyncio.TimeoutError as exc:
                tls_hint = "it may not serve TLS" if self._tls_ca_file else \
                    "if it serves TLS, pass --tls-ca"
                raise NotUp(f"no Baton gateway answers at {self.endpoint} within "
                            f"{self._connect_timeout_s:.0f} s (is it up? {tls_hint})") from exc
            try:
                return await getattr(apb_grpc.AdminStub(channel), rpc)(
                    request, timeout=timeout_s, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                raise _error_of(exc, self.endpoint) from exc


def _error_of(exc: grpc.aio.AioRpcError, endpoint: str) -> BatonError:
    """The ``BatonError`` the CLI maps to the same exit code as the Ray path's error."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return NotAuthorized(f"the gateway at {endpoint} refused the admin key: {details} "
                             f"(check --admin-key-file or ${ADMIN_KEY_ENV})")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return NotAuthorized(f"the gateway at {endpoint} refused: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownInstance(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    return AdminCallFailed(f"{details} ({code.name})")
