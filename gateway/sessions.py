"""Agent sessions at the fronts: a client's session id, scoped to its caller, and the leases a
request asks the KV store for (a session step, ``cache_control`` breakpoints).

A session id names a session only together with the API key it was sent with and its tenant
(the cache salt): ``scoped_session_id`` hashes the three, so another key naming the same id gets
another session, and the key itself is never kept. Everything here is pure: the fronts call it
while building an ``EngineRequest``; the conductor and the store nodes see only scoped ids.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from protos.errors import BatonError, InvalidRequest
from protos.wire import EngineRequest, Lease

MAX_SESSION_ID_CHARS = 128
SESSION_PREFIX = "s-"
BREAKPOINT_PREFIX = "c-"
CACHE_CONTROL_TTLS_S = {"5m": 300.0, "1h": 3600.0}
"""Anthropic's ``cache_control`` TTLs (``{"type": "ephemeral", "ttl": ...}``; unset is 5m)."""

_U32 = struct.Struct("<I")


class InvalidField(InvalidRequest):
    """A bad value of one request field; ``field`` names it as the client's front spells it
    (the HTTP fronts answer it in ``param``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class UnknownSession(BatonError):
    """Closing a session that is not live (never opened, closed already, or its TTL lapsed)."""


class SessionsConfig(BaseModel):
    """How the fronts treat agent sessions (``sessions:`` in the cluster config)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="Honour session ids (X-Session-Id, session_id) and "
                          "cache_control breakpoints with leases in the KV store; false: accepted "
                          "and ignored, as plain requests.")
    default_ttl_s: float = Field(300.0, gt=0, description="Seconds a session's lease lives "
                                 "without a new step, when the request does not say.")
    max_ttl_s: float = Field(3600.0, gt=0, description="Longest session TTL a request may ask "
                             "for (a longer one is a 400 / INVALID_ARGUMENT).")
    session_from_user: bool = Field(False, description="Take OpenAI's `user` field as the "
                                    "session id when a request names none.")


def check_session_id(session_id: str, field: str = "session_id") -> str:
    """``session_id`` when it is a valid id ('' for none); ``InvalidRequest`` naming ``field``."""
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidRequest(f"{field} is {len(session_id)} characters; at most "
                             f"{MAX_SESSION_ID_CHARS} are allowed")
    if session_id and not session_id.isprintable():
        raise InvalidRequest(f"{field} must be printable characters")
    return session_id


def check_ttl_s(ttl_s: float, config: SessionsConfig, field: str = "session_ttl_s") -> float:
    """The TTL a request asked for (0 or unset: the default), or ``InvalidRequest``."""
    if ttl_s != ttl_s or ttl_s < 0:
        raise InvalidRequest(f"{field} must be a non-negative number of seconds, got {ttl_s}")
    if ttl_s > config.max_ttl_s:
        raise InvalidRequest(f"{field} is {ttl_s:g} s; at most sessions.max_ttl_s = "
                             f"{config.max_ttl_s:g} s is allowed")
    return ttl_s or config.default_ttl_s


def cache_control_ttl_s(ttl: str | None, field: str) -> float:
    """Seconds of an Anthropic ``cache_control`` TTL ("5m", "1h"; unset is 5m)."""
    if ttl is None:
        return CACHE_CONTROL_TTLS_S["5m"]
    try:
        return CACHE_CONTROL_TTLS_S[ttl]
    except KeyError:
        raise InvalidRequest(f"{field} must be one of {sorted(CACHE_CONTROL_TTLS_S)}, "
                             f"got {ttl!r}") from None


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"baton.session")
    for part in parts:
        h.update(_U32.pack(len(part)))
        h.update(part)
    return h.hexdigest()


def scoped_session_id(api_key: str, tenant: str, session_id: str) -> str:
    """The session's id as Baton keeps it: its caller's key, tenant and id, hashed together."""
    return SESSION_PREFIX + _digest(api_key.encode(), tenant.encode(), session_id.encode())


def session_lease(scoped_id: str, tenant: str, ttl_s: float, num_prompt_tokens: int) -> Lease:
    """A session step's lease: the whole prompt and the reply's blocks (the next step's prefix)."""
    return Lease(scoped_id, tenant, ttl_s, num_prompt_tokens, include_output=True)


def breakpoint_lease(tenant: str, prompt_token_ids: Sequence[int], num_tokens: int,
                     ttl_s: float) -> Lease:
    """A ``cache_control`` breakpoint's lease: the prompt up to it, named by its tokens (the same
    prefix under the same tenant is one lease, renewed by every request that marks it)."""
    if not 0 < num_tokens <= len(prompt_token_ids):
        raise InvalidRequest(f"cache_control breakpoint at token {num_tokens} is outside the "
                             f"prompt of {len(prompt_token_ids)} tokens")
    tokens = b"".join(_U32.pack(t) for t in prompt_token_ids[:num_tokens])
    return Lease(BREAKPOINT_PREFIX + _digest(tenant.encode(), tokens), tenant, ttl_s, num_tokens)


def cache_creation_tokens(leases: Sequence[Lease], num_prompt_tokens: int,
                          num_cached_tokens: int) -> int:
    """Anthropic's ``cache_creation_input_tokens``: prompt tokens under a lease this request
    wrote (the longest leased prefix, less what was read from cache)."""
    leased = max((min(lease.num_tokens, num_prompt_tokens) for lease in leases), default=0)
    return max(0, leased - num_cached_tokens)


@dataclass(frozen=True)
class SessionFields:
    """What a request says about its session, and the names its front gives those fields."""

    session_id: str = ""
    """The client's id ('' for none)."""
    ttl_s: float | None = None
    expected_next_step_s: float | None = None
    session_id_field: str = "session_id"
    """Where the id came from: "session_id", the "X-Session-Id" header, "user", ..."""
    ttl_field: str = "session_ttl_s"
    next_step_field: str = "expected_next_step_s"


def _field_check(field: str, check, *args):
    try:
        return check(*args)
    except InvalidRequest as e:
        raise InvalidField(str(e), field) from e


def check_next_step_s(next_step_s: float, field: str = "expected_next_step_s") -> float:
    """A client's estimate of the seconds to its session's next step: finite and >= 0."""
    if not math.isfinite(next_step_s) or next_step_s < 0:
        raise InvalidRequest(f"{field} must be a finite number of seconds >= 0 (0: unknown), "
                             f"got {next_step_s}")
    return float(next_step_s)


def with_session(engine: EngineRequest, fields: SessionFields, config: SessionsConfig,
                 api_key: str) -> EngineRequest:
    """``engine`` as a step of the session ``fields`` names: its scoped id, its client's
    next-step hint and the session's lease on the whole prompt (and the reply). Every field is
    checked whether or not sessions are enabled (a request valid on one cluster is valid on every
    other); with ``sessions.enabled`` false the request goes on as a plain one. ``api_key`` is
    the key the caller authenticated with ('' when the fronts run without keys); the tenant is
    the request's cache salt. ``InvalidField`` naming the offending field."""
    session_id = _field_check(fields.session_id_field, check_session_id, fields.session_id,
                              fields.session_id_field)
    next_step_s = 0.0
    if fields.expected_next_step_s is not None:
        next_step_s = _field_check(fields.next_step_field, check_next_step_s,
                                   fields.expected_next_step_s, fields.next_step_field)
    ttl_s = _field_check(fields.ttl_field, check_ttl_s, fields.ttl_s or 0.0, config,
                         fields.ttl_field)
    if not session_id:
        for name, value in ((fields.next_step_field, next_step_s),
                            (fields.ttl_field, fields.ttl_s or 0.0)):
            if value:
                raise InvalidField(f"{name} needs a session: name one with session_id (HTTP: "
                                   "or the X-Session-Id header), or leave it unset", name)
        return engine
    if not config.enabled:
        return engine
    scoped_id = scoped_session_id(api_key, engine.cache_salt, session_id)
    lease = session_lease(scoped_id, engine.cache_salt, ttl_s, len(engine.prompt_token_ids))
    return msgspec.structs.replace(engine, session_id=scoped_id,
                                   expected_next_step_s=next_step_s,
                                   leases=(*engine.leases, lease))
