"""The engine gRPC contract (``vllm.grpc.engine.VllmEngine`` from PyPI ``smg-grpc-proto``, what
vLLM's ``--grpc`` mode serves and SMG's gRPC workers speak), served for the whole cluster.

A router in front of it (SMG) sees one engine: ``Generate`` goes through the same live router as
``baton.v1`` Generate (the conductor places, the prefill and decode pools serve), ``Abort``
cancels a running ``Generate`` as a client's gRPC cancel does (the router's stream closes, the
workers abort, the conductor's books close), ``GetLoads`` and ``SubscribeKvEvents`` report what
the conductor knows of every engine (``gateway.engine_replies``), errors answer with the status
``gateway.status`` gives each kind. Same API keys (``authorization: Bearer``) and TLS switch as
the gRPC gateway. ``Embed``, ``FlushCache`` and the profiler RPCs are not served
(UNIMPLEMENTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2 as cpb

from gateway import engine_replies as replies
from gateway.auth import KeySet, bearer_key
from gateway.choices import choice_requests, indexed, merged
from gateway.engine_requests import ModelLimits, contract_session_fields, engine_request
from gateway.inference import NOT_READY_MESSAGE, UndecodableRequest, status_details
from gateway.router import Placed, Router
from gateway.sessions import SessionsConfig, with_session
from gateway.status import retry_after_s, status_of
from gateway.tokenization import PromptTokenizer
from protos.errors import BatonError, ConfigError
from protos.wire import ClusterLoad, EngineRequest, KvFeedBatch, TokenChunk

log = logging.getLogger(__name__)

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "baton"
KV_EVENTS_POLL_S = 1.0
"""The longest one conductor poll of ``SubscribeKvEvents`` waits for a batch."""


class ClusterView(Protocol):
    """What the contract reads from the conductor (a Ray actor handle behind ``RayClusterView``)."""

    async def cluster_load(self) -> ClusterLoad: ...

    async def kv_event_batches(self, after_seq: int, wait_s: float) -> list[KvFeedBatch]: ...

    async def kv_last_seq(self) -> int: ...

    async def block_size_tokens(self) -> int: ...


class RayClusterView:
    """``ClusterView`` over the conductor actor."""

    def __init__(self, conductor) -> None:
        self._conductor = conductor

    async def cluster_load(self) -> ClusterLoad:
        return await self._conductor.cluster_load.remote()

    async def kv_event_batches(self, after_seq: int, wait_s: float) -> list[KvFeedBatch]:
        return await self._conductor.kv_event_batches.remote(after_seq, wait_s)

    async def kv_last_seq(self) -> int:
        return await self._conductor.kv_last_seq.remote()

    async def block_size_tokens(self) -> int:
        scheme = await self._conductor.key_scheme.remote()
        return scheme.block_size_tokens if scheme is not None else 0


@dataclass(frozen=True)
class ServedModel:
    """The model as the contract describes it."""

    path: Path
    name: str
    max_model_len: int
    vocab_size: int
    dtype: str = ""
    max_num_seqs: int = 0
    """Sequences the decode pool runs at once (per-engine ``max_num_seqs`` × instances)."""


@dataclass
class _Progress:
    """Per choice of a request: the tokens streamed so far, and whether its last message went."""

    completion_tokens: list[int]
    completed: set[int] = field(default_factory=set)


@dataclass
class ContractCounters:
    """What happened to the requests this servicer streamed (read by tests and ``baton`` logs)."""

    generated: int = 0
    aborted_by_rpc: int = 0
    """Running requests an ``Abort`` RPC cancelled."""
    cancelled_by_client: int = 0
    """Running requests whose ``Generate`` call the client cancelled (it went away)."""
    aborted_ids: list[str] = field(default_factory=list)


def _parser(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return UndecodableRequest(f"the request is not a valid "
                                      f"{message_type.DESCRIPTOR.full_name}: {e}")
    return parse


class EngineContractServicer:
    """Implements ``vllm.grpc.engine.VllmEngine`` over a ``Router`` and the conductor."""

    def __init__(self, router: Router, cluster: ClusterView, tokenizer: PromptTokenizer,
                 model: ServedModel, api_keys: frozenset[str] = frozenset(),
                 structured_backend: str = "auto",
                 sessions: SessionsConfig = SessionsConfig()) -> None:
        self._router = router
        self._sessions = sessions
        self._cluster = cluster
        self._tokenizer = tokenizer
        self._model = model
        self._api_keys = KeySet(api_keys)
        self._model_info = replies.model_info(model.path, model.name, model.max_model_len,
                                              model.vocab_size)
        self._limits = ModelLimits(model.name, model.max_model_len, model.vocab_size,
                                   tuple(self._model_info.eos_token_ids), structured_backend)
        self._running: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()
        self._started_at = time.time()
        self._last_receive = 0.0
        self._tokenizer_zip: bytes | None = None
        self.counters = ContractCounters()

    def method_handlers(self) -> grpc.GenericRpcHandler:
        def unary(method, request_type, response_type):
            return grpc.unary_unary_rpc_method_handler(
                method, request_deserializer=_parser(request_type),
                response_serializer=response_type.SerializeToString)

        def stream(method, request_type, response_type):
            return grpc.unary_stream_rpc_method_handler(
                method, request_deserializer=_parser(request_type),
                response_serializer=response_type.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": stream(self.Generate, vpb.GenerateRequest, vpb.GenerateResponse),
            "Abort": unary(self.Abort, vpb.AbortRequest, vpb.AbortResponse),
            "HealthCheck": unary(self.HealthCheck, vpb.HealthCheckRequest, vpb.HealthCheckResponse),
            "GetModelInfo": unary(self.GetModelInfo, vpb.GetModelInfoRequest,
                                  vpb.GetModelInfoResponse),
            "GetServerInfo": unary(self.GetServerInfo, vpb.GetServerInfoRequest,
                                   vpb.GetServerInfoResponse),
            "GetLoads": unary(self.GetLoads, vpb.GetLoadsRequest, vpb.GetLoadsResponse),
            "GetTokenizer": stream(self.GetTokenizer, cpb.GetTokenizerRequest,
                                   cpb.GetTokenizerChunk),
            "SubscribeKvEvents": stream(self.SubscribeKvEvents, cpb.SubscribeKvEventsRequest,
                                        cpb.KvEventBatch),
        })

    async def _checked(self, request, context: grpc.aio.ServicerContext) -> None:
        """The API key (when keys are configured) and a request that parsed."""
        if self._api_keys and not self._api_keys.accepts(bearer_key(context.invocation_metadata())):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key: send metadata "
                                "'authorization: Bearer <key>'")
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    # ------------------------------------------------------------------ Generate, Abort

    async def Generate(self, request: vpb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        """Validate, then relay the router's stream: chunks (``stream``) or one complete. With
        ``n`` > 1 each choice is an engine request of its own (``gateway.choices``) and every
        message carries its choice's ``index``, as vLLM's servicer sends them: streamed, the
        choices' chunks interleave and each choice completes when it ends; not streamed, one
        complete per choice in index order."""
        await self._checked(request, context)
        self._last_receive = time.time()
        try:
            built = await asyncio.to_thread(engine_request, request, self._tokenizer, self._limits)
            metadata = context.invocation_metadata()
            api_key = bearer_key(metadata) if self._api_keys else ""
            built = with_session(built, contract_session_fields(metadata), self._sessions, api_key)
        except BatonError as e:
            await context.abort(status_of(e).grpc_code, status_details(e))
        if not self._router.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY_MESSAGE)
        request_id = built.request_id
        if request_id in self._running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request {request_id} is already running; give each request "
                                "its own request_id")
        choices = choice_requests(built, max(1, request.sampling_params.n))
        progress = _Progress([0] * len(choices))
        relay = asyncio.ensure_future(self._relay(choices, request.stream, context, progress))
        self._running[request_id] = relay
        self.counters.generated += 1
        try:
            status, details = await relay
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if request_id not in self._aborted or (current is not None and current.cancelling()):
                relay.cancel()
                self.counters.cancelled_by_client += 1
                log.info("engine contract: request %s cancelled by its client", request_id)
                raise
            status, details = None, ""
            for index, num_tokens in enumerate(progress.completion_tokens):
                if index not in progress.completed:
                    await context.write(replies.aborted(len(built.prompt_token_ids), num_tokens,
                                                        index))
        finally:
            self._running.pop(request_id, None)
            self._aborted.discard(request_id)
        if status is not None:
            await context.abort(status, details)

    async def _relay(self, requests: list[EngineRequest], stream: bool,
                     context: grpc.aio.ServicerContext,
                     progress: _Progress) -> tuple[grpc.StatusCode | None, str]:
        """Writes the answer of every choice; returns the status to abort with, if any.
        Cancelling it (a client cancel or an ``Abort``) closes the router's streams, which
        aborts the requests on the workers and closes the conductor's books."""
        n = len(requests)
        placed: list[Placed | None] = [None] * n
        last: list[TokenChunk | None] = [None] * n
        output_ids: list[list[int]] = [[] for _ in range(n)]
        logprob_parts: list[list] = [[] for _ in range(n)]
        prompt_logprobs: list[vpb.InputLogProbs | None] = [None] * n
        prompt_token_ids = requests[0].prompt_token_ids
        num_prompt_tokens = len(prompt_token_ids)
        streams = [indexed(index, self._router.stream(request))
                   for index, request in enumerate(requests)]
        events = streams[0] if n == 1 else merged(streams)
        try:
            async with contextlib.aclosing(events):
                async for index, event in events:
                    if isinstance(event, Placed):
                        placed[index] = event
                        continue
                    where = placed[index]
                    assert where is not None, "router sent a token chunk before Placed"
                    last[index] = event
                    output_ids[index].extend(event.token_ids)
                    progress.completion_tokens[index] += len(event.token_ids)
                    if event.prompt_logprobs:  # the first chunk, when they were asked for
                        prompt_logprobs[index] = replies.input_logprobs(prompt_token_ids,
                                                                        event.prompt_logprobs)
                    if stream and event.token_ids:
                        await context.write(replies.stream_chunk(
                            event, num_prompt_tokens, where, index, prompt_logprobs[index]))
                        prompt_logprobs[index] = None  # sent: the first chunk only
                    elif event.logprobs:
                        logprob_parts[index].append(replies.output_logprobs(event))
                    if stream and event.finish_reason:
                        await context.write(replies.complete(
                            list(event.token_ids), event, num_prompt_tokens,
                            len(event.token_ids), where, replies.output_logprobs(event), index))
                        progress.completed.add(index)
            assert all(chunk is not None and chunk.finish_reason for chunk in last), (
                "router ended the stream without a finish_reason")
        except BatonError as e:
            retry_s = retry_after_s(e)
            if retry_s is not None:
                context.set_trailing_metadata((("retry-after-ms", str(round(retry_s * 1000))),))
            return status_of(e).grpc_code, status_details(e)
        except Exception:
            log.exception("request %s failed inside the engine contract", requests[0].request_id)
            return (grpc.StatusCode.INTERNAL,
                    f"internal error while serving request {requests[0].request_id}; "
                    "the gateway log has the details")
        if not stream:
            for index in range(n):
                await context.write(replies.complete(
                    output_ids[index], last[index], num_prompt_tokens, len(output_ids[index]),
                    placed[index], replies.merge_logprobs(logprob_parts[index]), index,
                    prompt_logprobs[index]))
                progress.completed.add(index)
        return None, ""

    async def Abort(self, request: vpb.AbortRequest, context) -> vpb.AbortResponse:
        """Cancel the running requests named (unknown or finished ids are ignored)."""
        await self._checked(request, context)
        for request_id in request.request_ids:
            relay = self._running.get(request_id)
            if relay is not None and not relay.done() and request_id not in self._aborted:
                self._aborted.add(request_id)
                relay.cancel()
                self.counters.aborted_by_rpc += 1
                self.counters.aborted_ids.append(request_id)
                log.info("engine contract: request %s aborted", request_id)
        return vpb.AbortResponse()

    # ------------------------------------------------------------------ state

    async def HealthCheck(self, request, context) -> vpb.HealthCheckResponse:
        await self._checked(request, context)
        if self._router.is_ready():
            return vpb.HealthCheckResponse(healthy=True, message="Healthy")
        return vpb.HealthCheckResponse(healthy=False, message=NOT_READY_MESSAGE)

    async def GetModelInfo(self, request, context) -> vpb.GetModelInfoResponse:
        await self._checked(request, context)
        return self._model_info

    async def GetServerInfo(self, request, context) -> vpb.GetServerInfoResponse:
        await self._checked(request, context)
        block_size = 0
        with contextlib.suppress(Exception):  # no conductor answer: unknown, as the contract has
            block_size = await self._cluster.block_size_tokens()
        return vpb.GetServerInfoResponse(
            active_requests=len(self._running), is_paused=False,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started_at, server_type=SERVER_TYPE,
            data_parallel_size=1, block_size=block_size, model_dtype=self._model.dtype,
            max_num_seqs=self._model.max_num_seqs)

    async def GetLoads(self, request, context) -> vpb.GetLoadsResponse:
        await self._checked(request, context)
        try:
            load = await self._cluster.cluster_load()
        except Exception as e:  # noqa: BLE001 - the conductor is what is unavailable
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the conductor did not answer ({type(e).__name__}); retry")
        return replies.loads_response(load, SERVER_TYPE)

    async def GetTokenizer(self, request, context):
        await self._checked(request, context)
        if self._tokenizer_zip is None:
            self._tokenizer_zip = await asyncio.to_thread(replies.tokenizer_zip, self._model.path)
        for chunk in replies.tokenizer_chunks(self._tokenizer_zip):
            await context.write(chunk)

    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest, context) -> None:
        """Every engine's KV event batches from ``start_sequence_number`` (0: from now on),
        until the client goes away."""
        await self._checked(request, context)
        await context.send_initial_metadata(())
        after = request.start_sequence_number - 1 if request.start_sequence_number else None
        while True:
            try:
                if after is None:  # from now on
                    after = await self._cluster.kv_last_seq()
                batches = await self._cluster.kv_event_batches(after, KV_EVENTS_POLL_S)
            except Exception as e:  # noqa: BLE001
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"the conductor did not answer ({type(e).__name__}); "
                                    "subscribe again")
            for batch in batches:
                await context.write(replies.kv_event_batch(batch))
                after = batch.seq


@dataclass
class RunningEngineContract:
    server: grpc.aio.Server
    port: int
    servicer: EngineContractServicer
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        """grpc.health.v1 for the server ("") and the contract's service; ``HealthCheck`` itself
        follows the router's readiness."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace_s: float | None = None) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def start_engine_contract(servicer: EngineContractServicer, host: str, port: int,
                                tls: tuple[bytes, bytes] | None = None) -> RunningEngineContract:
    """Serve ``servicer`` (with grpc.health.v1 and reflection) on ``host:port``; with ``tls``
    (PEM private key, certificate chain) over TLS only. ``port`` 0 binds a free one. Health
    reports NOT_SERVING until ``set_serving(True)``."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
    server.add_generic_rpc_handlers((servicer.method_handlers(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        if tls is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([tls]))
    except RuntimeError as e:
        raise ConfigError(f"engine_grpc could not bind {host}:{port} ({e}); pick a free "
                          "engine_grpc.port") from e
    running = RunningEngineContract(server, bound, servicer, health_servicer)
    await running.set_serving(False)
    await server.start()
    return running
