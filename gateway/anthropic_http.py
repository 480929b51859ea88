"""The Anthropic Messages API on the HTTP front: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, for clients that speak Anthropic's API (the official
``anthropic`` package and the agents built on it).

The same router, checks and accounting as the OpenAI routes (``gateway.openai_http``, whose app
includes ``messages_router``): requests are checked before any worker sees them, TTFT runs from
receipt to the first token, and a client that goes away closes the router's stream so the workers
abort the request. Anthropic's spelling, in one place:

* Auth: ``x-api-key: <key>`` or ``Authorization: Bearer <key>``, against the same API keys as the
  OpenAI routes; ``anthropic-version`` is accepted, not required, and echoed.
* ``X-Request-Id`` plays the gRPC ``request_id`` field's part, as on the OpenAI routes; an answer
  echoes the id in ``X-Request-Id`` and in Anthropic's ``request-id`` (the client's
  ``_request_id``), and the message's id is ``msg_<id>``.
* Bodies: ``gateway.anthropic_models``, checks ``gateway.anthropic_requests``, answers and streams
  ``gateway.anthropic_responses``, errors ``gateway.anthropic_errors``: every failure on these
  routes, auth and malformed JSON included, is answered here in Anthropic's shape, so the app's
  OpenAI error handlers never see one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from gateway.anthropic_errors import AnthropicError, anthropic
from gateway.anthropic_models import CountTokensRequest, MessagesRequest
from gateway.anthropic_requests import count_tokens, prepare_message
from gateway.anthropic_responses import full_message, message_events
from gateway.auth import KeySet, bearer_key
from gateway.openai_errors import OpenAIError, validation_message
from gateway.openai_requests import REQUEST_ID_HEADER, ServedModel
from gateway.openai_streams import (
    CLIENT_CLOSED_REQUEST,
    collected_text,
    event_stream,
    opened_progress,
)
from gateway.router import Router
from gateway.session_http import HttpSessions
from gateway.sessions import SessionsConfig
from gateway.tokenization import PromptTokenizer
from gateway.tool_calls import ANTHROPIC_CALL_ID_PREFIX
from gateway.tool_parsers import ToolOutput

Body = TypeVar("Body", bound=BaseModel)
Answer = Callable[[Request, dict[str, str]], Awaitable[Response]]

VERSION_HEADER = "anthropic-version"
FIELDS_REFERENCE = "Baton's docs/operating.md (Anthropic Messages API)"


async def _parsed(model: type[Body], http_request: Request) -> Body:
    """The body as ``model``; malformed JSON and wrong types are 400, not FastAPI's 422."""
    try:
        return model.model_validate_json(await http_request.body())
    except ValidationError as e:
        raise AnthropicError(400, validation_message(e, FIELDS_REFERENCE)[0]) from e


class _Messages:
    """The routes' shared state: router, tokenizer, the served model and the accepted keys."""

    def __init__(self, router: Router, tokenizer: PromptTokenizer, served: ServedModel,
                 api_keys: KeySet, sessions: HttpSessions) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.served = served
        self.api_keys = api_keys
        self.sessions = sessions

    async def answered(self, http_request: Request, answer: Answer) -> Response:
        """``answer``'s response to an authenticated request, or the error in Anthropic's shape."""
        version = http_request.headers.get(VERSION_HEADER)
        headers = {VERSION_HEADER: version} if version else {}
        try:
            self._authenticate(http_request)
            return await answer(http_request, headers)
        except (AnthropicError, OpenAIError) as error:
            return anthropic(error).response(headers)

    def _authenticate(self, http_request: Request) -> None:
        if not self.api_keys:
            return
        offered = (http_request.headers.get("x-api-key", "").strip(),
                   bearer_key(http_request.headers.items()))
        if not any(self.api_keys.accepts(key) for key in offered):
            raise AnthropicError(401, "missing or invalid API key; send the header "
                                 "'x-api-key: <key>' (or 'Authorization: Bearer <key>') with a "
                                 "key this server was started with")

    async def create(self, http_request: Request, headers: dict[str, str]) -> Response:
        """Check, place, then answer in full or as Anthropic's server-sent events."""
        received_at = time.perf_counter()
        body = await _parsed(MessagesRequest, http_request)
        prepared = await asyncio.to_thread(prepare_message, body, self.tokenizer, self.served,
                                           http_request.headers.get(REQUEST_ID_HEADER, ""))
        engine_request = await asyncio.to_thread(self.sessions.anthropic, prepared, body,
                                                 http_request.headers)
        opened = await opened_progress(self.router, engine_request, http_request, received_at)
        if opened is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        progress, events = opened
        request_id = engine_request.request_id
        headers = headers | {"X-Request-Id": request_id, "request-id": request_id}
        tools = ToolOutput(prepared.tools, ANTHROPIC_CALL_ID_PREFIX)
        if body.stream:
            sse = message_events(events, progress, tools, request_id, self.served.name)
            return event_stream(sse, events, headers)
        text = await collected_text(http_request, events, progress, request_id)
        if text is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        answer = full_message(text, progress, tools, request_id, self.served.name)
        return JSONResponse(answer, headers=headers)

    async def count(self, http_request: Request, headers: dict[str, str]) -> Response:
        body = await _parsed(CountTokensRequest, http_request)
        num_tokens = await asyncio.to_thread(count_tokens, body, self.tokenizer, self.served)
        return JSONResponse({"input_tokens": num_tokens}, headers=headers)


def messages_router(router: Router, tokenizer: PromptTokenizer, served: ServedModel,
                    api_keys: frozenset[str], sessions: HttpSessions | None = None) -> APIRouter:
    """The Anthropic routes over ``router``; with ``api_keys`` non-empty each needs one of them.
    ``sessions``: how session ids and ``cache_control`` are honoured (default: the defaults)."""
    keys = KeySet(api_keys)
    if sessions is None:
        sessions = HttpSessions(SessionsConfig(), tokenizer, keys)
    front = _Messages(router, tokenizer, served, keys, sessions)
    routes = APIRouter(prefix="/v1")

    @routes.post("/messages")
    async def messages(request: Request) -> Response:
        return await front.answered(request, front.create)

    @routes.post("/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await front.answered(request, front.count)

    return routes
