"""Errors a user or operator can cause: one tree, rooted at ``BatonError``.

Internal invariants use assertions; everything here carries a message that says what to change.
Which status a client sees for each kind is decided at the fronts (``gateway.status``), not
here: this module is the bottom of the layers and knows no wire. Rooms add their own kinds under
these (``conductor.policy.Overloaded``, ``engine.runner.EngineRejected``/``EngineDead``, the
store's and the transfer engine's errors, ...).
"""

from __future__ import annotations


class BatonError(Exception):
    """Base of every error Baton reports to a client or operator."""


class InvalidRequest(BatonError):
    """The request itself is wrong (empty prompt, bad sampling value, ...)."""


class UnknownModel(InvalidRequest):
    """The request names a model this cluster does not serve."""


class NoWorkerReady(BatonError):
    """No prefill or decode instance can take work right now; retry later."""


class WorkerFailed(BatonError):
    """A worker died or failed while serving the request."""


class StoreError(BatonError):
    """The KV store could not do its part (its actor is gone, no Redis, a transfer between
    nodes failed); what cannot be loaded is recomputed, so requests rarely see this."""


class ConfigError(BatonError):
    """The cluster configuration is invalid; the message names the field."""


class EngineStartFailed(ConfigError):
    """A worker's engine could not start with the configuration given (vLLM refused it: a KV
    cache too small for the context, a model it cannot load, ...): the message says why."""


class UnknownInstance(BatonError):
    """No instance of that name in this cluster."""


class ScaleRefused(BatonError):
    """A scale or drain request that would leave the cluster unable to serve, or that cannot run
    on this cluster."""


class DrainTimeout(BatonError):
    """The instance still had work when the drain's time ran out; it stays draining."""
