"""The OpenAI HTTP front's request checks: an OpenAI body to the ``EngineRequest`` workers run.

Mirrors ``gateway.validation.validate_and_build`` (the gRPC gateway's checks, reused one by
one), so both fronts accept and refuse the same requests. Contract: ``build_engine_request``
returns a request the router may place, or raises ``OpenAIError`` (400, or 404 for an unknown
model) whose ``param`` names the offending OpenAI field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from gateway.openai_errors import error_for
from gateway.openai_fields import refused_field
from gateway.openai_models import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.tokenization import CHAT_ROLES, PromptTokenizer
from gateway.validation import (
    DEFAULT_MAX_TOKENS,
    _check_cache_salt,
    _check_lengths,
    _check_request_id,
    _check_stop,
    _check_temperature,
    _check_top_p,
    check_json_schema,
    check_model,
    check_token_ids,
)
from protos.errors import InvalidRequest
from protos.wire import EngineRequest, SamplingOptions

T = TypeVar("T")

MAX_CHAT_TOP_LOGPROBS = 20
"""OpenAI's bound on chat ``top_logprobs`` (also vLLM's default ``max_logprobs``)."""
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's bound on the completions endpoint's ``logprobs``."""
SERVED_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the name, context window and vocabulary size."""

    name: str
    max_model_len: int
    vocab_size: int


def checked(param: str | None, check: Callable[..., T], *args: Any) -> T:
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


def _bounded(name: str, value: int, most: int) -> int:
    if isinstance(value, bool) or not 0 <= value <= most:
        raise InvalidRequest(f"{name} must be an integer from 0 to {most}, got {value!r}")
    return value


def num_logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many most likely tokens per position the body asks log-probabilities for, or None for
    no log-probabilities at all (``SamplingOptions.num_logprobs``). Chat: ``logprobs: true``
    and ``top_logprobs`` 0..20 (which needs ``logprobs: true`` unless 0); completions:
    ``logprobs`` 0..5. Raises ``OpenAIError`` naming the field."""
    if isinstance(body, CompletionRequest):
        if body.logprobs is None:
            return None
        return checked("logprobs", _bounded, "logprobs", body.logprobs, MAX_COMPLETION_LOGPROBS)
    top = body.top_logprobs
    if top is not None:
        checked("top_logprobs", _bounded, "top_logprobs", top, MAX_CHAT_TOP_LOGPROBS)
        if top and not body.logprobs:
            raise error_for(InvalidRequest(
                f"top_logprobs={top} needs logprobs: true; send both, or neither"), "top_logprobs")
    return (top or 0) if body.logprobs else None


def structured_output(response_format: dict | None) -> tuple[str, bool]:
    """``(json_schema, json_object)`` for ``SamplingOptions`` from OpenAI's ``response_format``:
    ``{"type": "text"}`` (or none), ``{"type": "json_object"}``, or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "description"?, "strict"?}}`` whose schema is a JSON object
    the structured-output backend can enforce (``check_json_schema``). The grammar is always
    enforced (``strict`` false is not looser). Raises ``InvalidRequest``."""
    if response_format is None:
        return "", False
    kind = response_format.get("type")
    if kind not in SERVED_FORMATS:
        raise InvalidRequest(f"response_format type {kind!r} is not served; use one of "
                             f"{', '.join(SERVED_FORMATS)}")
    allowed_keys = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra_keys = sorted(set(response_format) - allowed_keys)
    if extra_keys:
        raise InvalidRequest(f"response_format of type {kind!r} takes no {', '.join(extra_keys)}; "
                             "see OpenAI's response_format reference")
    if kind != "json_schema":
        return "", kind == "json_object"
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format.json_schema must be an object with a name and a "
                             "schema")
    extra_keys = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if extra_keys:
        raise InvalidRequest(f"response_format.json_schema has unknown keys {extra_keys}; it "
                             f"takes {', '.join(sorted(_JSON_SCHEMA_KEYS))}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidRequest("response_format.json_schema.name must be a non-empty string")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidRequest("response_format.json_schema.strict must be true or false")
    return check_json_schema(spec.get("schema"), "response_format.json_schema.schema"), False


def build_engine_request(
    body: ChatCompletionRequest | CompletionRequest,
    tokenizer: PromptTokenizer,
    served: ServedModel,
    request_id: str = "",
) -> EngineRequest:
    """Checks an OpenAI body like ``validate_and_build`` checks a ``GenerateRequest``.

    Cheap checks first, then tokenization. Raises ``OpenAIError`` whose ``param`` names the
    offending field, also for a field the front would otherwise ignore (``openai_fields``). ``cache_salt`` wins over ``tenant``; an unset temperature is OpenAI's 1.0
    and an unset max_tokens is ``DEFAULT_MAX_TOKENS``, lowered to fit the context window.
    """
    checked("model", check_model, body.model, served.name)
    refused = refused_field(body.model_extra)
    if refused is not None:
        raise refused
    if body.n != 1:
        raise error_for(
            InvalidRequest(
                f"n must be 1 (one choice per request), got {body.n}; "
                "send several requests for several completions"
            ),
            "n",
        )
    logprobs = num_logprobs(body)
    json_schema, json_object = checked("response_format", structured_output, body.response_format)
    temperature = 1.0 if body.temperature is None else body.temperature
    temperature = checked("temperature", _check_temperature, temperature)
    top_p = 1.0 if body.top_p is None else checked("top_p", _check_top_p, body.top_p)
    stop_strings = [body.stop] if isinstance(body.stop, str) else body.stop or []
    stop = checked("stop", _check_stop, stop_strings)
    salt_param, cache_salt = (
        ("cache_salt", body.cache_salt) if body.cache_salt is not None else ("tenant", body.tenant)
    )
    checked(salt_param, _check_cache_salt, cache_salt or "")
    request_id = checked("X-Request-Id", _check_request_id, request_id)

    if isinstance(body, ChatCompletionRequest):
        prompt_param = "messages"
        pairs = checked(prompt_param, _chat_pairs, body.messages)
        prompt_token_ids = checked(prompt_param, tokenizer.encode_chat, pairs)
    else:
        prompt_param = "prompt"
        prompt = checked(prompt_param, _single_prompt, body.prompt)
        prompt_token_ids = tokenizer.encode_text(prompt) if isinstance(prompt, str) else prompt
    if not prompt_token_ids:
        raise error_for(
            InvalidRequest("the prompt tokenizes to no tokens; send a longer prompt"), prompt_param
        )
    checked(prompt_param, check_token_ids, prompt_token_ids, served.vocab_size)
    max_tokens_param, max_tokens = (
        ("max_completion_tokens", body.max_completion_tokens)
        if body.max_completion_tokens is not None
        else ("max_tokens", body.max_tokens)
    )
    prompt_fits = len(prompt_token_ids) < served.max_model_len
    length_param = max_tokens_param if prompt_fits else prompt_param
    max_tokens = checked(
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
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=body.seed, stop=stop,
            ignore_eos=body.ignore_eos, num_logprobs=logprobs, json_schema=json_schema,
            json_object=json_object,
        ),
        cache_salt=cache_salt or "",
    )
