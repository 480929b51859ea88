"""Validation of client requests: wire messages in, an ``EngineRequest`` or a clear error out.

Pure functions over a parsed ``baton.v1`` request and the served model's limits; the only
mechanisms they touch are the tokenizer and, for a JSON Schema, vLLM's structured-output backend
(``gateway.json_schemas``). Every rejection raises ``InvalidRequest`` (or
``UnknownModel``) with a message that names the field, the offending value and what to change,
because the message is what the client sees as the INVALID_ARGUMENT details.

Cheap checks run before tokenization, so a malformed request costs no tokenizer time.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Union

from gateway import choices
from gateway.json_schemas import backend_refusal, regex_refusal
from gateway.salts import check_salt_offset
from gateway.sampling_knobs import GRPC_NAMES, checked_knobs
from gateway.tokenization import CHAT_ROLES, PromptTokenizer
from protos.baton.v1 import inference_pb2 as pb
from protos.errors import InvalidRequest, UnknownModel
from protos.wire import EngineRequest, SamplingOptions

DEFAULT_MAX_TOKENS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
MAX_LOGPROBS = 20
"""vLLM's default ``max_logprobs``: the most alternatives per position an engine returns."""
MAX_TEMPERATURE = 2.0
"""vLLM's sampler refuses a higher temperature (``SamplingParams``), as OpenAI's API does."""

PromptRequest = Union[pb.GenerateRequest, pb.TokenizeRequest]

_OPTIONAL_KNOBS = ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens")
"""``SamplingParams``' optional knob fields (``gateway.sampling_knobs``); ``logit_bias`` is a map."""


def validate_and_build(
    request: pb.GenerateRequest,
    tokenizer: PromptTokenizer,
    served_model_name: str,
    max_model_len: int,
    vocab_size: int,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    structured_backend: str = "auto",
) -> EngineRequest:
    """Check a ``GenerateRequest`` against the served model and turn it into an ``EngineRequest``.

    ``max_model_len`` is the context window in tokens (prompt plus generated tokens);
    ``vocab_size`` bounds client-given token ids to ``[0, vocab_size)``. An unset
    ``max_tokens`` becomes ``default_max_tokens``, lowered to what fits in the context window.
    A JSON schema is checked for the engines' ``structured_backend``. ``cache_salt_offset`` (the
    token offset from which the salt applies) must lie in the prompt and needs a ``cache_salt``.
    An empty ``request_id`` becomes a fresh uuid4 hex string.
    """
    check_model(request.model, served_model_name)
    check_prompt_shape(request)
    sampling = request.sampling
    temperature = _check_temperature(sampling.temperature)
    top_p = _check_top_p(sampling.top_p) if sampling.HasField("top_p") else 1.0
    stop = _check_stop(sampling.stop)
    num_logprobs = (
        check_bounded("sampling.logprobs", sampling.logprobs, MAX_LOGPROBS)
        if sampling.HasField("logprobs")
        else None
    )
    num_prompt_logprobs = (
        check_bounded("sampling.prompt_logprobs", sampling.prompt_logprobs, MAX_LOGPROBS)
        if sampling.HasField("prompt_logprobs")
        else None
    )
    constraint = _check_structured_output(sampling, structured_backend)
    request_id = _check_request_id(request.request_id)
    _check_cache_salt(request.cache_salt)

    prompt_token_ids = encode_prompt(request, tokenizer)
    check_token_ids(prompt_token_ids, vocab_size)
    max_tokens = _check_lengths(
        len(prompt_token_ids),
        sampling.max_tokens if sampling.HasField("max_tokens") else None,
        max_model_len,
        default_max_tokens,
    )
    cache_salt_offset = check_salt_offset(
        request.cache_salt_offset if request.HasField("cache_salt_offset") else None,
        request.cache_salt, len(prompt_token_ids))
    knobs = checked_knobs(
        max_tokens=max_tokens, vocab_size=vocab_size, names=GRPC_NAMES,
        **{name: getattr(sampling, name) for name in _OPTIONAL_KNOBS if sampling.HasField(name)},
        logit_bias=dict(sampling.logit_bias) if sampling.logit_bias else None)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt_token_ids),
        sampling=SamplingOptions(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=sampling.seed if sampling.HasField("seed") else None,
            stop=stop,
            num_logprobs=num_logprobs,
            num_prompt_logprobs=num_prompt_logprobs,
            **constraint,
            **knobs,
        ),
        cache_salt=request.cache_salt,
        cache_salt_offset=cache_salt_offset,
    )


def tokenize_prompt(
    request: PromptRequest, tokenizer: PromptTokenizer, served_model_name: str, vocab_size: int
) -> list[int]:
    """The prompt's token ids exactly as ``validate_and_build`` would produce them.

    Checks the model name and the prompt, not the context window: a client may tokenize a
    prompt to learn that it is too long.
    """
    check_model(request.model, served_model_name)
    check_prompt_shape(request)
    prompt_token_ids = encode_prompt(request, tokenizer)
    check_token_ids(prompt_token_ids, vocab_size)
    return prompt_token_ids


def check_model(model: str, served_model_name: str) -> None:
    """An empty name selects the served model; any other name must match it exactly."""
    if model and model != served_model_name:
        raise UnknownModel(
            f"model '{model}' is not served here; the served model is '{served_model_name}' "
            "(an empty model field also selects it)"
        )


def check_prompt_shape(request: PromptRequest) -> None:
    """Exactly one non-empty prompt kind; chat roles from ``CHAT_ROLES``."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("the request has no prompt; set one of text, token_ids or chat")
    if kind == "text" and not request.text:
        raise InvalidRequest("prompt text is empty; send at least one character")
    if kind == "token_ids" and not request.token_ids.ids:
        raise InvalidRequest("prompt token_ids is empty; send at least one token id")
    if kind == "chat":
        if not request.chat.messages:
            raise InvalidRequest("chat prompt has no messages; send at least one message")
        for index, message in enumerate(request.chat.messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequest(
                    f"chat message {index} has role '{message.role}'; "
                    f"use one of {', '.join(CHAT_ROLES)}"
                )
        last = request.chat.messages[-1]
        if request.chat.continue_final_message and (last.role != "assistant" or not last.content):
            raise InvalidRequest("continue_final_message needs the last chat message to be the "
                                 "assistant's answer so far, not empty")


def encode_prompt(request: PromptRequest, tokenizer: PromptTokenizer) -> list[int]:
    """Token ids of a prompt that passed ``check_prompt_shape``; token_ids are used as given."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        prompt_token_ids = tokenizer.encode_text(request.text)
    elif kind == "chat":
        prompt_token_ids = tokenizer.encode_chat(
            [(message.role, message.content) for message in request.chat.messages],
            request.chat.continue_final_message,
        )
    else:
        prompt_token_ids = list(request.token_ids.ids)
    if not prompt_token_ids:
        raise InvalidRequest("the prompt tokenizes to no tokens; send a longer prompt")
    return prompt_token_ids


def check_token_ids(prompt_token_ids: list[int], vocab_size: int) -> None:
    """Every id in ``[0, vocab_size)``; the error names the first one that is not."""
    for position, token_id in enumerate(prompt_token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"prompt token id {token_id} at position {position} is outside the "
                f"vocabulary [0, {vocab_size}); send ids the served model's tokenizer produces "
                "(the Tokenize RPC returns them)"
            )


MAX_TEMPLATE_KWARGS = 32
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "chat_template", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "kwargs"})
"""What a request's template variables may not set: the conversation and tools the front
renders, and ``apply_chat_template``'s own arguments."""


def check_template_kwargs(kwargs: object, field: str = "chat_template_kwargs") -> dict:
    """A request's extra chat-template variables (vLLM's ``chat_template_kwargs``): an object
    of at most ``MAX_TEMPLATE_KWARGS`` string keys, none of them reserved; its values as given
    (the template reads them; one it does not know is ignored, as in vLLM)."""
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"{field} must be an object of template variables, got "
                             f"{type(kwargs).__name__}")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(f"{field} has {len(kwargs)} variables; at most "
                             f"{MAX_TEMPLATE_KWARGS} are accepted")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequest(f"{field} may not set {', '.join(reserved)}: the front renders the "
                             "conversation and tools from the request's own fields")
    return kwargs


def check_num_choices(n: int, field: str = "sampling.n") -> int:
    """Choices a request asks for (``n``): 0 (unset) is 1, at most ``choices.MAX_CHOICES``."""
    if not 0 <= n <= choices.MAX_CHOICES:
        raise InvalidRequest(f"{field} must be from 1 to {choices.MAX_CHOICES} (answers to one "
                             f"prompt; 0 means 1), got {n}; send several requests for more")
    return max(1, n)


def check_bounded(name: str, value: int, most: int) -> int:
    """An integer count from 0 to ``most`` (a bool is no count)."""
    if isinstance(value, bool) or not 0 <= value <= most:
        raise InvalidRequest(f"{name} must be an integer from 0 to {most}, got {value!r}")
    return value


def check_json_schema(schema: object, field: str, backend: str = "auto") -> str:
    """``SamplingOptions.json_schema`` for ``schema`` (a parsed JSON value): its compact text.

    Both fronts call it: the schema must be a JSON object that the engines' structured-output
    ``backend`` can enforce (``gateway.json_schemas``), so an unsupported one is refused at the
    front, naming ``field``, rather than by the decode engine after placement.
    """
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field} must be a JSON Schema object, got {type(schema).__name__}")
    schema_text = json.dumps(schema, separators=(",", ":"))
    refusal = backend_refusal(schema_text, backend)
    if refusal is not None:
        raise InvalidRequest(
            f"{field} is a JSON Schema the structured-output backend cannot enforce: {refusal}; "
            "fix or drop the keywords it names"
        )
    return schema_text


MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


def check_regex(pattern: object, field: str, backend: str = "auto") -> str:
    """``SamplingOptions.regex``: a non-empty pattern of at most ``MAX_REGEX_CHARS`` the
    engines' structured-output ``backend`` can enforce (``gateway.json_schemas.regex_refusal``)."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequest(f"{field} must be a non-empty regular expression, got {pattern!r}")
    if len(pattern) > MAX_REGEX_CHARS:
        raise InvalidRequest(f"{field} is {len(pattern)} characters; at most {MAX_REGEX_CHARS} "
                             "are accepted")
    refusal = regex_refusal(pattern, backend)
    if refusal is not None:
        raise InvalidRequest(f"{field} is a regular expression the structured-output backend "
                             f"cannot enforce: {refusal}")
    return pattern


def check_choice(choice: object, field: str) -> tuple[str, ...]:
    """``SamplingOptions.choice``: 1 to ``MAX_CHOICES`` distinct non-empty strings of at most
    ``MAX_CHOICE_CHARS`` each (the output is exactly one of them)."""
    if not isinstance(choice, (list, tuple)) or not 1 <= len(choice) <= MAX_CHOICES:
        count = f"{len(choice)} options" if isinstance(choice, (list, tuple)) else \
            type(choice).__name__
        raise InvalidRequest(f"{field} must be a list of 1 to {MAX_CHOICES} strings, got "
                             f"{count}")
    for option in choice:
        if not isinstance(option, str) or not 0 < len(option) <= MAX_CHOICE_CHARS:
            shown = repr(option) if len(repr(option)) <= 40 else repr(option)[:37] + "..."
            raise InvalidRequest(f"{field} holds {shown}; each option must be a non-empty "
                                 f"string of at most {MAX_CHOICE_CHARS} characters")
    if len(set(choice)) < len(choice):
        raise InvalidRequest(f"{field} repeats an option; list each once")
    return tuple(choice)


def _check_structured_output(sampling: pb.SamplingParams, backend: str) -> dict:
    """``SamplingOptions``' constraint fields (``json_schema``, ``json_object``, ``regex``,
    ``choice``); at most one of them set."""
    named = [name for name, on in (
        ("json_schema", bool(sampling.json_schema)), ("json_object", sampling.json_object),
        ("regex", bool(sampling.regex)), ("choice", bool(sampling.choice))) if on]
    if len(named) > 1:
        raise InvalidRequest(
            f"sampling.{' and sampling.'.join(named)} are exclusive; set json_schema for output "
            "that satisfies a schema, json_object for any JSON object, regex for output that "
            "matches a pattern or choice for one of a list of strings: one of them"
        )
    if sampling.regex:
        return {"regex": check_regex(sampling.regex, "sampling.regex", backend)}
    if sampling.choice:
        return {"choice": check_choice(list(sampling.choice), "sampling.choice")}
    if not sampling.json_schema:
        return {"json_object": sampling.json_object}
    try:
        schema = json.loads(sampling.json_schema)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise InvalidRequest(
            f"sampling.json_schema is not valid JSON ({e}); send the JSON text of a JSON Schema "
            "object"
        ) from e
    return {"json_schema": check_json_schema(schema, "sampling.json_schema", backend)}


def _check_lengths(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, default_max_tokens: int
) -> int:
    """The number of tokens to generate, checked against the context window."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest(
            f"prompt is {num_prompt_tokens} tokens but the context window (max_model_len) is "
            f"{max_model_len} tokens; shorten the prompt to at most {max_model_len - 1} tokens "
            "to leave room for one generated token"
        )
    num_fitting_tokens = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return min(default_max_tokens, num_fitting_tokens)
    if max_tokens <= 0:
        raise InvalidRequest(
            f"sampling.max_tokens must be positive, got {max_tokens}; "
            f"leave it unset for the default ({default_max_tokens})"
        )
    if max_tokens > num_fitting_tokens:
        raise InvalidRequest(
            f"prompt ({num_prompt_tokens} tokens) plus sampling.max_tokens ({max_tokens}) "
            f"exceeds the context window of {max_model_len} tokens; at most "
            f"{num_fitting_tokens} new tokens fit, so set max_tokens to {num_fitting_tokens} "
            "or less, or shorten the prompt"
        )
    return max_tokens


def _check_temperature(temperature: float) -> float:
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(
            f"sampling.temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        )
    if temperature > MAX_TEMPERATURE:
        raise InvalidRequest(
            f"sampling.temperature must be at most {MAX_TEMPERATURE:g} (the engines' sampler "
            f"refuses more), got {temperature}"
        )
    return float(temperature)


def _check_top_p(top_p: float) -> float:
    if not 0 < top_p <= 1:  # also rejects NaN
        raise InvalidRequest(
            f"sampling.top_p must be in (0, 1], got {top_p}; leave it unset for 1.0"
        )
    return float(top_p)


def _check_stop(stop: list[str]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"sampling.stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    for index, text in enumerate(stop):
        if not text:
            raise InvalidRequest(f"sampling.stop[{index}] is empty; remove it")
        if len(text) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"sampling.stop[{index}] is {len(text)} characters; "
                f"at most {MAX_STOP_CHARS} are allowed"
            )
    return tuple(stop)


def _check_request_id(request_id: str) -> str:
    """The caller's id if acceptable; a fresh uuid4 hex string if empty."""
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are "
            "allowed (leave it empty and Baton generates one)"
        )
    if not request_id.isprintable():
        raise InvalidRequest(
            "request_id contains non-printable characters; use printable characters only "
            "(leave it empty and Baton generates one)"
        )
    return request_id


def _check_cache_salt(cache_salt: str) -> None:
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(
            f"cache_salt is {len(cache_salt)} characters; "
            f"at most {MAX_CACHE_SALT_CHARS} are allowed"
        )
