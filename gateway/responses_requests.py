"""The Responses route's request checks: a ``/v1/responses`` body to the ``EngineRequest``
workers run, with the chat route's checks (shared from ``gateway.openai_requests``), so the two
accept and refuse the same conversations, tools and formats.

Mapping onto the front-neutral conversation (``gateway.tool_calls``):

* ``instructions`` is the first, system turn; ``input`` as a string is one user turn;
* a ``message`` item (``type`` ``message`` or unset) is a turn of its role (``developer`` is a
  system turn); its text parts are concatenated, as OpenAI's content parts are;
* ``function_call`` items (an earlier answer's calls, replayed) join the assistant turn before
  them, or open one; a ``function_call_output`` item is a tool turn answering its ``call_id``;
* ``tools`` are the functions (only ``function`` tools: the client runs them);
  ``tool_choice`` ``none``/``auto``/``required``/``{type: function, name}`` are the plan's
  none/auto/required/named, ``parallel_tool_calls`` false its ``parallel=False``;
* ``text.format`` is the chat route's ``response_format`` (``text``, ``json_object``,
  ``json_schema`` with ``name`` and ``schema``); ``max_output_tokens`` its ``max_tokens``.

Contract: ``prepare_response`` returns a ``Prepared`` the router may place, or raises
``OpenAIError`` naming the offending field. Responses are not stored: ``store: true``,
``previous_response_id``, ``item_reference`` items and the other stateful or hosted features
are refused by name with what to send instead, as is any top-level field Baton does not know;
nothing a client asks for is silently ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from gateway.openai_errors import error_for, lone_surrogate, validation_message
from gateway.openai_fields import refused_field
from gateway.openai_requests import (
    Prepared,
    ServedModel,
    chat_prompt,
    checked,
    checked_length,
    checked_options,
    forced_constraint,
    structured_output,
)
from gateway.responses_models import (
    FunctionCallItem,
    FunctionCallOutput,
    FunctionTool,
    InputMessage,
    ResponsesRequest,
)
from gateway.sampling_knobs import checked_knobs
from gateway.sessions import InvalidField
from gateway.tokenization import PromptTokenizer
from gateway.tool_calls import (
    ChoiceMode,
    ToolCall,
    ToolPlan,
    Turn,
    checked_arguments,
    checked_plan,
    checked_tool,
)
from gateway.validation import check_model
from protos.errors import InvalidRequest

FIELDS_REFERENCE = "Baton's docs/operating.md (OpenAI Responses API)"
_NOT_STORED = ("responses are not stored on this server; send the whole conversation as input "
               "(earlier answers' output items included)")

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,),
    "conversation": (None,),
    "prompt": (None,),
    "include": (None, ()),
    "reasoning": (None, {}, {"effort": None}, {"effort": None, "summary": None}),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "service_tier": (None, "auto", "default"),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "stream_options": (None, {}, {"include_obfuscation": False}),
}
"""Top-level fields the route does not act on, with the values that ask for nothing."""

NOT_SERVED_HINT: dict[str, str] = {
    "previous_response_id": _NOT_STORED,
    "conversation": _NOT_STORED,
    "prompt": "stored prompt templates are not served; send the instructions and input",
    "include": "no extra output data is served (no reasoning, logprobs or tool sources); send "
               "include: []",
    "reasoning": "reasoning settings are not served (the served model does not reason)",
    "truncation": "automatic truncation is not served; send truncation: 'disabled' and an input "
                  "that fits the context window",
    "background": "background responses are not served; stream instead",
    "service_tier": "service tiers are not served; only 'auto' or 'default' is accepted",
    "max_tool_calls": "max_tool_calls is not served (there are no hosted tools); limit the calls "
                      "on the client",
    "top_logprobs": "log-probabilities are served on /v1/chat/completions (logprobs, "
                    "top_logprobs), not here",
    "stream_options": "stream obfuscation is not served; send include_obfuscation: false",
}

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
"""A message item's role → the conversation's."""
ITEM_HINTS = {
    "reasoning": "reasoning items are not served (the served model does not reason); leave them "
                 "out of input",
    "item_reference": "item references are not served: " + _NOT_STORED,
}
NON_TEXT_PARTS = ("input_image", "input_file", "input_audio", "refusal")


def _parsed(model: type[BaseModel], raw: Any, where: str) -> Any:
    """``raw`` as ``model``; ``InvalidRequest`` naming ``where`` and the wrong field."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        message, _param = validation_message(e, FIELDS_REFERENCE)
        raise InvalidRequest(f"{where}: {message}") from e


def _check_parts(content: Any, where: str) -> None:
    for number, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NON_TEXT_PARTS:
            raise InvalidRequest(f"{where}.content[{number}]: {kind} parts are not served; only "
                                 "text (input_text, output_text) is")


def _item_turns(items: list[dict]) -> list[Turn]:
    """The turns of ``input``'s items (module docstring); ``InvalidRequest`` naming the item."""
    turns: list[Turn] = []
    calls_open = False  # the last turn is an assistant turn later function_call items join
    for index, raw in enumerate(items):
        where = f"input[{index}]"
        kind = raw.get("type", "message")
        if kind == "message":
            _check_parts(raw.get("content"), where)
            message = _parsed(InputMessage, raw, where)
            turns.append(Turn(ROLES[message.role], message.text()))
            calls_open = message.role == "assistant"
        elif kind == "function_call":
            item = _parsed(FunctionCallItem, raw, where)
            call = ToolCall(item.call_id, item.name,
                            checked_arguments(item.arguments, f"{where}.arguments"))
            if calls_open:
                last = turns[-1]
                turns[-1] = Turn(last.role, last.content, (*last.tool_calls, call))
            else:
                turns.append(Turn("assistant", "", (call,)))
                calls_open = True
        elif kind == "function_call_output":
            _check_parts(raw.get("output"), where)
            output = _parsed(FunctionCallOutput, raw, where)
            turns.append(Turn("tool", output.text(), tool_call_id=output.call_id))
            calls_open = False
        else:
            hint = ITEM_HINTS.get(kind, "send message, function_call and function_call_output "
                                        "items")
            raise InvalidRequest(f"{where}: items of type {kind!r} are not served; {hint}")
    return turns


def conversation(instructions: str | None, items: str | list[dict]) -> list[Turn]:
    """The front-neutral turns of ``instructions`` and ``input`` (module docstring)."""
    turns = [Turn("system", instructions)] if instructions else []
    if isinstance(items, str):
        return turns + [Turn("user", items)]
    if not items:
        raise InvalidRequest("input is empty; send a string or at least one item")
    return turns + _item_turns(items)


def _function_tool(raw: Any, index: int) -> FunctionTool:
    where = f"tools[{index}]"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind != "function":
        raise InvalidRequest(f"{where}: tools of type {kind!r} are not served; only function "
                             "tools (which the client runs) are")
    return _parsed(FunctionTool, raw, where)


def _choice(tool_choice: str | dict | None, has_tools: bool) -> tuple[ChoiceMode, str]:
    """(mode, function name) of the Responses API's ``tool_choice``."""
    if tool_choice is None:
        return ("auto" if has_tools else "none"), ""
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, ""
    if (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
            and set(tool_choice) == {"type", "name"} and isinstance(tool_choice["name"], str)):
        return "named", tool_choice["name"]
    raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {\"type\": "
                         f"\"function\", \"name\": ...}}, got {tool_choice!r}")


def tool_plan(body: ResponsesRequest, parser: str) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None without tools); ``OpenAIError`` naming the field."""
    specs = [checked("tools", _function_tool, raw, index)
             for index, raw in enumerate(body.tools or ())]
    tools = [checked("tools", checked_tool, spec.name, spec.description, spec.parameters,
                     f"tools[{index}]") for index, spec in enumerate(specs)]
    mode, named = checked("tool_choice", _choice, body.tool_choice, bool(tools))
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    param = "tool_choice" if mode in ("required", "named") else "tools"
    return checked(param, checked_plan, tools, mode, named, parallel, parser)


def response_format(body: ResponsesRequest) -> dict | None:
    """``text.format`` in the chat route's ``response_format`` spelling (None: plain text)."""
    spec = body.text.format if body.text is not None else None
    if spec is None:
        return None
    if spec.type != "json_schema":
        return {"type": spec.type}
    fields = {"name": spec.name, "schema": spec.schema_, "description": spec.description,
              "strict": spec.strict}
    return {"type": "json_schema",
            "json_schema": {key: value for key, value in fields.items() if value is not None}}


def _refuse_fields(body: ResponsesRequest) -> None:
    refused = lone_surrogate(body.model_dump(by_alias=True))
    if refused is None:
        refused = refused_field(body.model_extra, NEUTRAL, NOT_SERVED_HINT)
    if refused is not None:
        raise refused
    if body.store:
        raise error_for(InvalidRequest(f"store=True is not supported by this server: "
                                       f"{_NOT_STORED}; send store: false, or leave it out"),
                        "store")


def count_input_tokens(body: ResponsesRequest, tokenizer: PromptTokenizer,
                       served: ServedModel) -> int:
    """The prompt's length in tokens as ``/v1/responses`` would render it, tools included
    (``POST /v1/responses/input_tokens``); the same checks of the fields it reads."""
    checked("model", check_model, body.model, served.name)
    _refuse_fields(body)
    plan = tool_plan(body, served.tool_call_parser)
    checked("text.format", structured_output, response_format(body), served.structured_backend,
            "text.format")
    turns = checked("input", conversation, body.instructions, body.input)
    return len(chat_prompt(turns, plan, tokenizer, "input"))


def prepare_response(body: ResponsesRequest, tokenizer: PromptTokenizer, served: ServedModel,
                     request_id: str = "") -> Prepared:
    """Checks a ``/v1/responses`` body like ``gateway.openai_requests.prepare`` checks a chat
    body: cheap checks first, then tokenization; ``OpenAIError`` naming the field."""
    checked("model", check_model, body.model, served.name)
    _refuse_fields(body)
    plan = tool_plan(body, served.tool_call_parser)
    json_schema, json_object = checked("text.format", structured_output, response_format(body),
                                       served.structured_backend, "text.format")
    forced = forced_constraint(plan, served, "tools[].parameters")
    if forced and (json_schema or json_object):
        raise error_for(InvalidRequest(
            f"text.format and tool_choice {body.tool_choice!r} both fix the output's shape; "
            "send one of them"), "text.format")
    options = checked_options(body.temperature, body.top_p, "stop", [], body.cache_salt,
                              body.tenant, request_id)
    turns = checked("input", conversation, body.instructions, body.input)
    prompt_token_ids = chat_prompt(turns, plan, tokenizer, "input")
    max_tokens = checked_length(prompt_token_ids, "input", body.max_output_tokens,
                                "max_output_tokens", served)
    try:
        knobs = checked_knobs(
            max_tokens=max_tokens, vocab_size=served.vocab_size, top_k=body.top_k,
            min_p=body.min_p, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty)
    except InvalidField as e:
        raise error_for(e, e.field) from e
    engine = options.engine_request(prompt_token_ids, max_tokens,
                                    json_schema=forced or json_schema, json_object=json_object,
                                    knobs=knobs)
    return Prepared(engine, plan, tuple(turns))
