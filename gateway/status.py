"""What a client sees for each kind of Baton error: the one table the fronts answer from.

The errors themselves (``protos.errors`` and the kinds rooms add under it) know no wire; the gRPC
Inference and Admin services and the OpenAI HTTP front all look an error up here. An error takes
the row of its nearest listed class (``UnknownModel`` is an ``InvalidRequest`` with its own
row; ``EngineRejected`` has none, so it answers as the ``InvalidRequest`` it is), and the HTTP
front names it by that class in its ``code`` field. A kind that deserves its own answer gets its
own row.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

import grpc

from conductor.policy import Overloaded
from gateway.sessions import UnknownSession
from protos.errors import (
    BatonError,
    ConfigError,
    DrainTimeout,
    InvalidRequest,
    NoWorkerReady,
    ScaleRefused,
    StoreError,
    UnknownInstance,
    UnknownModel,
    WorkerFailed,
)


@dataclass(frozen=True)
class FrontStatus:
    grpc_code: grpc.StatusCode
    http_status: HTTPStatus


STATUS_BY_ERROR: dict[type[BatonError], FrontStatus] = {
    BatonError: FrontStatus(grpc.StatusCode.INTERNAL, HTTPStatus.INTERNAL_SERVER_ERROR),
    InvalidRequest: FrontStatus(grpc.StatusCode.INVALID_ARGUMENT, HTTPStatus.BAD_REQUEST),
    UnknownModel: FrontStatus(grpc.StatusCode.INVALID_ARGUMENT, HTTPStatus.NOT_FOUND),
    Overloaded: FrontStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, HTTPStatus.TOO_MANY_REQUESTS),
    NoWorkerReady: FrontStatus(grpc.StatusCode.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE),
    WorkerFailed: FrontStatus(grpc.StatusCode.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE),
    StoreError: FrontStatus(grpc.StatusCode.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE),
    ConfigError: FrontStatus(grpc.StatusCode.FAILED_PRECONDITION, HTTPStatus.INTERNAL_SERVER_ERROR),
    # the operator verbs (Admin service only; the HTTP front has none of them)
    UnknownInstance: FrontStatus(grpc.StatusCode.NOT_FOUND, HTTPStatus.NOT_FOUND),
    ScaleRefused: FrontStatus(grpc.StatusCode.FAILED_PRECONDITION, HTTPStatus.CONFLICT),
    DrainTimeout: FrontStatus(grpc.StatusCode.DEADLINE_EXCEEDED, HTTPStatus.GATEWAY_TIMEOUT),
    # closing an agent session (Admin CloseSession, HTTP DELETE /v1/sessions/{id})
    UnknownSession: FrontStatus(grpc.StatusCode.NOT_FOUND, HTTPStatus.NOT_FOUND),
}
"""Error kind → what the fronts answer. ``BatonError``'s row catches every kind not listed."""


DEFAULT_RETRY_AFTER_S = 1
"""The retry hint of a retryable error that names none (a worker died, none is ready yet)."""
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def retry_after_s(error: BatonError) -> float | None:
    """When the client should try again: the error's own hint (admission's predicted wait), else
    ``DEFAULT_RETRY_AFTER_S`` for a retryable kind; None for an error a retry cannot fix. Both
    fronts send it: gRPC as ``retry-after-ms`` trailing metadata, HTTP as ``Retry-After``."""
    if status_of(error).grpc_code not in RETRYABLE:
        return None
    hint = getattr(error, "retry_after_s", None)
    return DEFAULT_RETRY_AFTER_S if hint is None else hint


def category_of(error: BatonError) -> type[BatonError]:
    """The nearest class of ``error``'s that ``STATUS_BY_ERROR`` lists."""
    return next(cls for cls in type(error).__mro__ if cls in STATUS_BY_ERROR)


def status_of(error: BatonError) -> FrontStatus:
    return STATUS_BY_ERROR[category_of(error)]
