"""A small ``baton.v1.Inference`` client: what ``baton generate`` calls.

It builds one ``GenerateRequest``, streams the deltas to a callback and returns the whole
result as a JSON-ready dict for the CLI to print.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import grpc

from protos.baton.v1 import inference_pb2 as pb
from protos.baton.v1 import inference_pb2_grpc as pb_grpc
from protos.errors import BatonError

DeltaCallback = Callable[[str, list[int]], None]


class GenerateFailed(BatonError):
    """The gateway answered with a gRPC error; ``status`` is its name, e.g. INVALID_ARGUMENT;
    ``retry_after_ms`` the gateway's retry hint (``retry-after-ms`` trailing metadata), None
    when it sent none (an error a retry cannot fix)."""

    def __init__(self, status: str, details: str, retry_after_ms: int | None = None) -> None:
        super().__init__(f"{status}: {details}")
        self.status = status
        self.details = details
        self.retry_after_ms = retry_after_ms


def _retry_after_ms(error: grpc.aio.AioRpcError) -> int | None:
    hint = dict(error.trailing_metadata() or ()).get("retry-after-ms")
    return int(hint) if hint is not None and str(hint).isdigit() else None


def build_request(
    text: str | None = None,
    chat: bool = False,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    cache_salt: str = "",
    model: str = "",
    request_id: str = "",
    logprobs: int | None = None,
    json_schema: str = "",
    json_object: bool = False,
    cache_salt_offset: int | None = None,
    knobs: Mapping[str, Any] | None = None,
    prefill: str = "",
) -> pb.GenerateRequest:
    """A ``GenerateRequest`` for exactly one of ``text`` and ``token_ids``.

    With ``chat``, ``text`` is sent as a single user chat message; a ``prefill`` follows it as
    the assistant's answer so far, which the model continues (``continue_final_message``). ``logprobs``, ``json_schema``
    (JSON text) and ``json_object`` are ``SamplingParams``' fields of those names.
    ``cache_salt_offset``: the token offset from which ``cache_salt`` applies (unset: the whole
    prompt). ``knobs``: more ``SamplingParams`` fields by name (``top_k``, ``min_p``,
    ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``min_tokens``,
    ``logit_bias`` as a token id -> bias mapping, and the constraints ``regex`` and ``choice``
    as a list of strings). Values are sent as given; the gateway
    validates them.
    """
    if (text is None) == (token_ids is None):
        raise ValueError("pass exactly one of text and token_ids")
    if chat and text is None:
        raise ValueError("chat=True needs text")
    if prefill and not chat:
        raise ValueError("a prefill needs chat=True (it is the assistant's message)")
    request = pb.GenerateRequest(model=model, cache_salt=cache_salt, request_id=request_id)
    if cache_salt_offset is not None:
        request.cache_salt_offset = cache_salt_offset
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    elif chat:
        request.chat.messages.add(role="user", content=text)
        if prefill:
            request.chat.messages.add(role="assistant", content=prefill)
            request.chat.continue_final_message = True
    else:
        request.text = text
    sampling = request.sampling
    sampling.temperature = temperature
    sampling.stop.extend(stop)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    sampling.json_schema = json_schema
    sampling.json_object = json_object
    for name, value in (knobs or {}).items():
        if name == "logit_bias":
            sampling.logit_bias.update({int(k): v for k, v in value.items()})
        elif name == "choice":
            sampling.choice.extend(value)
        else:
            setattr(sampling, name, value)
    return request


def open_channel(target: str, tls_ca_file: str | None = None) -> grpc.aio.Channel:
    """A channel to the gateway: TLS when ``tls_ca_file`` names the PEM roots to trust."""
    if tls_ca_file is None:
        return grpc.aio.insecure_channel(target)
    with open(tls_ca_file, "rb") as f:
        roots = f.read()
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))


async def generate(
    target: str,
    text: str | None = None,
    chat: bool = False,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    cache_salt: str = "",
    model: str = "",
    request_id: str = "",
    logprobs: int | None = None,
    json_schema: str = "",
    json_object: bool = False,
    on_delta: DeltaCallback | None = None,
    timeout_s: float | None = None,
    api_key: str = "",
    tls_ca_file: str | None = None,
    cache_salt_offset: int | None = None,
    session_id: str = "",
    knobs: Mapping[str, Any] | None = None,
    prefill: str = "",
) -> dict[str, Any]:
    """Run one Generate RPC against ``target`` (``host:port``) and return its result.

    ``on_delta(text, token_ids)`` is called for every streamed delta. The result has the keys
    ``text``, ``token_ids``, ``finish_reason``, ``usage`` (``prompt_tokens``,
    ``cached_tokens``, ``completion_tokens``, ``loaded_tokens``, ``ttft_ms``, ``e2e_ms``,
    ``cache_creation_input_tokens``, ``cache_read_input_tokens``, and where the gateway broke
    it down ``cached_tokens_by_tier``: ``{"device", "host", "disk", "pulled"}`` adding up to
    ``cached_tokens``),
    ``placement`` (``prefill``, ``decode``, ``policy``, ``reason``) and ``request_id``; with
    ``logprobs`` set also ``logprobs``: one ``{"chosen": entry, "top": [entry, ...]}`` per
    generated token, each entry ``{"token_id", "token", "logprob", "rank"}``.
    With ``tls_ca_file`` (PEM roots to trust) the call goes over TLS. Raises
    ``GenerateFailed`` when the RPC fails or ends without a final message.
    """
    request = build_request(
        text=text,
        chat=chat,
        token_ids=token_ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        cache_salt=cache_salt,
        model=model,
        request_id=request_id,
        logprobs=logprobs,
        json_schema=json_schema,
        json_object=json_object,
        cache_salt_offset=cache_salt_offset,
        knobs=knobs,
        prefill=prefill,
    )
    request.session_id = session_id
    text_parts: list[str] = []
    all_token_ids: list[int] = []
    positions: list[dict[str, Any]] = []
    final: pb.Final | None = None
    async with open_channel(target, tls_ca_file) as channel:
        stub = pb_grpc.InferenceStub(channel)
        try:
            metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
            async for response in stub.Generate(request, timeout=timeout_s, metadata=metadata):
                if response.HasField("final"):
                    final = response.final
                    continue
                delta_token_ids = list(response.delta.token_ids)
                text_parts.append(response.delta.text)
                all_token_ids.extend(delta_token_ids)
                positions.extend(_position(position) for position in response.delta.logprobs)
                if on_delta is not None:
                    on_delta(response.delta.text, delta_token_ids)
        except grpc.aio.AioRpcError as e:
            raise GenerateFailed(e.code().name, e.details() or "", _retry_after_ms(e)) from e
    if final is None:
        raise GenerateFailed("INTERNAL", "the stream ended without a final message")
    usage = final.usage
    result = {
        "text": "".join(text_parts),
        "token_ids": all_token_ids,
        "finish_reason": final.finish_reason,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
            "completion_tokens": usage.completion_tokens,
            "loaded_tokens": usage.loaded_tokens,
            "ttft_ms": usage.ttft_ms,
            "e2e_ms": usage.e2e_ms,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
        },
        "placement": {
            "prefill": final.placement.prefill,
            "decode": final.placement.decode,
            "policy": final.placement.policy,
            "reason": final.placement.reason,
            "transfer_ms": final.placement.transfer_ms,
            "queue_ms": final.placement.queue_ms,
            "prefill_ms": final.placement.prefill_ms,
            "expected_cached_blocks": final.placement.expected_cached_blocks,
            "pulled_from": final.placement.pulled_from,
        },
        "request_id": final.request_id,
    }
    if usage.HasField("cached_tokens_by_tier"):
        tiers = usage.cached_tokens_by_tier
        result["usage"]["cached_tokens_by_tier"] = {
            "device": tiers.device, "host": tiers.host, "disk": tiers.disk, "pulled": tiers.pulled}
    if logprobs is not None:
        result["logprobs"] = positions
    return result


def _position(position: pb.PositionLogprobs) -> dict[str, Any]:
    return {"chosen": _entry(position.chosen), "top": [_entry(entry) for entry in position.top]}


def _entry(entry: pb.TokenLogprob) -> dict[str, Any]:
    return {"token_id": entry.token_id, "token": entry.token, "logprob": entry.logprob,
            "rank": entry.rank}
