"""The OpenAI HTTP front's request checks: an OpenAI body to the ``EngineRequest`` workers run.

Mirrors ``gateway.validation.validate_and_build`` (the gRPC gateway's checks, reused one by
one), so both fronts accept and refuse the same requests. Contract: ``build_engine_request``
returns a request the router may place, or raises ``OpenAIError`` (400, or 404 for an unknown
model) whose ``param`` names the offending OpenAI field. The checks the Anthropic front
(``gateway.anthropic_requests``) shares with it are here too: ``checked_options`` (sampling knobs,
cache salt, request id), ``chat_prompt`` (a conversation and its tools to token ids) and
``checked_length`` (the prompt and ``max_tokens`` against the context window).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence, TypeVar

from gateway.choices import MAX_CHOICES
from gateway.openai_errors import error_for, lone_surrogate
from gateway.openai_fields import refused_field
from gateway.openai_models import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.salts import http_salt_offset, message_salt_offset
from gateway.sampling_knobs import checked_knobs
from gateway.sessions import InvalidField
from gateway.tokenization import CHAT_ROLES, PromptTokenizer
from gateway.tool_calls import (
    ChoiceMode,
    ToolCall,
    ToolPlan,
    Turn,
    checked_arguments,
    checked_plan,
    checked_tool,
    new_call_id,
    render,
)
from gateway.validation import (
    DEFAULT_MAX_TOKENS,
    _check_cache_salt,
    _check_lengths,
    _check_request_id,
    _check_stop,
    _check_temperature,
    _check_top_p,
    check_choice,
    check_json_schema,
    check_model,
    check_regex,
    check_template_kwargs,
    check_token_ids,
)
from protos.errors import InvalidRequest
from protos.wire import EngineRequest, PositionLogprobs, SamplingOptions

T = TypeVar("T")

MAX_CHAT_TOP_LOGPROBS = 20
"""OpenAI's bound on chat ``top_logprobs`` (also vLLM's default ``max_logprobs``)."""
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's bound on the completions endpoint's ``logprobs``."""
REQUEST_ID_HEADER = "x-request-id"
"""The header that plays the gRPC ``request_id`` field's part on both HTTP fronts."""
SERVED_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the name, context window and vocabulary size, and the
    format the model calls tools in (``gateway.tool_parsers.PARSERS``)."""

    name: str
    max_model_len: int
    vocab_size: int
    tool_call_parser: str = "hermes"
    structured_backend: str = "auto"
    """The engines' structured-output backend (``gateway.json_schemas``)."""


@dataclass(frozen=True)
class Echo:
    """The prompt a completion with ``echo`` answers with before its own text: its text (a
    token-id prompt decoded) and its first token's text, which has no log-probability."""

    text: str
    first_token: str
    prompt_only: bool = False
    """``max_tokens`` 0: the answer is the prompt alone (the engine computes it and one token,
    which the front drops: ``finish_reason`` "length", no completion tokens), as vLLM's server
    answers; what a client scoring a text by its log-probabilities sends."""

    def first(self, text: str, positions: Sequence[PositionLogprobs],
              prompt_positions: Sequence[PositionLogprobs]
              ) -> tuple[str, tuple[PositionLogprobs, ...], str]:
        """The answer's first text and log-probability positions with the prompt before them
        (``prompt_positions``: the prompt's from its second token), and the prompt's first
        token, which has none; the generated ``text`` and ``positions`` dropped when the answer
        is the prompt alone."""
        if self.prompt_only:
            text, positions = "", ()
        return self.text + text, (*prompt_positions, *positions), self.first_token


@dataclass(frozen=True)
class Prepared:
    """A checked request: what the workers run, and what the front does with the output."""

    engine: EngineRequest
    tools: ToolPlan | None = None
    turns: tuple[Turn, ...] = ()
    """A chat prompt's conversation as it was rendered (``gateway.cache_control`` cuts it)."""
    echo: Echo | None = None
    """A completion with ``echo``: the prompt its answer starts with (None: no echo)."""


def checked(param: str | None, check: Callable[..., T], *args: Any) -> T:
    """Runs one of ``gateway.validation``'s checks, naming the offending OpenAI field."""
    try:
        return check(*args)
    except InvalidRequest as e:
        raise error_for(e, param) from e


@dataclass(frozen=True)
class Options:
    """What both HTTP fronts check alike, checked: sampling knobs and the request's identity."""

    temperature: float
    top_p: float
    stop: tuple[str, ...]
    cache_salt: str
    request_id: str
    cache_salt_offset: int = 0
    """The token offset from which ``cache_salt`` applies (``gateway.salts``), once the prompt
    is tokenized."""

    def engine_request(self, prompt_token_ids: list[int], max_tokens: int, *,
                       seed: int | None = None, ignore_eos: bool = False,
                       num_logprobs: int | None = None, json_schema: str = "",
                       json_object: bool = False, knobs: dict | None = None,
                       num_prompt_logprobs: int | None = None) -> EngineRequest:
        """``knobs``: ``gateway.sampling_knobs.checked_knobs``'s fields (top_k, penalties, ...)."""
        return EngineRequest(
            request_id=self.request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=SamplingOptions(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=seed,
                stop=self.stop, ignore_eos=ignore_eos, num_logprobs=num_logprobs,
                json_schema=json_schema, json_object=json_object, **(knobs or {}),
                num_prompt_logprobs=num_prompt_logprobs,
            ),
            cache_salt=self.cache_salt,
            cache_salt_offset=self.cache_salt_offset,
        )


def checked_options(temperature: float | None, top_p: float | None, stop_param: str,
                    stop_strings: list[str], cache_salt: str | None, tenant: str | None,
                    request_id: str) -> Options:
    """The fields both fronts share, checked by ``gateway.validation``; ``OpenAIError`` naming
    the field. Unset temperature and top_p are 1.0; ``cache_salt`` wins over ``tenant`` (Baton's
    extension fields); an empty request id becomes a fresh one."""
    temperature = checked("temperature", _check_temperature,
                          1.0 if temperature is None else temperature)
    top_p = 1.0 if top_p is None else checked("top_p", _check_top_p, top_p)
    stop = checked(stop_param, _check_stop, stop_strings)
    salt_param, salt = ("cache_salt", cache_salt) if cache_salt is not None else ("tenant", tenant)
    checked(salt_param, _check_cache_salt, salt or "")
    request_id = checked("X-Request-Id", _check_request_id, request_id)
    return Options(temperature, top_p, stop, salt or "", request_id)


def with_salt_offset(options: Options, offset: int | None, from_message: int | None,
                     prompt_token_ids: list[int], num_messages: int,
                     offset_of_message: Callable[[int], int]) -> Options:
    """``options`` with the body's salt offset (``gateway.salts.http_salt_offset``: a token
    offset, or the offset of a message); ``OpenAIError`` naming the field."""
    return replace(options, cache_salt_offset=http_salt_offset(
        offset, from_message, options.cache_salt, len(prompt_token_ids), num_messages,
        offset_of_message))


def _chat_salt_offset(body: ChatCompletionRequest | CompletionRequest, plan: ToolPlan | None,
                      tokenizer: PromptTokenizer, prompt_token_ids: list[int]
                      ) -> Callable[[int], int]:
    """Where message ``index`` of a chat body starts in its prompt (an OpenAI message is one
    turn)."""
    def offset_of(index: int) -> int:
        turns = _chat_turns(body.messages)
        return message_salt_offset(turns, index, plan, tokenizer, prompt_token_ids)
    return offset_of


def chat_prompt(turns: list[Turn], plan: ToolPlan | None, tokenizer: PromptTokenizer,
                param: str, template_kwargs: dict | None = None, *,
                generation_prompt: bool = True, continue_final: bool = False) -> list[int]:
    """The token ids of a conversation and its tools (``gateway.tool_calls.render``) under the
    model's chat template, with the request's ``template_kwargs``, ending in the assistant's
    turn header (``generation_prompt``) or, with ``continue_final``, in the last turn left open
    (an assistant prefill, checked by ``checked_prefill``); ``OpenAIError`` naming ``param`` when
    the template refuses it. (Cache breakpoints and salt offsets are measured on prefixes
    rendered without the variables: as common prefixes with this prompt, they come out shorter,
    never longer, where the variables change an early part of it.)"""
    if continue_final:
        checked_prefill(turns, plan, param)
    rendered = render(turns, plan, tokenizer.renders_tools)
    return checked(param, tokenizer.encode_conversation, rendered.messages, rendered.tools,
                   generation_prompt and not continue_final, template_kwargs, continue_final)


def checked_prefill(turns: list[Turn], plan: ToolPlan | None, param: str) -> None:
    """A conversation whose last turn the model continues: an assistant turn of text (the
    answer so far), with no forced tool call to make instead; ``OpenAIError`` naming
    ``param``."""
    last = turns[-1] if turns else None
    reason = ""
    if last is None or last.role != "assistant":
        reason = ("continuing the final message needs the last message to be the assistant's "
                  "answer so far")
    elif last.tool_calls:
        reason = "the answer to continue carries tool calls; a prefilled answer is text only"
    elif not last.content:
        reason = ("the answer to continue is empty; send its beginning, or end with a user "
                  "message")
    elif plan is not None and plan.mode in ("required", "named"):
        reason = "a prefilled answer cannot also be a forced tool call (tool_choice)"
    if reason:
        raise error_for(InvalidRequest(reason), param)


def forced_constraint(plan: ToolPlan | None, served: ServedModel, schemas_field: str) -> str:
    """The grammar a forced call is decoded under (``ToolPlan.constraint``; '' when the model
    chooses freely), checked for the engines' structured-output backend; ``OpenAIError`` naming
    ``tools`` (the schemas come from ``schemas_field``) when it cannot enforce it."""
    forced = plan.constraint() if plan is not None else ""
    if not forced:
        return ""
    return checked("tools", check_json_schema, json.loads(forced),
                   f"the forced call's schema (from {schemas_field})", served.structured_backend)


def checked_length(prompt_token_ids: list[int], prompt_param: str, max_tokens: int | None,
                   max_tokens_param: str, served: ServedModel) -> int:
    """How many tokens to generate: the prompt must be non-empty, in the vocabulary and leave
    room in the context window; an unset ``max_tokens`` is ``DEFAULT_MAX_TOKENS``, lowered to
    fit. ``OpenAIError`` naming the prompt's field, or ``max_tokens_param`` when the prompt
    fits but the two together do not."""
    if not prompt_token_ids:
        raise error_for(
            InvalidRequest("the prompt tokenizes to no tokens; send a longer prompt"), prompt_param
        )
    checked(prompt_param, check_token_ids, prompt_token_ids, served.vocab_size)
    prompt_fits = len(prompt_token_ids) < served.max_model_len
    return checked(
        max_tokens_param if prompt_fits else prompt_param,
        _check_lengths,
        len(prompt_token_ids),
        max_tokens,
        served.max_model_len,
        DEFAULT_MAX_TOKENS,
    )


def _chat_turns(messages: list[ChatMessage]) -> list[Turn]:
    if not messages:
        raise InvalidRequest("messages is empty; send at least one message")
    turns = []
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{index}] has role '{message.role}'; use one of {', '.join(CHAT_ROLES)}"
            )
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequest(f"messages[{index}]: only assistant messages carry tool_calls")
        calls = tuple(
            ToolCall(call.id or new_call_id(), call.function.name, checked_arguments(
                call.function.arguments, f"messages[{index}].tool_calls[{number}].function"))
            for number, call in enumerate(message.tool_calls or ())
        )
        turns.append(Turn(message.role, message.text(), calls, message.tool_call_id or ""))
    return turns


def _choice(tool_choice: str | dict | None, has_tools: bool) -> tuple[ChoiceMode, str]:
    """(mode, function name) of OpenAI's ``tool_choice``."""
    if tool_choice is None:
        return ("auto" if has_tools else "none"), ""
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, ""
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
            and isinstance(function, dict) and isinstance(function.get("name"), str)):
        return "named", function["name"]
    raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or "
                         f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                         f"got {tool_choice!r}")


def tool_plan(body: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None without tools); ``OpenAIError`` naming the field."""
    tools = [checked("tools", checked_tool, spec.function.name, spec.function.description,
                     spec.function.parameters, f"tools[{index}].function")
             for index, spec in enumerate(body.tools or ())]
    mode, named = checked("tool_choice", _choice, body.tool_choice, bool(tools))
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    param = "tool_choice" if mode in ("required", "named") else "tools"
    return checked(param, checked_plan, tools, mode, named, parallel, parser)


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


def structured_output(response_format: dict | None, backend: str = "auto",
                      spec_field: str = "response_format.json_schema") -> tuple[str, bool]:
    """``(json_schema, json_object)`` for ``SamplingOptions`` from OpenAI's ``response_format``:
    ``{"type": "text"}`` (or none), ``{"type": "json_object"}``, or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "description"?, "strict"?}}`` whose schema is a JSON object
    the structured-output backend can enforce (``check_json_schema``). The grammar is always
    enforced (``strict`` false is not looser). Messages name the schema's fields under
    ``spec_field`` (the Responses route's is ``text.format``). Raises ``InvalidRequest``."""
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
        raise InvalidRequest(f"{spec_field}.name must be a non-empty string")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidRequest(f"{spec_field}.strict must be true or false")
    return check_json_schema(spec.get("schema"), f"{spec_field}.schema", backend), False


EXTENSION_CONSTRAINTS = ("json", "regex", "choice")
"""The keys of vLLM's ``structured_outputs`` extension Baton serves (one per request)."""


def extension_constraint(spec: object, backend: str = "auto") -> dict:
    """``SamplingOptions``' constraint field for vLLM's ``structured_outputs`` extension:
    exactly one of ``json`` (a JSON Schema, as an object or its JSON text), ``regex`` or
    ``choice`` (a list of strings); any other key (``grammar``, ``structural_tag``, ...) is
    refused by name. Raises ``InvalidRequest``."""
    if not isinstance(spec, dict):
        raise InvalidRequest("structured_outputs must be an object with one of "
                             f"{', '.join(EXTENSION_CONSTRAINTS)}")
    given = {key: value for key, value in spec.items() if value is not None}
    unserved = sorted(set(given) - set(EXTENSION_CONSTRAINTS))
    if unserved:
        raise InvalidRequest(f"structured_outputs.{unserved[0]} is not served; Baton enforces "
                             f"{', '.join(EXTENSION_CONSTRAINTS)} (or response_format)")
    if len(given) != 1:
        raise InvalidRequest("structured_outputs must set exactly one of "
                             f"{', '.join(EXTENSION_CONSTRAINTS)}, got {sorted(given) or 'none'}")
    [(key, value)] = given.items()
    if key == "regex":
        return {"regex": check_regex(value, "structured_outputs.regex", backend)}
    if key == "choice":
        return {"choice": check_choice(value, "structured_outputs.choice")}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise InvalidRequest(f"structured_outputs.json is not valid JSON ({e}); send a JSON "
                                 "Schema object or its JSON text") from e
    return {"json_schema": check_json_schema(value, "structured_outputs.json", backend)}


def rendered_chat(body: ChatCompletionRequest, plan: ToolPlan | None,
                  tokenizer: PromptTokenizer) -> tuple[list[int], list[Turn]]:
    """A chat body's prompt token ids and conversation: its messages and ``plan``'s tools under
    the chat template, with its ``chat_template_kwargs``, ``add_generation_prompt`` and
    ``continue_final_message`` (both true is 400, as vLLM answers); ``OpenAIError`` naming the
    field."""
    turns = checked("messages", _chat_turns, body.messages)
    template_kwargs = (None if body.chat_template_kwargs is None else checked(
        "chat_template_kwargs", check_template_kwargs, body.chat_template_kwargs))
    if body.continue_final_message and body.add_generation_prompt:
        raise error_for(InvalidRequest(
            "continue_final_message and add_generation_prompt are both true: a prompt either "
            "continues the last message or opens a new answer; send add_generation_prompt: "
            "false with continue_final_message: true"), "continue_final_message")
    prompt_token_ids = chat_prompt(turns, plan, tokenizer, "messages", template_kwargs,
                                   generation_prompt=body.add_generation_prompt,
                                   continue_final=body.continue_final_message)
    return prompt_token_ids, turns


def build_engine_request(
    body: ChatCompletionRequest | CompletionRequest,
    tokenizer: PromptTokenizer,
    served: ServedModel,
    request_id: str = "",
) -> EngineRequest:
    """What ``prepare`` makes of the body, for the workers."""
    return prepare(body, tokenizer, served, request_id).engine


def prepare(
    body: ChatCompletionRequest | CompletionRequest,
    tokenizer: PromptTokenizer,
    served: ServedModel,
    request_id: str = "",
) -> Prepared:
    """Checks an OpenAI body like ``validate_and_build`` checks a ``GenerateRequest``.

    Cheap checks first, then tokenization. Raises ``OpenAIError`` whose ``param`` names the
    offending field, also for a field the front would otherwise ignore (``openai_fields``).
    ``cache_salt`` wins over ``tenant``; an unset temperature is OpenAI's 1.0 and an unset
    max_tokens is ``DEFAULT_MAX_TOKENS``, lowered to fit the context window. Tools are rendered
    into the prompt and a forced call becomes the output's grammar (``gateway.tool_calls``).
    """
    refused = lone_surrogate(body.model_dump())
    if refused is not None:
        raise refused
    checked("model", check_model, body.model, served.name)
    refused = refused_field(body.model_extra)
    if refused is not None:
        raise refused
    if isinstance(body.n, bool) or not 1 <= body.n <= MAX_CHOICES:
        raise error_for(InvalidRequest(
            f"n must be from 1 to {MAX_CHOICES} (choices per request), got {body.n!r}; send "
            "several requests for more"), "n")
    logprobs = num_logprobs(body)
    json_schema, json_object = checked("response_format", structured_output, body.response_format,
                                       served.structured_backend)
    extension = ({} if body.structured_outputs is None else checked(
        "structured_outputs", extension_constraint, body.structured_outputs,
        served.structured_backend))
    if extension and (json_schema or json_object):
        raise error_for(InvalidRequest(
            "response_format and structured_outputs both fix the output's shape; send one of "
            "them"), "structured_outputs")
    json_schema = extension.pop("json_schema", json_schema)
    stop_strings = [body.stop] if isinstance(body.stop, str) else body.stop or []
    options = checked_options(body.temperature, body.top_p, "stop", stop_strings,
                              body.cache_salt, body.tenant, request_id)

    plan = None
    prepared_turns: tuple[Turn, ...] = ()
    if isinstance(body, ChatCompletionRequest):
        prompt_param = "messages"
        plan = tool_plan(body, served.tool_call_parser)
        forced = forced_constraint(plan, served, "tools[].function.parameters")
        if forced and (json_schema or json_object or extension):
            field = "structured_outputs" if body.structured_outputs is not None else \
                "response_format"
            raise error_for(InvalidRequest(
                f"{field} and tool_choice {body.tool_choice!r} both fix the output's "
                "shape; send one of them"), field)
        json_schema = forced or json_schema
        prompt_token_ids, turns = rendered_chat(body, plan, tokenizer)
        prepared_turns = tuple(turns)
    else:
        prompt_param = "prompt"
        prompt = checked(prompt_param, _single_prompt, body.prompt)
        prompt_token_ids = tokenizer.encode_text(prompt) if isinstance(prompt, str) else prompt
    max_tokens_param, max_tokens = (
        ("max_completion_tokens", body.max_completion_tokens)
        if body.max_completion_tokens is not None
        else ("max_tokens", body.max_tokens)
    )
    prompt_only = isinstance(body, CompletionRequest) and body.echo and max_tokens == 0
    if prompt_only:  # the engine computes the prompt and one token, dropped at the front
        max_tokens = 1
    max_tokens = checked_length(prompt_token_ids, prompt_param, max_tokens, max_tokens_param,
                                served)
    try:
        knobs = extension | checked_knobs(
            max_tokens=max_tokens, vocab_size=served.vocab_size, top_k=body.top_k,
            min_p=body.min_p, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            min_tokens=body.min_tokens, logit_bias=body.logit_bias)
    except InvalidField as e:
        raise error_for(e, e.field) from e
    options = with_salt_offset(options, body.cache_salt_offset,
                               getattr(body, "cache_salt_from_message", None), prompt_token_ids,
                               len(getattr(body, "messages", ())),
                               _chat_salt_offset(body, plan, tokenizer, prompt_token_ids))
    echo = None
    if isinstance(body, CompletionRequest) and body.echo:
        echo = Echo(prompt if isinstance(prompt, str) else tokenizer.decode(prompt_token_ids),
                    tokenizer.decode(prompt_token_ids[:1]), prompt_only)
    return Prepared(options.engine_request(
        prompt_token_ids, max_tokens, seed=body.seed, ignore_eos=body.ignore_eos,
        num_logprobs=logprobs, json_schema=json_schema, json_object=json_object, knobs=knobs,
        # echoed with log-probabilities: the prompt's too, as many alternatives as the answer's
        num_prompt_logprobs=logprobs if echo is not None else None,
    ), plan, prepared_turns, echo)
