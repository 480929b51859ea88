"""Errors a user or operator can cause, each with the gRPC status it maps to.

Internal invariants use assertions; everything here carries a message that says what to change.
"""

from __future__ import annotations

import grpc


class BatonError(Exception):
    """Base of every error Baton reports to a client or operator."""

    grpc_status: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(BatonError):
    """The request itself is wrong (empty prompt, bad sampling value, ...)."""

    grpc_status = grpc.StatusCode.INVALID_ARGUMENT


class UnknownModel(InvalidRequest):
    """The request names a model this cluster does not serve."""


class NoWorkerReady(BatonError):
    """No prefill or decode instance can take work right now; retry later."""

    grpc_status = grpc.StatusCode.UNAVAILABLE


class WorkerFailed(BatonError):
    """A worker died or failed while serving the request."""

    grpc_status = grpc.StatusCode.UNAVAILABLE


class ConfigError(BatonError):
    """The cluster configuration is invalid; the message names the field."""

    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
