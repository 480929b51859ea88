"""OpenAI's Responses API on the HTTP front: ``POST /v1/responses`` (and
``POST /v1/responses/input_tokens``, the prompt's length), for clients that speak it
(the ``openai`` package's ``client.responses``, the OpenAI Agents SDK, Codex and the agents
built on them), stateless.

The same router, checks, sessions and accounting as the chat route (``gateway.openai_http``,
whose ``/v1`` router this one joins, with its bearer auth and OpenAI-shaped errors): requests
are checked before any worker sees them, TTFT runs from receipt to the first token, and a client
that goes away closes the router's stream so the workers abort the request. Bodies:
``gateway.responses_models``; checks: ``gateway.responses_requests``; answers and events:
``gateway.responses_output``. ``X-Request-Id`` plays the gRPC ``request_id`` field's part; the
response's id is ``resp_<id>``. Responses are not stored: retrieving, deleting or cancelling
one (``/v1/responses/{id}``...) is a 404 that says so.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from gateway.openai_errors import OpenAIError, validation_message
from gateway.openai_requests import REQUEST_ID_HEADER, ServedModel
from gateway.openai_streams import (
    CLIENT_CLOSED_REQUEST,
    collected_text,
    event_stream,
    opened_progress,
)
from gateway.responses_models import ResponsesRequest
from gateway.responses_output import ResponseShape, full_response, response_events
from gateway.responses_requests import FIELDS_REFERENCE, count_input_tokens, prepare_response
from gateway.router import Router
from gateway.session_http import HttpSessions
from gateway.tokenization import PromptTokenizer
from gateway.tool_parsers import ToolOutput


async def _parsed(http_request: Request) -> ResponsesRequest:
    """The body; malformed JSON and wrong types are 400, not FastAPI's 422."""
    try:
        return ResponsesRequest.model_validate_json(await http_request.body())
    except ValidationError as e:
        message, param = validation_message(e, FIELDS_REFERENCE)
        raise OpenAIError(400, message, "invalid_request_error", param) from e


class _Responses:
    def __init__(self, router: Router, tokenizer: PromptTokenizer, served: ServedModel,
                 sessions: HttpSessions) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.served = served
        self.sessions = sessions

    async def create(self, http_request: Request) -> Response:
        """Check, place, then answer in full or as the Responses API's server-sent events."""
        received_at = time.perf_counter()
        body = await _parsed(http_request)
        prepared = await asyncio.to_thread(prepare_response, body, self.tokenizer, self.served,
                                           http_request.headers.get(REQUEST_ID_HEADER, ""))
        engine_request = await asyncio.to_thread(self.sessions.responses, prepared, body,
                                                 http_request.headers)
        opened = await opened_progress(self.router, engine_request, http_request, received_at)
        if opened is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        progress, events = opened
        request_id = engine_request.request_id
        headers = {"X-Request-Id": request_id}
        tools = ToolOutput(prepared.tools)
        shape = ResponseShape(body, prepared.tools, request_id, self.served.name)
        if body.stream:
            sse = response_events(events, progress, tools, shape, request_id)
            return event_stream(sse, events, headers)
        text = await collected_text(http_request, events, progress, request_id)
        if text is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(full_response(text, progress, tools, shape), headers=headers)

    async def count(self, http_request: Request) -> JSONResponse:
        body = await _parsed(http_request)
        num_tokens = await asyncio.to_thread(count_input_tokens, body, self.tokenizer,
                                             self.served)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": num_tokens})


def add_responses_routes(v1: APIRouter, router: Router, tokenizer: PromptTokenizer,
                         served: ServedModel, sessions: HttpSessions) -> None:
    """Adds ``/responses``, ``/responses/input_tokens`` (the prompt's length as ``/responses``
    renders it: ``{"object": "response.input_tokens", "input_tokens": n}``) and the 404s of the
    stored responses' routes to ``v1``."""
    front = _Responses(router, tokenizer, served, sessions)

    @v1.post("/responses")
    async def create_response(request: Request) -> Response:
        return await front.create(request)

    @v1.post("/responses/input_tokens")
    async def count_response_input_tokens(request: Request) -> JSONResponse:
        return await front.count(request)

    @v1.api_route("/responses/{response_id}{rest:path}", methods=["GET", "POST", "DELETE"])
    async def stored_response(response_id: str, rest: str) -> JSONResponse:
        raise OpenAIError(404, f"no response {response_id!r}: responses are not stored on this "
                          "server (each answer comes back whole, or streamed, from POST "
                          "/v1/responses)", "invalid_request_error", "response_id",
                          "response_not_found")
