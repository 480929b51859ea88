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
  ``Retry-After``. Malformed JSON and wrong field types are 400, not FastAPI's 422.
* Baton's own request fields ride as extra body fields (``cache_salt``, ``tenant``); its own
  response fields sit under a top-level ``baton`` key (placement, loaded tokens, TTFT).
* An ``X-Request-Id`` header plays the gRPC ``request_id`` field's part; every answer echoes
  the id in ``X-Request-Id`` and in its ``id`` (``chatcmpl-<id>`` / ``cmpl-<id>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import socket
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, TypeVar

import grpc
import msgspec
import prometheus_client
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos.errors import BatonError, ConfigError, InvalidRequest, NoWorkerReady, UnknownModel
from gateway.inference import NOT_READY_MESSAGE
from gateway.router import Placed, Router, num_cached_tokens
from gateway.tokenization import CHAT_ROLES, PromptTokenizer
from gateway.validation import (
    DEFAULT_MAX_TOKENS,
    _check_cache_salt,
    _check_lengths,
    _check_request_id,
    _check_stop,
    _check_temperature,
    _check_top_p,
    check_model,
    check_token_ids,
)
from protos.wire import EngineRequest, SamplingOptions, TokenChunk

logger = logging.getLogger(__name__)

OWNED_BY = "baton"
REQUEST_ID_HEADER = "x-request-id"
DEFAULT_RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client is gone and never sees it
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
T = TypeVar("T")


# --- Request bodies ------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with usage.")


class _Body(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI servers do."""

    model: str = Field("", description="Served model name; empty selects it.")
    max_tokens: int | None = Field(None, description="Tokens to generate at most.")
    max_completion_tokens: int | None = Field(None, description="Wins over max_tokens.")
    temperature: float | None = Field(None, description="Sampling temperature; unset: 1.0.")
    top_p: float | None = Field(None, description="Nucleus mass in (0, 1]; unset: 1.0.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="Sampling seed.")
    stop: str | list[str] | None = Field(None, description="Stop string(s).")
    n: int = Field(1, description="Choices per request; only 1 is served.")
    stream: bool = Field(False, description="Answer with server-sent events.")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="End-user id; accepted and ignored.")
    cache_salt: str | None = Field(None, description="Baton: prefix-cache isolation salt.")
    tenant: str | None = Field(None, description="Baton: the salt when cache_salt is unset.")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage]


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]


# --- Errors --------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error answered in OpenAI's format; raised by handlers, rendered by ``build_app``."""

    def __init__(
        self,
        status: HTTPStatus | int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        self.headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def error_for(error: BatonError, param: str | None = None) -> OpenAIError:
    """The HTTP answer for a Baton error, chosen by its gRPC category (see module docstring)."""
    code = re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()
    retry_after_s = getattr(error, "retry_after_s", DEFAULT_RETRY_AFTER_S)
    if isinstance(error, UnknownModel):
        return OpenAIError(HTTPStatus.NOT_FOUND, str(error), "invalid_request_error", param, code)
    if error.grpc_status == grpc.StatusCode.INVALID_ARGUMENT:
        return OpenAIError(HTTPStatus.BAD_REQUEST, str(error), "invalid_request_error", param, code)
    if error.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        status, type_ = HTTPStatus.TOO_MANY_REQUESTS, "rate_limit_error"
        return OpenAIError(status, str(error), type_, param, code, retry_after_s)
    if error.grpc_status == grpc.StatusCode.UNAVAILABLE:
        status, type_ = HTTPStatus.SERVICE_UNAVAILABLE, "server_error"
        return OpenAIError(status, str(error), type_, param, code, retry_after_s)
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(error), "server_error", param, code)


def _internal_error(request_id: str) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"internal error while serving request {request_id}; the gateway log has the details",
        "server_error",
    )


@contextlib.contextmanager
def _translated(request_id: str):
    """Turns whatever the router raises into an ``OpenAIError``, logging the unexpected."""
    try:
        yield
    except OpenAIError:
        raise
    except BatonError as e:
        raise error_for(e) from e
    except Exception as e:
        logger.exception("request %s failed inside the HTTP front", request_id)
        raise _internal_error(request_id) from e


# --- Validation: OpenAI body -> EngineRequest ----------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the name, context window and vocabulary size."""

    name: str
    max_model_len: int
    vocab_size: int


def _checked(param: str | None, check: Callable[..., T], *args: Any) -> T:
    """Runs one of ``gateway.validation``'s checks, naming the offending OpenAI field."""
    try:
        return check(*args)
    except InvalidRequest as e:
        raise error_for(e, param) from e


def _chat_pairs(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    if not messages:
        raise InvalidRequest("messages is empty; send at least one message")
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{index}] has role '{message.role}'; use one of {', '.join(CHAT_ROLES)}"
            )
    return [(message.role, message.text()) for message in messages]


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a completion request: text or token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise InvalidRequest(
                f"only one prompt per request; send the {len(prompt)} prompts as "
                f"{len(prompt)} separate requests"
            )
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequest("prompt is empty; send at least one character or token id")
    return prompt


def build_engine_request(
    body: ChatCompletionRequest | CompletionRequest,
    tokenizer: PromptTokenizer,
    served: ServedModel,
    request_id: str = "",
) -> EngineRequest:
    """Checks an OpenAI body like ``validate_and_build`` checks a ``GenerateRequest``.

    Cheap checks first, then tokenization. Raises ``OpenAIError`` whose ``param`` names the
    offending field. ``cache_salt`` wins over ``tenant``; an unset temperature is OpenAI's 1.0
    and an unset max_tokens is ``DEFAULT_MAX_TOKENS``, lowered to fit the context window.
    """
    _checked("model", check_model, body.model, served.name)
    if body.n != 1:
        raise error_for(
            InvalidRequest(
                f"n must be 1 (one choice per request), got {body.n}; "
                "send several requests for several completions"
            ),
            "n",
        )
    temperature = 1.0 if body.temperature is None else body.temperature
    temperature = _checked("temperature", _check_temperature, temperature)
    top_p = 1.0 if body.top_p is None else _checked("top_p", _check_top_p, body.top_p)
    stop_strings = [body.stop] if isinstance(body.stop, str) else body.stop or []
    stop = _checked("stop", _check_stop, stop_strings)
    salt_param, cache_salt = (
        ("cache_salt", body.cache_salt) if body.cache_salt is not None else ("tenant", body.tenant)
    )
    _checked(salt_param, _check_cache_salt, cache_salt or "")
    request_id = _checked("X-Request-Id", _check_request_id, request_id)

    if isinstance(body, ChatCompletionRequest):
        prompt_param = "messages"
        pairs = _checked(prompt_param, _chat_pairs, body.messages)
        prompt_token_ids = _checked(prompt_param, tokenizer.encode_chat, pairs)
    else:
        prompt_param = "prompt"
        prompt = _checked(prompt_param, _single_prompt, body.prompt)
        prompt_token_ids = tokenizer.encode_text(prompt) if isinstance(prompt, str) else prompt
    if not prompt_token_ids:
        raise error_for(
            InvalidRequest("the prompt tokenizes to no tokens; send a longer prompt"), prompt_param
        )
    _checked(prompt_param, check_token_ids, prompt_token_ids, served.vocab_size)
    max_tokens_param, max_tokens = (
        ("max_completion_tokens", body.max_completion_tokens)
        if body.max_completion_tokens is not None
        else ("max_tokens", body.max_tokens)
    )
    prompt_fits = len(prompt_token_ids) < served.max_model_len
    length_param = max_tokens_param if prompt_fits else prompt_param
    max_tokens = _checked(
        length_param,
        _check_lengths,
        len(prompt_token_ids),
        max_tokens,
        served.max_model_len,
        DEFAULT_MAX_TOKENS,
    )
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt_token_ids),
        sampling=SamplingOptions(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=body.seed, stop=stop
        ),
        cache_salt=cache_salt or "",
    )


# --- Response shapes -----------------------------------------------------------------------


@dataclass
class _Progress:
    """What one request has produced so far; the gateway's accounting, for HTTP."""

    placed: Placed
    received_at: float
    num_prompt_tokens: int
    num_completion_tokens: int = 0
    ttft_ms: float = 0.0
    finish_reason: str | None = None
    num_loaded_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, event: Placed | TokenChunk) -> None:
        assert isinstance(event, TokenChunk), "router sent a second Placed event"
        if event.token_ids and self.num_completion_tokens == 0:
            self.ttft_ms = (time.perf_counter() - self.received_at) * 1000.0
        self.num_completion_tokens += len(event.token_ids)
        if event.finish_reason:
            self.finish_reason = event.finish_reason
            self.num_loaded_tokens = event.num_loaded_tokens
            self.num_cached_tokens = num_cached_tokens(self.placed, event)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }

    def baton(self) -> dict:
        placement = self.placed.placement
        return {
            "placement": {
                "prefill": placement.prefill_instance,
                "decode": placement.decode_instance,
                "policy": placement.policy,
                "reason": placement.reason,
                "transfer_ms": placement.transfer_ms,
                "queue_ms": placement.queue_ms,
                "prefill_ms": placement.prefill_ms,
                "expected_cached_blocks": placement.expected_cached_blocks,
                "pulled_from": placement.pulled_from,
            },
            "loaded_tokens": self.num_loaded_tokens,
            "ttft_ms": self.ttft_ms,
        }


@dataclass(frozen=True)
class _Shape:
    """How one endpoint spells its objects and choices."""

    id_prefix: str
    object_full: str
    object_chunk: str
    chat: bool

    def header(self, request_id: str, created: int, model: str, chunk: bool) -> dict:
        return {
            "id": self.id_prefix + request_id,
            "object": self.object_chunk if chunk else self.object_full,
            "created": created,
            "model": model,
        }

    def full_choice(self, text: str, finish_reason: str | None) -> dict:
        if self.chat:
            content = {"message": {"role": "assistant", "content": text}}
        else:
            content = {"text": text}
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            content = {"delta": delta | ({"content": text} if text is not None else {})}
        else:
            content = {"text": text or ""}
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}


CHAT = _Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)
COMPLETION = _Shape("cmpl-", "text_completion", "text_completion", chat=False)


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()


async def _sse_events(
    events: AsyncIterator,
    progress: _Progress,
    shape: _Shape,
    header: dict,
    include_usage: bool,
    request_id: str,
) -> AsyncIterator[bytes]:
    """The SSE body: an opening chunk (chat), text deltas, a finish chunk with ``baton``, an
    optional usage chunk, ``[DONE]``. An error after the first byte becomes an ``error`` event.
    """
    usage_field = {"usage": None} if include_usage else {}
    try:
        with _translated(request_id):
            async with contextlib.aclosing(events):
                if shape.chat:
                    opening = shape.chunk_choice(None, None, role=True)
                    yield _sse({**header, "choices": [opening], **usage_field})
                async for event in events:
                    progress.add(event)
                    if event.text:
                        choice = shape.chunk_choice(event.text, None)
                        yield _sse({**header, "choices": [choice], **usage_field})
                assert progress.finish_reason, "router ended the stream without a finish_reason"
        finish = shape.chunk_choice(None, progress.finish_reason)
        yield _sse({**header, "choices": [finish], **usage_field, "baton": progress.baton()})
        if include_usage:
            yield _sse({**header, "choices": [], "usage": progress.usage()})
    except OpenAIError as e:
        yield _sse(e.body)
    yield _sse("[DONE]")


async def _collect(events: AsyncIterator, progress: _Progress, request_id: str) -> str:
    """The whole generated text; closes ``events`` however it ends."""
    text_parts = []
    with _translated(request_id):
        async with contextlib.aclosing(events):
            async for event in events:
                progress.add(event)
                text_parts.append(event.text)
        assert progress.finish_reason, "router ended the stream without a finish_reason"
    return "".join(text_parts)


async def _open(router: Router, request: EngineRequest) -> tuple[Placed, AsyncIterator]:
    """Starts the router's stream and waits for ``Placed``, so that placement errors still get
    a proper HTTP status; the caller owns (and must close) the returned stream."""
    events = router.stream(request)
    try:
        with _translated(request.request_id):
            placed = await anext(events)
            assert isinstance(placed, Placed), "router sent a token chunk before Placed"
    except BaseException:
        await events.aclose()
        raise
    return placed, events


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or ``None`` after cancelling it because the client went away."""
    work_task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.wait({work_task})
    return None if work_task.cancelled() else work_task.result()


# --- The app -------------------------------------------------------------------------------


class _Front:
    """The handlers' shared state: router, tokenizer and the served model's limits."""

    def __init__(self, router: Router, tokenizer: PromptTokenizer, served: ServedModel) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.served = served
        self.created = int(time.time())

    async def complete(
        self, body: ChatCompletionRequest | CompletionRequest, http_request: Request, shape: _Shape
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
        opened = await _unless_disconnected(http_request, _open(self.router, engine_request))
        if opened is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        placed, events = opened
        progress = _Progress(placed, received_at, len(engine_request.prompt_token_ids))
        header = shape.header(
            engine_request.request_id, int(time.time()), self.served.name, chunk=body.stream
        )
        response_headers = {"X-Request-Id": engine_request.request_id}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            sse = _sse_events(
                events, progress, shape, header, include_usage, engine_request.request_id
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
        text = await _unless_disconnected(
            http_request, _collect(events, progress, engine_request.request_id)
        )
        if text is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choice = shape.full_choice(text, progress.finish_reason)
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


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """One readable message (and the first offending field) from FastAPI's error list."""
    parts, params = [], []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"] if part != "body")
        if item["type"] == "json_invalid":
            detail = item.get("ctx", {}).get("error", "")
            parts.append(f"the request body is not valid JSON ({detail})")
            continue
        params.append(where or None)
        parts.append(f"{where or 'request body'}: {item['msg']}")
    message = "; ".join(parts) + "; see the OpenAI API reference for the fields"
    return message, params[0] if params else None


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
        _checked("model", check_model, model_id, served_model_name)
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
        message, param = _validation_message(error)
        status = HTTPStatus.BAD_REQUEST
        return OpenAIError(status, message, "invalid_request_error", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = str(error.detail)
        response = OpenAIError(error.status_code, message, "invalid_request_error").response()
        response.headers.update(error.headers or {})
        return response

    return app


# --- Serving -------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without its SIGINT/SIGTERM capture: the process that embeds it owns signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class RunningHttp:
    """A started HTTP front and the port it bound."""

    server: uvicorn.Server
    task: asyncio.Task
    port: int

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting; in-flight requests get ``grace_s`` seconds, then are cancelled
        (which closes their router streams)."""
        self.server.config.timeout_graceful_shutdown = grace_s
        self.server.should_exit = True
        await self.task


async def start_http(
    app: FastAPI, host: str, port: int, tls: tuple[str, str] | None = None
) -> RunningHttp:
    """Serve ``app`` with uvicorn on ``host:port`` as a task on the running loop; with ``tls``
    (certificate chain file, private key file: ``HttpConfig.tls_files()``) HTTPS only.

    ``port`` 0 binds an ephemeral port; the bound one is ``RunningHttp.port``. Raises
    ``ConfigError`` when the address cannot be bound. Logging is left to the embedding process.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise ConfigError(
            f"the HTTP front could not bind {host}:{port} ({e}); pick a free port"
        ) from e
    cert_file, key_file = tls if tls is not None else (None, None)
    config = uvicorn.Config(
        app, host=host, port=port, lifespan="off", ws="none", log_config=None, access_log=False,
        ssl_certfile=cert_file, ssl_keyfile=key_file,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped the start
            raise ConfigError(f"the HTTP front on {host}:{port} stopped while starting")
        await asyncio.sleep(0.005)
    return RunningHttp(server=server, task=task, port=sock.getsockname()[1])
