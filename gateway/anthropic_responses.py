"""The Anthropic Messages front's answers: content blocks, stop reason and usage from a request's
progress, as one ``message`` object or as Anthropic's server-sent events.

Contract:

* **Content.** The answer's text goes through the tool-call parser (``ToolOutput``, whose pieces
  a plain answer passes as text) and ``ContentBlocks`` folds its pieces, in order, into blocks:
  text opens a ``text`` block, each call a ``tool_use`` block (``toolu_`` ids) whose ``input``
  streams as ``input_json_delta``. Streamed and non-streamed answers come from the same fold, so
  they agree. Whitespace before a block opens is held until text follows it (a call drops it).
* **Stop reason.** Calls made and the engine stopped by itself: ``tool_use``; the length limit:
  ``max_tokens``; a stop string matched (the decode worker reports which,
  ``TokenChunk.stop_sequence``): ``stop_sequence`` with that string; else ``end_turn``.
* **Usage.** Anthropic's split of the prompt, ``input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens`` = prompt tokens: ``cache_read_input_tokens`` are the prompt
  tokens served from cache (device prefix cache or KV store), ``cache_creation_input_tokens`` the
  prompt tokens written under one of the request's leases (a session step, a ``cache_control``
  breakpoint: ``sessions.cache_creation_tokens``) and not read, ``input_tokens`` the rest;
  ``output_tokens`` the generated tokens. A stream's ``message_start`` counts the whole prompt as
  ``input_tokens`` (the cache split is known when the request finishes); its ``message_delta``
  carries the final four, which the client's accumulated message takes.
* Baton's own fields (placement, loaded tokens, TTFT) sit under a ``baton`` key: on the message,
  and on a stream's ``message_delta``.
"""

from __future__ import annotations

import contextlib
import json
from typing import AsyncIterator

import msgspec

from gateway.anthropic_errors import anthropic
from gateway.openai_errors import OpenAIError, translated
from gateway.openai_responses import Progress
from gateway.tool_calls import ToolCall
from gateway.tool_parsers import (
    CallArguments,
    CallStart,
    Piece,
    TextPiece,
    ToolOutput,
    finish_reason,
)

MESSAGE_ID_PREFIX = "msg_"


class ContentBlocks:
    """One answer's content blocks, folded from ``ToolOutput`` pieces; ``add`` and ``close``
    return the stream events (``content_block_start``/``_delta``/``_stop``) each step makes."""

    def __init__(self) -> None:
        self._blocks: list[dict] = []
        self._inputs: list[str] = []
        """Per block, a tool_use's input as its streamed JSON text ('' for text)."""
        self._open = False
        self._held = ""
        self._block_of_call: dict[int, int] = {}

    def add(self, piece: Piece) -> list[dict]:
        if isinstance(piece, TextPiece):
            return self._text(piece.text)
        if isinstance(piece, CallStart):
            self._held = ""
            events = self._stop()
            self._block_of_call[piece.index] = len(self._blocks)
            block = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            return events + self._start(block)
        assert isinstance(piece, CallArguments)
        index = self._block_of_call[piece.index]
        assert self._open and index == len(self._blocks) - 1, "arguments after the call's block"
        self._inputs[index] += piece.fragment
        return [_delta(index, {"type": "input_json_delta", "partial_json": piece.fragment})]

    def close(self) -> list[dict]:
        return self._stop()

    def content(self) -> list[dict]:
        """The blocks, each ``tool_use`` with its parsed ``input``. A call whose input is not a
        whole JSON object (a forced call cut off by ``max_tokens``) is left out."""
        blocks = []
        for block, text in zip(self._blocks, self._inputs):
            if block["type"] == "tool_use":
                arguments = _json_object(text)
                if arguments is None:
                    continue
                block = block | {"input": arguments}
            blocks.append(block)
        return blocks

    def _text(self, text: str) -> list[dict]:
        last = len(self._blocks) - 1
        if self._open and self._blocks[last]["type"] == "text":
            self._blocks[last]["text"] += text
            return [_delta(last, {"type": "text_delta", "text": text})]
        self._held += text
        if not self._held.strip():
            return []
        text, self._held = self._held, ""
        events = self._stop() + self._start({"type": "text", "text": ""})
        self._blocks[-1]["text"] = text
        return events + [_delta(len(self._blocks) - 1, {"type": "text_delta", "text": text})]

    def _start(self, block: dict) -> list[dict]:
        self._blocks.append(block)
        self._inputs.append("")
        self._open = True
        return [{"type": "content_block_start", "index": len(self._blocks) - 1,
                 "content_block": dict(block)}]

    def _stop(self) -> list[dict]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self._blocks) - 1}]


def _delta(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def usage(progress: Progress) -> dict:
    """Anthropic's usage of the request so far (see the module docstring)."""
    cached = progress.num_cached_tokens
    created = progress.num_cache_creation_tokens
    assert cached + created <= progress.num_prompt_tokens, "more cached tokens than the prompt has"
    return {
        "input_tokens": progress.num_prompt_tokens - cached - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
        "output_tokens": progress.num_completion_tokens,
    }


def stop_reason(progress: Progress, calls: list[ToolCall]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished answer (see the module docstring)."""
    reason = finish_reason(progress.finish_reason, calls)
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if progress.stop_sequence:
        return "stop_sequence", progress.stop_sequence
    return "end_turn", None


def message(request_id: str, model: str, content: list[dict], progress: Progress,
            stop: tuple[str | None, str | None] = (None, None)) -> dict:
    """The ``message`` object; ``stop`` is ``stop_reason``'s pair, none yet while the answer
    runs (a stream's ``message_start``)."""
    reason, sequence = stop
    return {"id": MESSAGE_ID_PREFIX + request_id, "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(progress)}


def full_message(text: str, progress: Progress, tools: ToolOutput, request_id: str,
                 model: str) -> dict:
    """The non-streamed answer to a finished request whose whole output is ``text``."""
    blocks = ContentBlocks()
    for piece in tools.feed(text) + tools.close():
        blocks.add(piece)
    stop = stop_reason(progress, tools.calls)
    return {**message(request_id, model, blocks.content(), progress, stop),
            "baton": progress.baton()}


def sse_event(data: dict) -> bytes:
    """One server-sent event as Anthropic sends it: its ``type`` also as the event name."""
    return f"event: {data['type']}\ndata: {msgspec.json.encode(data).decode()}\n\n".encode()


async def message_events(events: AsyncIterator, progress: Progress, tools: ToolOutput,
                         request_id: str, model: str) -> AsyncIterator[bytes]:
    """The SSE body: ``message_start``, ``ping``, the blocks' events, ``message_delta`` (stop
    reason, final usage, ``baton``), ``message_stop``. An error after the first byte becomes an
    ``error`` event, and the stream ends."""
    blocks = ContentBlocks()
    try:
        with translated(request_id):
            async with contextlib.aclosing(events):
                opening = message(request_id, model, [], progress)
                yield sse_event({"type": "message_start", "message": opening})
                yield sse_event({"type": "ping"})
                async for event in events:
                    progress.add(event)
                    for piece in tools.feed(event.text):
                        for data in blocks.add(piece):
                            yield sse_event(data)
                assert progress.finish_reason, "router ended the stream without a finish_reason"
        closing = [data for piece in tools.close() for data in blocks.add(piece)]
        for data in closing + blocks.close():
            yield sse_event(data)
        reason, sequence = stop_reason(progress, tools.calls)
        yield sse_event({"type": "message_delta",
                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": usage(progress), "baton": progress.baton()})
        yield sse_event({"type": "message_stop"})
    except OpenAIError as e:
        yield sse_event(anthropic(e).body)
