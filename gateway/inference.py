"""The gRPC front door: ``baton.v1.Inference`` over a ``Router``, plus health and reflection.

The gateway owns the wire. It parses and validates requests (``gateway.validation``), maps
every failure to a gRPC status with a message that says what to change, streams the router's
tokens back as deltas and closes each stream with a ``Final`` holding usage and placement.
Placement and the workers belong to the ``Router``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.auth import KeySet, bearer_key
from gateway.choices import choice_requests, indexed, merged
from gateway.router import Placed, Router, cached_by_tier, num_cached_tokens
from gateway.sessions import SessionFields, SessionsConfig, cache_creation_tokens, with_session
from gateway.status import retry_after_s, status_of
from gateway.tokenization import PromptTokenizer
from gateway.validation import check_num_choices, tokenize_prompt, validate_and_build
from protos.baton.v1 import inference_pb2 as pb
from protos.errors import BatonError, ConfigError
from protos.wire import EngineRequest, PositionLogprobs, TokenChunk, TokenLogprob

if TYPE_CHECKING:
    from gateway.admin import AdminServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024
NOT_READY_MESSAGE = "no prefill/decode worker is ready yet; retry in a few seconds"
MAX_DETAILS_BYTES = 2_000
"""A status message travels percent-encoded in a header (a byte outside printable ASCII takes
three), and a client drops headers past 8 KiB at random and past 16 KiB always: an error echoing
a huge field would reach it as RESOURCE_EXHAUSTED "metadata size exceeds ... limit" instead of
its own status. 2,000 UTF-8 bytes stay under 8 KiB however they encode."""


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands in for a request whose bytes did not parse, so the handler can reject it.

    grpc reports a deserializer exception as UNKNOWN; the client sent a bad request (most
    often a string field that is not UTF-8), which is INVALID_ARGUMENT.
    """

    message: str


def status_details(error: BatonError) -> str:
    """``error``'s message as a status's details: cut to ``MAX_DETAILS_BYTES`` of UTF-8."""
    message = str(error)
    encoded = message.encode()
    if len(encoded) <= MAX_DETAILS_BYTES:
        return message
    kept = encoded[:MAX_DETAILS_BYTES].decode(errors="ignore")
    return f"{kept}... ({len(message) - len(kept)} characters cut)"


def _tolerant_parser(message_type) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return UndecodableRequest(
                f"the request is not a valid {message_type.DESCRIPTOR.full_name}: {e}; "
                "every string field (prompt text, chat content, stop strings, ...) "
                "must be valid UTF-8"
            )

    return parse


class InferenceServicer:
    """Implements ``baton.v1.Inference`` for one served model.

    ``max_model_len`` is the context window in tokens; ``vocab_size`` (default: the
    tokenizer's) bounds client-given token ids. Register it with ``start_gateway``, which
    installs the tolerant request parsing this class relies on.
    """

    def __init__(
        self,
        router: Router,
        tokenizer: PromptTokenizer,
        served_model_name: str,
        max_model_len: int,
        vocab_size: int | None = None,
        api_keys: frozenset[str] = frozenset(),
        structured_backend: str = "auto",
        sessions: SessionsConfig = SessionsConfig(),
    ) -> None:
        self._api_keys = KeySet(api_keys)
        self._sessions = sessions
        self._structured_backend = structured_backend
        self._router = router
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size if vocab_size is not None else tokenizer.vocab_size

    def method_handlers(self) -> grpc.GenericRpcHandler:
        """The handlers for ``baton.v1.Inference``, parsing requests with ``_tolerant_parser``."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.Generate,
                    request_deserializer=_tolerant_parser(pb.GenerateRequest),
                    response_serializer=pb.GenerateResponse.SerializeToString,
                ),
                "Tokenize": grpc.unary_unary_rpc_method_handler(
                    self.Tokenize,
                    request_deserializer=_tolerant_parser(pb.TokenizeRequest),
                    response_serializer=pb.TokenizeResponse.SerializeToString,
                ),
            },
        )

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """With keys configured, every call carries ``authorization: Bearer <key>`` metadata."""
        if not self._api_keys:
            return
        if not self._api_keys.accepts(bearer_key(context.invocation_metadata())):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid API key: send metadata 'authorization: Bearer <key>'",
            )

    def _offered_key(self, context: grpc.aio.ServicerContext) -> str:
        """The key the call authenticated with ('' when the gateway runs without keys)."""
        return bearer_key(context.invocation_metadata()) if self._api_keys else ""

    async def Generate(
        self, request: pb.GenerateRequest | UndecodableRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Validate, check readiness, then relay the router's stream (see the .proto contract)."""
        received_at = time.perf_counter()
        await self._authenticate(context)
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            engine_request = await asyncio.to_thread(
                validate_and_build,
                request,
                self._tokenizer,
                self._served_model_name,
                self._max_model_len,
                self._vocab_size,
                structured_backend=self._structured_backend,
            )
            engine_request = with_session(engine_request, session_fields(request),
                                          self._sessions, self._offered_key(context))
            n = check_num_choices(request.sampling.n)
        except BatonError as e:
            await context.abort(status_of(e).grpc_code, status_details(e))
        if not self._router.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY_MESSAGE)

        status, details = await self._relay(choice_requests(engine_request, n), context,
                                            received_at)
        if status is not None:
            await context.abort(status, details)

    async def _relay(
        self, requests: list[EngineRequest], context: grpc.aio.ServicerContext,
        received_at: float
    ) -> tuple[grpc.StatusCode | None, str]:
        """Writes each choice's deltas and its final message; returns the status to abort with,
        if any. With several choices (``sampling.n``) their streams run side by side and every
        message carries its choice's index; one failing choice fails the request.

        Cancellation (the client went away) propagates out of here, and ``aclosing`` closes
        the routers' streams so the workers abort the requests.
        """
        n = len(requests)
        choices = [_Choice() for _ in range(n)]
        streams = [indexed(index, self._router.stream(request))
                   for index, request in enumerate(requests)]
        events = streams[0] if n == 1 else merged(streams)
        try:
            async with contextlib.aclosing(events):
                async for index, event in events:
                    choice = choices[index]
                    if isinstance(event, Placed):
                        assert choice.placed is None, "router sent a second Placed event"
                        choice.placed = event
                        continue
                    assert choice.placed is not None, "router sent a token chunk before Placed"
                    choice.last_chunk = event
                    if event.token_ids or event.text or event.prompt_logprobs:
                        if event.token_ids and choice.num_completion_tokens == 0:
                            choice.ttft_ms = _ms_since(received_at)
                        choice.num_completion_tokens += len(event.token_ids)
                        await context.write(pb.GenerateResponse(delta=_delta(event, index)))
                    if event.finish_reason:
                        await context.write(pb.GenerateResponse(final=_final(
                            requests[index], choice, index, received_at)))
            for choice in choices:
                assert choice.placed is not None, (
                    "router ended the stream without placing the request")
                assert choice.last_chunk is not None and choice.last_chunk.finish_reason, (
                    "router ended the stream without a finish_reason")
        except BatonError as e:
            retry_s = retry_after_s(e)
            if retry_s is not None:
                context.set_trailing_metadata((("retry-after-ms", str(round(retry_s * 1000))),))
            return status_of(e).grpc_code, status_details(e)
        except Exception:
            logger.exception("request %s failed inside the gateway", requests[0].request_id)
            return (
                grpc.StatusCode.INTERNAL,
                f"internal error while serving request {requests[0].request_id}; "
                "the gateway log has the details",
            )
        return None, ""

    async def Tokenize(
        self, request: pb.TokenizeRequest | UndecodableRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        """The prompt's token ids; checks the model and prompt but not the context window."""
        await self._authenticate(context)
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            token_ids = await asyncio.to_thread(
                tokenize_prompt,
                request,
                self._tokenizer,
                self._served_model_name,
                self._vocab_size,
            )
        except BatonError as e:
            await context.abort(status_of(e).grpc_code, status_details(e))
        return pb.TokenizeResponse(token_ids=token_ids, num_tokens=len(token_ids))


def session_fields(request: pb.GenerateRequest) -> SessionFields:
    """The session a ``GenerateRequest`` names (0 for a TTL or a next-step hint: unset)."""
    return SessionFields(request.session_id, request.session_ttl_s, request.expected_next_step_s)


@dataclass
class _Choice:
    """One choice's stream so far: where it was placed, its last chunk, tokens and TTFT."""

    placed: Placed | None = None
    last_chunk: TokenChunk | None = None
    num_completion_tokens: int = 0
    ttft_ms: float = 0.0


def _final(request: EngineRequest, choice: _Choice, index: int, received_at: float) -> pb.Final:
    """The message that ends ``choice``: why, its usage and where it ran."""
    placed, last_chunk = choice.placed, choice.last_chunk
    num_prompt_tokens = len(request.prompt_token_ids)
    cached = num_cached_tokens(placed, last_chunk)
    usage = pb.Usage(
        prompt_tokens=num_prompt_tokens,
        cached_tokens=cached,
        completion_tokens=choice.num_completion_tokens,
        ttft_ms=choice.ttft_ms,
        e2e_ms=_ms_since(received_at),
        loaded_tokens=last_chunk.num_loaded_tokens,
        cache_creation_input_tokens=cache_creation_tokens(request.leases, num_prompt_tokens,
                                                          cached),
        cache_read_input_tokens=cached,
    )
    tiers = cached_by_tier(placed, last_chunk)
    if tiers is not None:
        usage.cached_tokens_by_tier.CopyFrom(pb.CachedTokensByTier(
            device=tiers.device, host=tiers.host, disk=tiers.disk, pulled=tiers.pulled))
    placement = pb.PlacementInfo(
        prefill=placed.placement.prefill_instance,
        decode=placed.placement.decode_instance,
        policy=placed.placement.policy,
        reason=placed.placement.reason,
        transfer_ms=placed.placement.transfer_ms,
        queue_ms=placed.placement.queue_ms,
        prefill_ms=placed.placement.prefill_ms,
        expected_cached_blocks=placed.placement.expected_cached_blocks,
        pulled_from=placed.placement.pulled_from,
    )
    return pb.Final(finish_reason=last_chunk.finish_reason, usage=usage, placement=placement,
                    request_id=request.request_id, index=index)


def _delta(chunk: TokenChunk, index: int = 0) -> pb.TokenDelta:
    """A chunk's tokens, their text and, when the request asked, their log-probabilities (and,
    on the first, the prompt's)."""
    return pb.TokenDelta(
        index=index,
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=[_position(position) for position in chunk.logprobs],
        prompt_logprobs=[_position(position) for position in chunk.prompt_logprobs],
    )


def _position(position: PositionLogprobs) -> pb.PositionLogprobs:
    return pb.PositionLogprobs(chosen=_token_logprob(position.chosen),
                               top=[_token_logprob(entry) for entry in position.top])


def _token_logprob(entry: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=entry.token_id, token=entry.token, logprob=entry.logprob, rank=entry.rank
    )


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


@dataclass
class RunningGateway:
    """A started gateway server, the port it bound, and its health status."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for the server ("") and for ``baton.v1.Inference``."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, then stop; in-flight RPCs get ``grace_s`` seconds to finish."""
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def start_gateway(
    servicer: InferenceServicer,
    host: str,
    port: int,
    max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES,
    tls: tuple[bytes, bytes] | None = None,
    admin: "AdminServicer | None" = None,
) -> RunningGateway:
    """Serve ``servicer`` with health checking and reflection on ``host:port`` and start;
    with ``tls`` (PEM private key, certificate chain) over TLS only; with ``admin``, the
    ``baton.v1.Admin`` service on the same port.

    ``port`` 0 binds an ephemeral port; the bound one is ``RunningGateway.port``. Health
    reports SERVING until ``RunningGateway.set_serving(False)`` or ``stop``.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_receive_message_bytes),
            # A second gateway on a taken port must fail, not silently share it.
            ("grpc.so_reuseport", 0),
        ]
    )
    server.add_generic_rpc_handlers((servicer.method_handlers(),))
    service_names = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
    if admin is not None:
        server.add_generic_rpc_handlers((admin.method_handlers(),))
        service_names.append(admin.SERVICE_NAME)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(service_names, server)
    try:
        if tls is None:
            bound_port = server.add_insecure_port(f"{host}:{port}")
        else:
            credentials = grpc.ssl_server_credentials([tls])
            bound_port = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError as e:
        raise ConfigError(
            f"the gateway could not bind {host}:{port} ({e}); pick a free port"
        ) from e
    gateway = RunningGateway(server=server, port=bound_port, health=health_servicer)
    await gateway.set_serving(True)
    await server.start()
    return gateway
