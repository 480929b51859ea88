"""Tool calls out of generated text, streamed: text deltas in, pieces (text, a call's start, its
arguments) out.

Contract: ``ToolOutput`` is fed the answer's text deltas in order and closed once; it yields
``TextPiece``, ``CallStart`` and ``CallArguments`` in the order a client should see them, and
the same pieces whether the text arrives in one delta or token by token (non-streamed answers
use the same machine, so both agree). A call's ``CallStart`` always comes before its arguments.

Parsers, by ``ToolPlan.parser`` (the format the served model was trained to call tools in; set
``http.tool_call_parser``):

- ``hermes`` (Baton's default rendering, Hermes, Qwen2.5, SmolLM2-style): calls are
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the tags is
  content. A block that does not parse as a call of an offered function stays content.
- ``json`` (Llama 3.x style): the whole answer is one JSON call object or an array of them
  (``"arguments"`` or ``"parameters"``); anything else is content.

Forced calls (``required``, a named function) are not parsed by either: the grammar fixed the
output's shape (``gateway.tool_calls``): a named call streams its arguments as they are
generated; a required call's array is split into calls when it is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

from gateway.tool_calls import OPENAI_CALL_ID_PREFIX, ToolCall, ToolPlan, new_call_id

PARSERS = ("hermes", "json")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    fragment: str


Piece = TextPiece | CallStart | CallArguments


def finish_reason(engine_reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's ``tool_calls`` for an answer that ended by choice in calls; else the engine's."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag`` (kept until the next delta)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ToolOutput:
    """The pieces of one answer under a ``ToolPlan`` (or None: all text); the calls' ids are
    ``id_prefix`` and 24 hex digits (``gateway.tool_calls.new_call_id``)."""

    def __init__(self, plan: ToolPlan | None, id_prefix: str = OPENAI_CALL_ID_PREFIX) -> None:
        self.plan = plan
        self.id_prefix = id_prefix
        self.calls: list[ToolCall] = []
        self._text: list[str] = []
        self._pending = ""
        self._in_call = False
        self._named_id = ""

    @property
    def mode(self) -> str:
        return "none" if self.plan is None else self.plan.mode

    def content(self) -> str | None:
        """The answer's content (the text outside calls), None when there is none."""
        text = "".join(self._text)
        return text if text.strip() else None

    def feed(self, delta: str) -> list[Piece]:
        if not delta:
            return []
        if self.mode == "none":
            return self._say(delta)
        if self.mode == "named":
            return self._named(delta)
        self._pending += delta
        if self.mode == "auto" and self.plan.parser == "hermes":
            return list(self._hermes())
        if self.mode == "auto" and self._pending.lstrip()[:1] not in ("{", "[", ""):
            text, self._pending = self._pending, ""
            self.plan = None  # the json format calls at the start or not at all
            return self._say(text)
        return []

    def close(self) -> list[Piece]:
        """The pieces held back until the end of the answer."""
        pending, self._pending = self._pending, ""
        if self.mode in ("none", "named"):
            return []
        if self.mode == "auto" and self.plan.parser == "hermes":
            if self._in_call:
                self._in_call = False
                return self._call_or_text(pending, CALL_OPEN + pending)
            return self._say(pending)
        objects = _json_calls(pending)
        if objects is None or not all(self._offered(name) for name, _ in objects):
            return self._say(pending)
        pieces: list[Piece] = []
        for name, arguments in objects:
            pieces += self._call(name, arguments)
        return pieces if pieces else self._say(pending)

    # -- the modes ------------------------------------------------------------------------------

    def _named(self, delta: str) -> list[Piece]:
        pieces: list[Piece] = []
        if not self.calls:
            self._named_id = new_call_id(self.id_prefix)
            self.calls.append(ToolCall(self._named_id, self.plan.named, ""))
            pieces.append(CallStart(0, self._named_id, self.plan.named))
        call = self.calls[0]
        self.calls[0] = ToolCall(call.id, call.name, call.arguments + delta)
        pieces.append(CallArguments(0, delta))
        return pieces

    def _hermes(self) -> Iterator[Piece]:
        while True:
            if not self._in_call:
                start = self._pending.find(CALL_OPEN)
                if start < 0:
                    keep = _held_back(self._pending, CALL_OPEN)
                    cut = len(self._pending) - keep
                    text, self._pending = self._pending[:cut], self._pending[cut:]
                    yield from self._say(text)
                    return
                yield from self._say(self._pending[:start])
                self._pending = self._pending[start + len(CALL_OPEN):]
                self._in_call = True
            end = self._pending.find(CALL_CLOSE)
            if end < 0:
                return
            body = self._pending[:end]
            self._pending = self._pending[end + len(CALL_CLOSE):]
            self._in_call = False
            yield from self._call_or_text(body, CALL_OPEN + body + CALL_CLOSE)

    def _call_or_text(self, body: str, original: str) -> list[Piece]:
        parsed = _one_call(body)
        if parsed is None or not self._offered(parsed[0]):
            return self._say(original)
        return self._call(*parsed)

    def _offered(self, name: str) -> bool:
        return any(tool.name == name for tool in self.plan.tools)

    def _call(self, name: str, arguments: Any) -> list[Piece]:
        text = json.dumps(arguments, ensure_ascii=False)
        if self.calls and not self.plan.parallel:
            return []  # parallel_tool_calls false: the first call only
        index = len(self.calls)
        call = ToolCall(new_call_id(self.id_prefix), name, text)
        self.calls.append(call)
        return [CallStart(index, call.id, name), CallArguments(index, text)]

    def _say(self, text: str) -> list[Piece]:
        if not text or (self.calls and not text.strip()):
            return []  # whitespace between calls is not content
        self._text.append(text)
        return [TextPiece(text)]


def _call_parts(value: Any) -> tuple[str, Any] | None:
    """(name, arguments object) of one call object, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments


def _one_call(body: str) -> tuple[str, Any] | None:
    try:
        return _call_parts(json.loads(body))
    except json.JSONDecodeError:
        return None


def _json_calls(text: str) -> list[tuple[str, Any]] | None:
    """The calls of a whole-answer JSON call (object or array), or None when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    values = value if isinstance(value, list) else [value]
    parts = [_call_parts(item) for item in values]
    if not parts or any(part is None for part in parts):
        return None
    return parts
