"""The OpenAI-compatible HTTP front: ``/v1/chat/completions``, ``/v1/completions`` and friends.

A second door onto the same ``Router`` as the gRPC gateway, for clients that speak OpenAI's API
(the official ``openai`` package, LangChain, curl). It mirrors the gateway's semantics: requests
are validated with ``gateway.validation``'s checks before any worker sees them, TTFT runs from
receipt to the first token, usage counts prompt, cached and generated tokens, and a client that
goes away closes the router's stream so the workers abort the request.

Wire mapping, in one place:

* ``BatonError``\\ s become OpenAI error bodies ``{"error": {message, type, param, code}}``;
  the HTTP status follows the error's gRPC category (INVALID_ARGUMENT 400, ``UnknownModel`` 404,
  RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, anything else 500); 429 and 503 carry
  ``Retry-After``. Malformed JSON and wrong field types are 400, not FastAPI's 422
  (``gateway.openai_errors``).
* Baton's own request fields ride as extra body fields (``cache_salt``, ``tenant``, the agent
  session's ``session_id``/``session_ttl_s``/``expected_next_step_s``, ``cache_control`` on chat
  messages: ``gateway.session_http``); its own response fields sit under a top-level ``baton``
  key (placement, loaded tokens, TTFT).
* An ``X-Request-Id`` header plays the gRPC ``request_id`` field's part; every answer echoes
  the id in ``X-Request-Id`` and in its ``id`` (``chatcmpl-<id>`` / ``cmpl-<id>``).

This module assembles the app (routes, auth, exception handlers) from its parts: request bodies
(``gateway.openai_models``), their checks (``gateway.openai_requests``), answers
(``gateway.openai_responses``), streaming (``gateway.openai_streams``) and the uvicorn server
(``gateway.openai_server``, whose ``start_http`` is re-exported here). The same app serves
Anthropic's Messages API, ``/v1/messages``, in Anthropic's spelling (``gateway.anthropic_http``),
and OpenAI's Responses API, ``/v1/responses`` (``gateway.responses_http``); vLLM's ``/tokenize``
and ``/detokenize`` are ``gateway.tokenize_http``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from http import HTTPStatus
from typing import Awaitable, Callable

import prometheus_client
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.anthropic_http import messages_router
from gateway.auth import KeySet
from gateway.inference import NOT_READY_MESSAGE
from gateway.choices import all_or_none, choice_requests
from gateway.openai_choices import combined_baton, combined_usage, sse_choices
from gateway.openai_errors import OpenAIError, error_for, validation_message
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from gateway.openai_requests import (
    REQUEST_ID_HEADER,
    Echo,
    ServedModel,
    build_engine_request,
    checked,
    prepare,
)
from gateway.openai_responses import CHAT, COMPLETION, Progress, Shape
from gateway.openai_server import RunningHttp, start_http
from gateway.openai_streams import (
    CLIENT_CLOSED_REQUEST,
    collect_output,
    event_stream,
    opened,
    unless_disconnected,
)
from gateway.responses_http import add_responses_routes
from gateway.router import Router
from gateway.tokenize_http import tokenize_routes
from gateway.session_http import HttpSessions, sessions_router
from gateway.sessions import SessionsConfig
from gateway.tokenization import PromptTokenizer
from gateway.tool_parsers import ToolOutput, finish_reason
from gateway.validation import check_model
from protos.errors import NoWorkerReady

__all__ = [
    "OpenAIError", "RunningHttp", "build_app", "build_engine_request", "error_for", "start_http",
]

OWNED_BY = "baton"


class _Front:
    """The handlers' shared state: router, tokenizer and the served model's limits."""

    def __init__(self, router: Router, tokenizer: PromptTokenizer, served: ServedModel,
                 sessions: HttpSessions) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.served = served
        self.sessions = sessions
        self.created = int(time.time())

    async def complete(
        self, body: ChatCompletionRequest | CompletionRequest, http_request: Request, shape: Shape
    ) -> Response:
        """Validate, check readiness, place, then answer in full or as server-sent events."""
        received_at = time.perf_counter()
        prepared = await asyncio.to_thread(
            prepare,
            body,
            self.tokenizer,
            self.served,
            http_request.headers.get(REQUEST_ID_HEADER, ""),
        )
        engine_request = await asyncio.to_thread(self.sessions.openai, prepared, body,
                                                 http_request.headers)
        # n > 1: one engine request per choice (``gateway.openai_choices``)
        requests = choice_requests(engine_request, body.n)
        streams: list = []
        try:  # one after the other: the conductor sees the first prefill when placing the next
            for request in requests:
                placed_events = await opened(self.router, request, http_request)
                if placed_events is None:
                    break
                streams.append(placed_events)
        except BaseException:
            for _placed, events in streams:
                await events.aclose()
            raise
        if len(streams) < len(requests):  # the client went away while they were placed
            for _placed, events in streams:
                await events.aclose()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        num_prompt_tokens = len(engine_request.prompt_token_ids)
        prompt_only = prepared.echo is not None and prepared.echo.prompt_only
        progresses = [Progress(placed, received_at, num_prompt_tokens, leases=request.leases,
                               prompt_only=prompt_only)
                      for (placed, _events), request in zip(streams, requests)]
        plan = prepared.tools
        tools = [ToolOutput(plan) if plan is not None and plan.mode != "none" else None
                 for _ in requests]
        events = [events for _placed, events in streams]
        request_ids = [request.request_id for request in requests]
        header = shape.header(engine_request.request_id, int(time.time()), self.served.name,
                              chunk=body.stream)
        response_headers = {"X-Request-Id": engine_request.request_id}
        with_logprobs = engine_request.sampling.num_logprobs is not None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            sse = sse_choices(events, progresses, tools, shape, header, include_usage,
                              request_ids, with_logprobs, prepared.echo)
            return event_stream(sse, events, response_headers)
        outputs = await unless_disconnected(http_request, all_or_none([
            collect_output(stream, progress, request_id)
            for stream, progress, request_id in zip(events, progresses, request_ids)]))
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = [self._choice(shape, text, positions, progress, parser, with_logprobs, index,
                                prepared.echo)
                   for index, ((text, positions), progress, parser)
                   in enumerate(zip(outputs, progresses, tools))]
        return JSONResponse(
            {**header, "choices": choices, "usage": combined_usage(progresses),
             "baton": combined_baton(progresses)},
            headers=response_headers,
        )

    @staticmethod
    def _choice(shape: Shape, text: str, positions: list, progress: Progress,
                tools: ToolOutput | None, with_logprobs: bool, index: int = 0,
                echo: Echo | None = None) -> dict:
        """One choice of a whole answer: its text (or content and tool calls), finish reason
        and logprobs; with ``echo``, the prompt's text and log-probabilities first."""
        first_prompt_token = None
        if echo is not None:
            text, positions, first_prompt_token = echo.first(text, positions,
                                                             progress.prompt_logprobs)
        logprobs = shape.logprobs(positions, 0, first_prompt_token)[0] if with_logprobs else None
        if tools is None:
            return shape.full_choice(text, progress.finish_reason, logprobs, index=index)
        tools.feed(text)
        tools.close()
        return shape.full_choice(tools.content(), finish_reason(progress.finish_reason,
                                 tools.calls), logprobs, tools.calls, index=index)

    def model_card(self) -> dict:
        return {
            "id": self.served.name,
            "object": "model",
            "created": self.created,
            "owned_by": OWNED_BY,
            "max_model_len": self.served.max_model_len,
        }


def _bearer_auth(api_keys: frozenset[str]) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency: 401 unless ``Authorization: Bearer <one of api_keys>``."""

    async def check(request: Request) -> None:
        if not api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.strip().encode(), key.encode()) for key in api_keys
        ):
            return
        error = OpenAIError(
            HTTPStatus.UNAUTHORIZED,
            "missing or invalid API key; send the header 'Authorization: Bearer <key>' "
            "with a key this server was started with",
            "invalid_request_error",
            code="invalid_api_key",
        )
        error.headers["WWW-Authenticate"] = "Bearer"
        raise error

    return check


def build_app(
    router: Router,
    tokenizer: PromptTokenizer,
    served_model_name: str,
    max_model_len: int,
    api_keys: frozenset[str] = frozenset(),
    metrics_registry: prometheus_client.CollectorRegistry | None = None,
    tool_call_parser: str = "hermes",
    structured_backend: str = "auto",
    sessions: SessionsConfig = SessionsConfig(),
) -> FastAPI:
    """The OpenAI-compatible app over ``router``.

    ``max_model_len`` is the context window in tokens; ``tool_call_parser`` the format the
    model calls tools in (``gateway.tool_parsers``); ``structured_backend`` the engines'
    structured-output backend, which JSON schemas are checked for. With ``api_keys`` non-empty every
    ``/v1`` route needs ``Authorization: Bearer <key>`` (the Anthropic routes take ``x-api-key``
    too); ``/health`` and ``/metrics`` stay open.
    ``/metrics`` exposes ``metrics_registry`` (default: prometheus-client's global registry).
    ``sessions`` is how session ids and ``cache_control`` are honoured (``gateway.session_http``,
    which also serves ``DELETE /v1/sessions/{session_id}``).
    """
    served = ServedModel(served_model_name, max_model_len, tokenizer.vocab_size, tool_call_parser,
                         structured_backend)
    http_sessions = HttpSessions(sessions, tokenizer, KeySet(api_keys))
    front = _Front(router, tokenizer, served, http_sessions)
    registry = metrics_registry if metrics_registry is not None else prometheus_client.REGISTRY
    app = FastAPI(title="Baton", docs_url=None, redoc_url=None, openapi_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_bearer_auth(api_keys))])

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await front.complete(body, request, CHAT)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await front.complete(body, request, COMPLETION)

    @v1.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [front.model_card()]}

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        checked("model", check_model, model_id, served_model_name)
        return front.model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        if router.is_ready():
            return JSONResponse({"status": "ok"})
        return error_for(NoWorkerReady(NOT_READY_MESSAGE)).response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            prometheus_client.generate_latest(registry),
            media_type=prometheus_client.CONTENT_TYPE_LATEST,
        )

    add_responses_routes(v1, router, tokenizer, served, http_sessions)
    app.include_router(v1)
    app.include_router(tokenize_routes(tokenizer, served, _bearer_auth(api_keys)))
    app.include_router(messages_router(router, tokenizer, served, api_keys, http_sessions))
    app.include_router(sessions_router(router, http_sessions))

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error)
        status = HTTPStatus.BAD_REQUEST
        return OpenAIError(status, message, "invalid_request_error", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = str(error.detail)
        response = OpenAIError(error.status_code, message, "invalid_request_error").response()
        response.headers.update(error.headers or {})
        return response

    return app
