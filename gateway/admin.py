"""``baton.v1.Admin``: the operator verbs on the gateway's port, behind an admin key.

``baton status``, ``scale``, ``drain``, ``pin``, ``unpin`` and ``autoscale`` reach the conductor
through Ray, so Ray access is admin access. This service offers the same verbs over gRPC to
whoever holds an admin key: each RPC calls the conductor actor method ``cluster.deployment``
calls (``pool_status``, ``scale``, ``drain``, ``pin_prefix``, ``unpin_prefix``,
``set_autoscale``); the gateway adds only
the key check, tokenizing a text prefix as the fronts do, and the wire (``gateway.admin_wire``).
``CloseSession`` ends an agent session through the fronts' router (``close_session``), with the
session id scoped as the fronts scope it (its API key and tenant).

Keys come as ``authorization: Bearer <admin key>`` metadata. With no admin key configured every
call is refused with PERMISSION_DENIED, so a cluster set up without one never exposes these
verbs; a missing or wrong key, an inference API key included, is UNAUTHENTICATED. Calls are
logged with their peer and verb, never with their metadata.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable, Iterable

import grpc

from gateway.admin_wire import (
    StatusView,
    autoscale_to_pb,
    drain_to_pb,
    scale_to_pb,
    soft_pin_to_pb,
    status_to_pb,
)
from gateway.auth import ADMIN_KEY_ENV, KeySet, bearer_key
from gateway.inference import UndecodableRequest, _tolerant_parser
from gateway.sessions import UnknownSession, check_session_id, scoped_session_id
from gateway.status import status_of
from gateway.tokenization import PromptTokenizer
from protos.baton.v1 import admin_pb2 as apb
from protos.errors import BatonError, InvalidRequest
from protos.wire import FrontAddresses, PoolSizes

log = logging.getLogger(__name__)

SERVICE_NAME = apb.DESCRIPTOR.services_by_name["Admin"].full_name
ADMIN_OFF_MESSAGE = (
    "the Admin service is off: the gateway has no admin key; set gateway.admin_key_file "
    f"(or ${ADMIN_KEY_ENV} in the gateway's environment) and restart the fronts"
)
BAD_KEY_MESSAGE = (
    "missing or invalid admin key: send metadata 'authorization: Bearer <admin key>' "
    "(an inference API key does not grant admin)"
)
DEFAULT_TIMEOUT_S = 600.0

_RPCS = {
    "Status": (apb.StatusRequest, apb.StatusResponse),
    "Scale": (apb.ScaleRequest, apb.ScaleResponse),
    "Drain": (apb.DrainRequest, apb.DrainResponse),
    "Pin": (apb.PinRequest, apb.SoftPin),
    "Unpin": (apb.UnpinRequest, apb.SoftPin),
    "SetAutoscale": (apb.SetAutoscaleRequest, apb.AutoscaleStatus),
    "CloseSession": (apb.CloseSessionRequest, apb.SessionClosed),
}


class AdminServicer:
    """Implements ``baton.v1.Admin`` over the conductor actor ``conductor`` (a Ray actor handle
    of ``conductor.conductor.Conductor``). ``fronts()`` says where the fronts serve (None while
    unknown); ``router`` is the fronts' router, which closes sessions (without one, or one
    without ``close_session``, no session is live). Register it with
    ``start_gateway(..., admin=...)``."""

    SERVICE_NAME = SERVICE_NAME

    def __init__(self, conductor, tokenizer: PromptTokenizer, admin_keys: Iterable[str],
                 cluster_name: str,
                 fronts: Callable[[], FrontAddresses | None] = lambda: None,
                 router=None) -> None:
        self._conductor = conductor
        self._router = router
        self._tokenizer = tokenizer
        self._admin_keys = KeySet(admin_keys)
        self._cluster_name = cluster_name
        self._fronts = fronts

    def method_handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            name: grpc.unary_unary_rpc_method_handler(
                getattr(self, name),
                request_deserializer=_tolerant_parser(request_type),
                response_serializer=response_type.SerializeToString,
            )
            for name, (request_type, response_type) in _RPCS.items()
        })

    async def _authorize(self, request, context: grpc.aio.ServicerContext, rpc: str) -> None:
        """Off without admin keys; else only a call offering one of them gets through."""
        if not self._admin_keys:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, ADMIN_OFF_MESSAGE)
        if not self._admin_keys.accepts(bearer_key(context.invocation_metadata())):
            log.warning("admin %s from %s refused: missing or invalid admin key", rpc, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, BAD_KEY_MESSAGE)
        log.info("admin %s from %s", rpc, context.peer())
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def _conductor_call(self, context: grpc.aio.ServicerContext, method: str, *args):
        """``await conductor.<method>.remote(*args)``; its errors become gRPC statuses."""
        try:
            return await getattr(self._conductor, method).remote(*args)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            status, message = _status_of(exc, method)
        await context.abort(status, message)

    async def Status(self, request: apb.StatusRequest, context) -> apb.StatusResponse:
        await self._authorize(request, context, "Status")
        pools = await self._conductor_call(context, "pool_status")
        return status_to_pb(StatusView(pools, self._fronts(), self._cluster_name))

    async def Scale(self, request: apb.ScaleRequest, context) -> apb.ScaleResponse:
        await self._authorize(request, context, "Scale")
        sizes = PoolSizes(prefill=request.prefill if request.HasField("prefill") else None,
                          decode=request.decode if request.HasField("decode") else None)
        if not sizes.requested():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "set prefill and/or decode")
        timeout_s = await _timeout_s(request.timeout_s, context)
        reason = f"operator request (Admin API from {context.peer()})"
        results = await self._conductor_call(context, "scale", sizes, timeout_s, reason)
        return scale_to_pb(results)

    async def Drain(self, request: apb.DrainRequest, context) -> apb.DrainResponse:
        await self._authorize(request, context, "Drain")
        if not request.instance_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "instance_id is empty: give an instance id as Status lists it")
        timeout_s = await _timeout_s(request.timeout_s, context)
        return drain_to_pb(await self._conductor_call(context, "drain", request.instance_id, timeout_s))

    async def Pin(self, request: apb.PinRequest, context) -> apb.SoftPin:
        await self._authorize(request, context, "Pin")
        if not request.name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name is empty: name the pin")
        prefix = request.WhichOneof("prefix")
        if prefix is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give the prefix as text or token_ids")
        if prefix == "text":  # as the fronts tokenize a plain-text prompt (GatewayHost.tokenize)
            token_ids = await asyncio.to_thread(self._tokenizer.encode_text, request.text)
        else:
            token_ids = list(request.token_ids.ids)
        pin = await self._conductor_call(context, "pin_prefix", request.name, list(token_ids),
                                         request.cache_salt)
        return soft_pin_to_pb(pin)

    async def Unpin(self, request: apb.UnpinRequest, context) -> apb.SoftPin:
        await self._authorize(request, context, "Unpin")
        return soft_pin_to_pb(await self._conductor_call(context, "unpin_prefix", request.name))

    async def SetAutoscale(self, request: apb.SetAutoscaleRequest, context) -> apb.AutoscaleStatus:
        await self._authorize(request, context, "SetAutoscale")
        log.warning("autoscale %s by the Admin API from %s", "on" if request.enabled else "off",
                    context.peer())
        return autoscale_to_pb(await self._conductor_call(context, "set_autoscale",
                                                          request.enabled))

    async def CloseSession(self, request: apb.CloseSessionRequest, context) -> apb.SessionClosed:
        await self._authorize(request, context, "CloseSession")
        try:
            check_session_id(request.session_id)
            if not request.session_id:
                raise InvalidRequest("session_id is empty; name the session to close")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        close = getattr(self._router, "close_session", None)
        ended = None
        if close is not None:
            scoped_id = scoped_session_id(request.api_key, request.tenant, request.session_id)
            try:
                ended = await close(scoped_id)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                status, message = _status_of(exc, "close_session")
                await context.abort(status, message)
        if ended is None:
            missing = UnknownSession(f"no live session {request.session_id!r} under that API key "
                                     f"and tenant {request.tenant!r}: it was never opened, is "
                                     "closed already, or its TTL lapsed")
            await context.abort(status_of(missing).grpc_code, str(missing))
        return apb.SessionClosed(session_id=request.session_id, num_steps=ended.num_steps,
                                 released_blocks=ended.released_blocks)


async def _timeout_s(value: float, context: grpc.aio.ServicerContext) -> float:
    if not math.isfinite(value) or value < 0:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"timeout_s must be a finite number of seconds >= 0, got {value}")
    return value or DEFAULT_TIMEOUT_S


def _status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status for a failed conductor call: an operator error keeps its own status and
    message; a conductor that is gone is UNAVAILABLE; anything else is Baton's bug."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    if isinstance(exc, BatonError):
        return status_of(exc).grpc_code, str(exc)
    if isinstance(exc, RayActorError):
        return (grpc.StatusCode.UNAVAILABLE,
                f"the conductor does not answer ({type(exc).__name__}); is Baton up?")
    log.error("admin call %s failed", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}; the gateway log has the details"
