"""Agent sessions and ``cache_control`` on the HTTP fronts: where the OpenAI and Anthropic routes
find a request's session and breakpoints, and ``DELETE /v1/sessions/{session_id}``.

* **Session id.** The ``X-Session-Id`` header or the body's ``session_id`` (both set and
  different: 400); with ``sessions.session_from_user``, OpenAI's ``user`` (Anthropic's
  ``metadata.user_id``; the Responses route's ``user``, else ``safety_identifier``) when
  neither is. Scoped to the API key the caller authenticated with and
  the request's cache salt (``sessions.scoped_session_id``), so the same id under another key or
  tenant is another session. ``session_ttl_s`` and ``expected_next_step_s`` ride in the body.
* **Breakpoints.** ``gateway.cache_control`` lists and measures them; each becomes a lease.
* **Closing.** ``DELETE /v1/sessions/{session_id}?tenant=...`` (or ``cache_salt=``), with the
  same key as the session's requests, ends it through the router's ``close_session``: 200 with
  ``{"id", "object": "session.deleted", "deleted": true, "num_steps", "released_blocks"}``, 404
  when no such session is live. Errors are OpenAI's shape, Anthropic's when the request carries
  ``anthropic-version``.

Every field is checked whether or not ``sessions.enabled``; disabled, the request goes on as a
plain one (no session id, no lease).
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from gateway.anthropic_errors import anthropic
from gateway.anthropic_models import MessagesRequest
from gateway.auth import KeySet, bearer_key
from gateway.cache_control import (
    Breakpoint,
    anthropic_breakpoints,
    breakpoint_leases,
    openai_breakpoints,
)
from gateway.openai_errors import OpenAIError, error_for, translated
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from gateway.openai_requests import Prepared
from gateway.responses_models import ResponsesRequest
from gateway.router import Router
from gateway.sessions import (
    InvalidField,
    SessionFields,
    SessionsConfig,
    UnknownSession,
    check_session_id,
    scoped_session_id,
    with_session,
)
from gateway.tokenization import PromptTokenizer
from protos.errors import InvalidRequest
from protos.wire import EngineRequest

SESSION_HEADER = "x-session-id"
SESSION_HEADER_FIELD = "X-Session-Id"
ANTHROPIC_VERSION_HEADER = "anthropic-version"


def session_fields(header: str | None, body_id: str | None, user: str | None, user_field: str,
                   ttl_s: float | None, next_step_s: float | None, config: SessionsConfig
                   ) -> SessionFields:
    """Which session a request names, and in which field (module docstring)."""
    header = header.strip() if header else ""
    if header and body_id and header != body_id:
        raise InvalidField(f"the {SESSION_HEADER_FIELD} header ({header!r}) and the body's "
                           f"session_id ({body_id!r}) differ; send one of them, or the same id "
                           "in both", "session_id")
    if header:
        return SessionFields(header, ttl_s, next_step_s, SESSION_HEADER_FIELD)
    if body_id or not (user and config.session_from_user):
        return SessionFields(body_id or "", ttl_s, next_step_s)
    return SessionFields(user, ttl_s, next_step_s, user_field)


def offered_key(headers: Headers, api_keys: KeySet, x_api_key_first: bool = False) -> str:
    """The API key the caller authenticated with ('' when the fronts run without keys)."""
    if not api_keys:
        return ""
    offered = [bearer_key(headers.items()), headers.get("x-api-key", "").strip()]
    for key in reversed(offered) if x_api_key_first else offered:
        if api_keys.accepts(key):
            return key
    return ""


class HttpSessions:
    """Sessions and breakpoints for both HTTP fronts: ``openai`` and ``anthropic`` turn a checked
    request into one that carries its session and leases, or raise ``OpenAIError`` (400) naming
    the field. Blocking (they tokenize breakpoints): call them off the event loop."""

    def __init__(self, config: SessionsConfig, tokenizer: PromptTokenizer,
                 api_keys: KeySet) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.api_keys = api_keys

    def openai(self, prepared: Prepared, body: ChatCompletionRequest | CompletionRequest,
               headers: Headers) -> EngineRequest:
        try:
            fields = session_fields(headers.get(SESSION_HEADER), body.session_id, body.user,
                                    "user", body.session_ttl_s, body.expected_next_step_s,
                                    self.config)
            marks = (openai_breakpoints(body.messages, prepared.turns, body.tools or ())
                     if isinstance(body, ChatCompletionRequest) else [])
            return self._built(prepared, fields, marks, offered_key(headers, self.api_keys))
        except InvalidField as e:
            raise error_for(e, e.field) from e

    def anthropic(self, prepared: Prepared, body: MessagesRequest, headers: Headers
                  ) -> EngineRequest:
        try:
            user = body.metadata.user_id if body.metadata is not None else None
            fields = session_fields(headers.get(SESSION_HEADER), body.session_id, user,
                                    "metadata.user_id", body.session_ttl_s,
                                    body.expected_next_step_s, self.config)
            marks = anthropic_breakpoints(body)
            key = offered_key(headers, self.api_keys, x_api_key_first=True)
            return self._built(prepared, fields, marks, key)
        except InvalidField as e:
            raise error_for(e, e.field) from e

    def responses(self, prepared: Prepared, body: ResponsesRequest, headers: Headers
                  ) -> EngineRequest:
        """The Responses route's request with its session (no breakpoints: the Responses API
        has no ``cache_control``)."""
        try:
            user, user_field = ((body.user, "user") if body.user
                                else (body.safety_identifier, "safety_identifier"))
            fields = session_fields(headers.get(SESSION_HEADER), body.session_id, user,
                                    user_field, body.session_ttl_s, body.expected_next_step_s,
                                    self.config)
            return self._built(prepared, fields, [], offered_key(headers, self.api_keys))
        except InvalidField as e:
            raise error_for(e, e.field) from e

    def _built(self, prepared: Prepared, fields: SessionFields, marks: list[Breakpoint],
               api_key: str) -> EngineRequest:
        engine = with_session(prepared.engine, fields, self.config, api_key)
        if not marks or not self.config.enabled:
            return engine
        leases = breakpoint_leases(marks, prepared.tools, self.tokenizer,
                                   engine.prompt_token_ids, engine.cache_salt)
        return msgspec.structs.replace(engine, leases=(*engine.leases, *leases))


def sessions_router(router: Router, sessions: HttpSessions) -> APIRouter:
    """``DELETE /v1/sessions/{session_id}`` over ``router`` (module docstring)."""
    routes = APIRouter(prefix="/v1")

    @routes.delete("/sessions/{session_id:path}")
    async def close_session(session_id: str, request: Request) -> Response:
        try:
            return JSONResponse(await _closed(router, sessions, session_id, request))
        except OpenAIError as error:
            if ANTHROPIC_VERSION_HEADER in request.headers:
                version = request.headers[ANTHROPIC_VERSION_HEADER]
                return anthropic(error).response({ANTHROPIC_VERSION_HEADER: version})
            return error.response()

    return routes


async def _closed(router: Router, sessions: HttpSessions, session_id: str, request: Request
                  ) -> dict:
    key = offered_key(request.headers, sessions.api_keys)
    if sessions.api_keys and not key:
        error = OpenAIError(401, "missing or invalid API key; send the header 'Authorization: "
                            "Bearer <key>' (or 'x-api-key: <key>') with the key the session's "
                            "requests were sent with", "invalid_request_error",
                            code="invalid_api_key")
        error.headers["WWW-Authenticate"] = "Bearer"
        raise error
    query = request.query_params
    tenant = query.get("cache_salt", query.get("tenant", ""))
    try:
        check_session_id(session_id)
        if not session_id:
            raise InvalidRequest("session_id is empty; name the session to close")
    except InvalidRequest as e:
        raise error_for(e, "session_id") from e
    close = getattr(router, "close_session", None)
    ended = None
    if close is not None:
        with translated(f"close-session-{session_id}"):
            ended = await close(scoped_session_id(key, tenant, session_id))
    if ended is None:
        raise error_for(UnknownSession(
            f"no live session {session_id!r} under this API key and tenant {tenant!r}: it was "
            "never opened, is closed already, or its TTL lapsed"), "session_id")
    return {"id": session_id, "object": "session.deleted", "deleted": True,
            "num_steps": ended.num_steps, "released_blocks": ended.released_blocks}
