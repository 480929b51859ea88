"""Tool calling, front-neutral: the tools a request offers, how the model must (or may) call
them, the prompt they are rendered into, and the grammar that enforces a forced call.

Both HTTP fronts (OpenAI's ``tools``/``tool_choice``, Anthropic's ``tools``/``tool_choice``)
build a ``ToolPlan`` from their own spelling; from there on everything is shared:

- **Rendering.** A chat template that knows tools (it mentions ``tools``) gets them, and the
  history's tool calls, in Hugging Face's structured form. Any other template (SmolLM2's) gets
  Baton's documented default, a Hermes-style system preamble: the tools as JSON inside
  ``<tools></tools>`` and the instruction to answer calls as ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``; past calls are written back in that form and tool results
  as ``<tool_response>...</tool_response>``. The same tools render the same prefix on every
  step of an agent loop, so each step reuses the previous step's KV.
- **Choice.** ``none``: tools are rendered (the prefix stays the same) but nothing is parsed;
  ``auto``: the output is parsed by the configured parser (``gateway.tool_parsers``);
  ``required`` and a named function are enforced by constrained decoding (structured outputs):
  a named call's output is the arguments object, held to the function's JSON schema; a required
  call's output is a JSON array of ``{"name", "arguments"}`` objects, each held to its function's
  schema. Either way the arguments always parse and validate.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from protos.errors import InvalidRequest

ChoiceMode = Literal["none", "auto", "required", "named"]
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}, "additionalProperties": False}
"""A function declared without parameters takes none: its arguments are ``{}``."""

TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You can call functions to help answer. Their signatures are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one pair of tags per call:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n</tool_call>"
)
"""Baton's default rendering of tools, for chat templates that do not render tools themselves."""


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    parameters: dict
    """A JSON Schema object for the arguments."""

    def spec(self) -> dict:
        """The OpenAI/Hugging Face ``{"type": "function", "function": {...}}`` form."""
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made (or made earlier in the history)."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""


@dataclass(frozen=True)
class Turn:
    """One message of a conversation, front-neutral."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tool calling, checked."""

    tools: tuple[Tool, ...]
    mode: ChoiceMode
    named: str = ""
    parallel: bool = True
    """More than one call per answer (OpenAI's ``parallel_tool_calls``)."""
    parser: str = "hermes"

    def constraint(self) -> str:
        """The JSON Schema text that enforces a forced call (``SamplingOptions.json_schema``),
        or '' when the model chooses freely."""
        if self.mode == "named":
            return _schema_text(self.tool(self.named).parameters)
        if self.mode != "required":
            return ""
        items = [{
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        } for tool in self.tools]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            array["maxItems"] = 1
        return _schema_text(array)

    def tool(self, name: str) -> Tool:
        return next(tool for tool in self.tools if tool.name == name)


def _schema_text(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"))


OPENAI_CALL_ID_PREFIX = "call_"
ANTHROPIC_CALL_ID_PREFIX = "toolu_"


def new_call_id(prefix: str = OPENAI_CALL_ID_PREFIX) -> str:
    """A fresh call id: ``prefix`` and 24 hex digits (OpenAI's ``call_...``, Anthropic's
    ``toolu_...``)."""
    return prefix + uuid.uuid4().hex[:24]


def checked_tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    """A ``Tool`` from its three parts, or ``InvalidRequest`` naming ``where``."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidRequest(f"{where}: the function name must be 1 to 64 letters, digits, '_' "
                             f"or '-', got {name!r}")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}: description must be a string")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}: the parameters must be a JSON Schema object, got "
                             f"{type(parameters).__name__}")
    return Tool(name, description or "", parameters)


def checked_plan(tools: list[Tool], mode: ChoiceMode, named: str = "", parallel: bool = True,
                 parser: str = "hermes") -> ToolPlan | None:
    """The plan, or None when no tools are offered. ``InvalidRequest`` for duplicate names, a
    forced choice without tools, or a named function that is not offered."""
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise InvalidRequest(f"tools: each function name may appear once; repeated: "
                             f"{', '.join(duplicates)}")
    if not tools:
        if mode in ("required", "named"):
            raise InvalidRequest(f"tool_choice {mode if mode != 'named' else repr(named)} needs "
                                 "tools; send the functions the model must choose from")
        return None
    if mode == "named" and named not in names:
        raise InvalidRequest(f"tool_choice names the function {named!r}, which is not among "
                             f"the tools ({', '.join(names)})")
    return ToolPlan(tuple(tools), mode, named, parallel, parser)


def checked_arguments(arguments: Any, where: str) -> str:
    """Arguments of a past call as compact JSON text of an object; ``InvalidRequest`` naming
    ``where`` when they are not one."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{where}: the arguments are not valid JSON ({e.msg})") from e
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}: the arguments must be a JSON object")
    return json.dumps(value, ensure_ascii=False)


@dataclass
class Rendered:
    """A conversation as ``apply_chat_template`` takes it."""

    messages: list[dict]
    tools: list[dict] | None = field(default=None)


def render(turns: list[Turn], plan: ToolPlan | None, native: bool) -> Rendered:
    """The conversation with its tools, for a template that renders tools itself (``native``)
    or with Baton's default (module docstring)."""
    tools = plan.tools if plan is not None else ()
    if native:
        return Rendered([_native_message(turn) for turn in turns],
                        [tool.spec() for tool in tools] or None)
    messages = [_default_message(turn) for turn in turns]
    if tools:
        listing = "\n".join(json.dumps(tool.spec(), ensure_ascii=False) for tool in tools)
        preamble = TOOLS_PREAMBLE.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + preamble}
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return Rendered(messages)


def hermes_call_text(call: ToolCall) -> str:
    body = {"name": call.name, "arguments": json.loads(call.arguments)}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def _default_message(turn: Turn) -> dict:
    if turn.role == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{turn.content}\n</tool_response>"}
    if turn.tool_calls:
        calls = "\n".join(hermes_call_text(call) for call in turn.tool_calls)
        content = f"{turn.content}\n{calls}" if turn.content else calls
        return {"role": turn.role, "content": content}
    return {"role": turn.role, "content": turn.content}


def _native_message(turn: Turn) -> dict:
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.loads(call.arguments)}}
            for call in turn.tool_calls
        ]
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    return message
