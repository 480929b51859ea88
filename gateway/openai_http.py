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
* Baton's own request fields ride as extra body fields (``cache_salt``, ``tenant``); its own
  response fields sit under a top-level ``baton`` key (placement, loaded tokens, TTFT).
* An ``X-Request-Id`` header plays the gRPC ``request_id`` field's part; every answer echoes
  the id in ``X-Request-Id`` and in its ``id`` (``chatcmpl-<id>`` / ``cmpl-<id>``).

This module assembles the app (routes, auth, exception handlers) from its parts: request bodies
(``gateway.openai_models``), their checks (``gateway.openai_requests``), answers
(``gateway.openai_responses``), streaming (``gateway.openai_streams``) and the uvicorn server
(``gateway.openai_server``, whose ``start_http`` is re-exported here).
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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.inference import NOT_READY_MESSAGE
from gateway.openai_errors import OpenAIError, error_for, validation_message
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from gateway.openai_requests import ServedModel, build_engine_request, checked
from gateway.openai_responses import CHAT, COMPLETION, Progress, Shape
from gateway.openai_server import RunningHttp, start_http
from gateway.openai_streams import collect_output, open_stream, sse_events, unless_disconnected
from gateway.router import Router
from gateway.tokenization import PromptTokenizer
from gateway.validation import check_model
from protos.errors import NoWorkerReady

__all__ = [
    "OpenAIError", "RunningHttp", "build_app", "build_engine_request", "error_for", "start_http",
]

OWNED_BY = "baton"
REQUEST_ID_HEADER = "x-request-id"
CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client is gone and never sees it


class _Front:
    """The handlers' shared state: router, tokenizer and the served model's limits."""

    def __init__(self, router: Router, tokenizer: PromptTokenizer, served: ServedModel) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.served = served
        self.created = int(time.time())

    async def complete(
        self, body: ChatCompletionRequest | CompletionRequest, http_request: Request, shape: Shape
    ) -> Response:
        """Validate, check readiness, place, then answer in full or as server-sent events."""
        received_at = time.perf_counter()
        engine_request = await asyncio.to_thread(
            build_engine_request,
            body,
            self.tokenizer,
            self.served,
            http_request.headers.get(REQUEST_ID_HEADER, ""),
        )
        if not self.router.is_ready():
            raise error_for(NoWorkerReady(NOT_READY_MESSAGE))
        opened = await unless_disconnected(http_request, open_stream(self.router, engine_request))
        if opened is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        placed, events = opened
        progress = Progress(placed, received_at, len(engine_request.prompt_token_ids))
        header = shape.header(
            engine_request.request_id, int(time.time()), self.served.name, chunk=body.stream
        )
        response_headers = {"X-Request-Id": engine_request.request_id}
        with_logprobs = engine_request.sampling.num_logprobs is not None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            sse = sse_events(
                events, progress, shape, header, include_usage, engine_request.request_id,
                with_logprobs,
            )

            async def close_streams() -> None:
                # Starlette abandons the body iterator, or never starts it, when the client
                # disconnects; this closes the router stream without waiting for the GC.
                await sse.aclose()
                await events.aclose()

            return StreamingResponse(
                sse,
                media_type="text/event-stream",
                headers=response_headers | {"Cache-Control": "no-cache"},
                background=BackgroundTask(close_streams),
            )
        output = await unless_disconnected(
            http_request, collect_output(events, progress, engine_request.request_id)
        )
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, positions = output
        logprobs = shape.logprobs(positions)[0] if with_logprobs else None
        choice = shape.full_choice(text, progress.finish_reason, logprobs)
        return JSONResponse(
            {**header, "choices": [choice], "usage": progress.usage(), "baton": progress.baton()},
            headers=response_headers,
        )

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
) -> FastAPI:
    """The OpenAI-compatible app over ``router``.

    ``max_model_len`` is the context window in tokens. With ``api_keys`` non-empty every
    ``/v1`` route needs ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open.
    ``/metrics`` exposes ``metrics_registry`` (default: prometheus-client's global registry).
    """
    served = ServedModel(served_model_name, max_model_len, tokenizer.vocab_size)
    front = _Front(router, tokenizer, served)
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

    app.include_router(v1)

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
