"""The engine gRPC contract's ``GenerateRequest`` (``vllm.grpc.engine``, PyPI ``smg-grpc-proto``)
as a Baton request: pure functions, no wire beyond the two messages.

A contract request is mapped onto Baton's own ``baton.v1.GenerateRequest`` and validated by the
same ``gateway.validation.validate_and_build`` as the gRPC front's, so both fronts accept and
refuse alike (the context window, token ids, temperature, top_p, stop strings, logprobs, JSON
schemas). What the contract can ask for and Baton's engines cannot do is refused here with
``InvalidRequest`` naming the field, unless the field holds its neutral value (SMG fills some of
them with their defaults on every request).
"""

from __future__ import annotations

import json
import math

import msgspec
from smg_grpc_proto import vllm_engine_pb2 as vpb

from gateway.choices import MAX_CHOICES
from gateway.sessions import InvalidField, SessionFields
from gateway.tokenization import PromptTokenizer
from gateway.validation import (
    MAX_LOGPROBS,
    check_bounded,
    check_num_choices,
    validate_and_build,
)
from protos.baton.v1 import inference_pb2 as pb
from protos.errors import InvalidRequest
from protos.wire import EngineRequest

UNSUPPORTED_CONSTRAINTS = ("grammar", "structural_tag")
REMOTE_PREFILL_KEYS = ("do_remote_prefill", "do_remote_decode")
"""``kv_transfer_params_json`` keys with which a PD router hands a request's KV between two of its
workers: Baton moves KV between its own prefill and decode pools itself."""


SESSION_ID_KEY = "x-session-id"
SESSION_TTL_KEY = "x-session-ttl-s"
NEXT_STEP_KEY = "x-expected-next-step-s"
"""The gRPC metadata keys in which a caller of the engine contract names its agent session: the
contract's ``GenerateRequest`` (SMG's proto) has no field for it, and Baton adds none to a proto
it does not own. Same meanings as ``baton.v1``'s ``session_id``, ``session_ttl_s`` and
``expected_next_step_s`` (and HTTP's ``X-Session-Id``)."""


class ModelLimits(msgspec.Struct, frozen=True):
    """What a request is checked against: the served model."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    structured_backend: str = "auto"


def engine_request(request: vpb.GenerateRequest, tokenizer: PromptTokenizer,
                   limits: ModelLimits) -> EngineRequest:
    """Check a contract ``GenerateRequest`` and turn it into Baton's ``EngineRequest``.

    ``InvalidRequest`` for a request Baton cannot serve as asked; the message names the field.
    """
    check_unsupported(request, limits)
    kv_transfer_params(request)
    baton_request = baton_generate_request(request)
    built = validate_and_build(baton_request, tokenizer, limits.served_model_name,
                               limits.max_model_len, limits.vocab_size,
                               structured_backend=limits.structured_backend)
    if request.sampling_params.ignore_eos:
        built = msgspec.structs.replace(
            built, sampling=msgspec.structs.replace(built.sampling, ignore_eos=True))
    if request.sampling_params.HasField("prompt_logprobs"):
        built = msgspec.structs.replace(built, sampling=msgspec.structs.replace(
            built.sampling, num_prompt_logprobs=check_bounded(
                "sampling_params.prompt_logprobs", request.sampling_params.prompt_logprobs,
                MAX_LOGPROBS)))
    return built


def contract_session_fields(metadata) -> SessionFields:
    """The session a contract call names in its gRPC metadata (``SESSION_ID_KEY`` and the two
    beside it; none: no session). ``InvalidField`` naming the key for a value that is not a
    number; the ranges are checked where every front's are (``gateway.sessions.with_session``)."""
    values: dict[str, str] = {}
    for key, value in metadata or ():
        if key in (SESSION_ID_KEY, SESSION_TTL_KEY, NEXT_STEP_KEY):
            if key in values:
                raise InvalidField(f"gRPC metadata {key!r} is sent twice; send it once", key)
            values[key] = value if isinstance(value, str) else value.decode("utf-8", "replace")

    def number(key: str) -> float | None:
        if key not in values:
            return None
        try:
            return float(values[key])
        except ValueError as e:
            raise InvalidField(f"gRPC metadata {key!r} must be a number of seconds, got "
                               f"{values[key]!r}", key) from e

    return SessionFields(values.get(SESSION_ID_KEY, "").strip(), number(SESSION_TTL_KEY),
                         number(NEXT_STEP_KEY), session_id_field=SESSION_ID_KEY,
                         ttl_field=SESSION_TTL_KEY, next_step_field=NEXT_STEP_KEY)


def baton_generate_request(request: vpb.GenerateRequest) -> pb.GenerateRequest:
    """The same request in ``baton.v1`` terms (the prompt, the sampling fields both have)."""
    params = request.sampling_params
    sampling = pb.SamplingParams(
        # the contract's unset temperature is vLLM's default, 1.0; Baton's 0 is greedy
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        stop=list(params.stop),
    )
    if params.top_p != 0.0:  # 0: unset (vLLM's servicer reads it as 1.0)
        sampling.top_p = params.top_p
    if params.HasField("max_tokens"):
        sampling.max_tokens = min(params.max_tokens, 2**31 - 1)
    if params.HasField("seed"):
        sampling.seed = params.seed
    if params.HasField("logprobs"):
        sampling.logprobs = params.logprobs
    # the knobs (``gateway.sampling_knobs``): the contract's 0 is unset, and so is a
    # repetition_penalty of 1.0 (vLLM's servicer reads both as no penalty)
    if params.top_k:
        sampling.top_k = min(params.top_k, 2**31 - 1)
    for name in ("min_p", "frequency_penalty", "presence_penalty"):
        if getattr(params, name):
            setattr(sampling, name, getattr(params, name))
    if params.repetition_penalty not in (0.0, 1.0):
        sampling.repetition_penalty = params.repetition_penalty
    if params.min_tokens:
        sampling.min_tokens = min(params.min_tokens, 2**31 - 1)
    sampling.logit_bias.update(params.logit_bias)
    constraint = params.WhichOneof("constraint")
    if constraint == "json_schema":
        sampling.json_schema = params.json_schema
    elif constraint == "json_object":
        sampling.json_object = params.json_object
    elif constraint == "regex":
        sampling.regex = params.regex
    elif constraint == "choice":
        sampling.choice.extend(params.choice.choices)
    built = pb.GenerateRequest(sampling=sampling, request_id=request.request_id)
    if request.WhichOneof("input") == "tokenized":
        built.token_ids.ids.extend(request.tokenized.input_ids)
    elif request.WhichOneof("input") == "text":
        built.text = request.text
    return built


def check_unsupported(request: vpb.GenerateRequest, limits: ModelLimits) -> None:
    """Refuse what Baton's engines do not do, unless the field holds its neutral value."""
    params = request.sampling_params
    kind = request.WhichOneof("input")
    if kind == "tokenized" and any(i >= 2**31 for i in request.tokenized.input_ids):
        raise InvalidRequest(f"tokenized.input_ids holds ids above 2^31; send ids below "
                             f"{limits.vocab_size} (the served model's vocabulary)")
    if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
        raise InvalidRequest("multimodal inputs (mm_inputs, extra_mm_inputs, media_refs): the "
                             f"served model '{limits.served_model_name}' takes text only")
    check_num_choices(params.n, "sampling_params.n")
    neutral = {
        "truncate_prompt_tokens": not params.HasField("truncate_prompt_tokens"),
        "include_stop_str_in_output": not params.include_stop_str_in_output,
    }
    refused = [name for name, ok in neutral.items() if not ok]
    if refused:
        raise InvalidRequest(
            f"sampling_params.{', sampling_params.'.join(refused)}: not supported by Baton's "
            "engines; leave them unset (Baton serves temperature, top_p, top_k, min_p, the "
            "frequency, presence and repetition penalties, min_tokens, logit_bias, max_tokens, "
            "seed, stop, stop_token_ids of the model's end-of-sequence tokens, ignore_eos, "
            f"logprobs, prompt_logprobs, n up to {MAX_CHOICES}, json_schema, json_object, regex "
            "and choice)")
    constraint = params.WhichOneof("constraint")
    if constraint in UNSUPPORTED_CONSTRAINTS:
        raise InvalidRequest(f"sampling_params.{constraint}: not supported; Baton enforces "
                             "json_schema, json_object, regex and choice")
    others = sorted(set(params.stop_token_ids) - set(limits.eos_token_ids))
    if others and not params.ignore_eos:
        raise InvalidRequest(
            f"sampling_params.stop_token_ids {others}: Baton's engines stop on the model's "
            f"end-of-sequence tokens {list(limits.eos_token_ids)} only; drop the others")
    if others:
        raise InvalidRequest("sampling_params.stop_token_ids with ignore_eos: not supported; "
                             "drop stop_token_ids or ignore_eos")
    if params.HasField("temperature") and not math.isfinite(params.temperature):
        raise InvalidRequest("sampling_params.temperature must be finite, got "
                             f"{params.temperature}")


def kv_transfer_params(request: vpb.GenerateRequest) -> dict:
    """``kv_transfer_params_json`` parsed: a JSON object, without a remote-prefill handoff
    (Baton disaggregates inside the cluster: put it behind SMG as one regular worker)."""
    if not request.HasField("kv_transfer_params_json") or not request.kv_transfer_params_json:
        return {}
    try:
        params = json.loads(request.kv_transfer_params_json)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"kv_transfer_params_json is not valid JSON ({e}); send a JSON "
                             "object or leave it unset") from e
    if not isinstance(params, dict):
        raise InvalidRequest("kv_transfer_params_json must be a JSON object, got "
                             f"{type(params).__name__}")
    handoff = [key for key in REMOTE_PREFILL_KEYS if params.get(key)]
    if handoff:
        raise InvalidRequest(
            f"kv_transfer_params_json asks for {', '.join(handoff)}: Baton hands KV from its "
            "prefill pool to its decode pool itself; route to it as one regular worker, not as "
            "the prefill or decode side of a PD pair")
    return params
