"""The Responses route's answers: output items, status and usage from a request's progress, as
one ``response`` object or as the Responses API's server-sent events.

Contract:

* **Output items.** The answer's text goes through the tool-call parser (``ToolOutput``, whose
  pieces a plain answer passes as text) and ``OutputItems`` folds its pieces, in order, into
  items: text opens a ``message`` item with one ``output_text`` part, each call a
  ``function_call`` item (``fc_`` item id, ``call_`` call id) whose ``arguments`` stream as
  ``response.function_call_arguments.delta``. Streamed and non-streamed answers come from the
  same fold, so they agree. Whitespace before an item opens is held until text follows it (a
  call drops it).
* **Status.** ``completed``, or ``incomplete`` with ``incomplete_details.reason``
  ``max_output_tokens`` when the length limit ended the answer (the last item is then
  ``incomplete`` too).
* **Usage.** ``input_tokens`` (the whole prompt) with ``input_tokens_details.cached_tokens``
  (every reused prompt token, as the chat route's ``cached_tokens``), ``cache_write_tokens``
  (written under one of the request's leases: Anthropic's ``cache_creation_input_tokens``) and
  Baton's ``cached_tokens_by_tier``; ``output_tokens``; ``total_tokens``.
* **Events.** ``response.created``, ``response.in_progress``, each item's events, then
  ``response.completed`` (or ``response.incomplete``) with the whole response; every event
  carries its ``sequence_number`` from 0. An error after the first byte is an ``error`` event,
  and the stream ends. Baton's own fields (placement, loaded tokens, TTFT) sit under a
  ``baton`` key of the finished response.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from typing import AsyncIterator

import msgspec

from gateway.openai_errors import OpenAIError, translated
from gateway.openai_responses import Progress, tiers_dict
from gateway.responses_models import ResponsesRequest
from gateway.tool_calls import ToolPlan
from gateway.tool_parsers import CallArguments, CallStart, Piece, TextPiece, ToolOutput

RESPONSE_ID_PREFIX = "resp_"


def _item_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class OutputItems:
    """One answer's output items, folded from ``ToolOutput`` pieces; ``add`` and ``close``
    return the stream events each step makes (without ``sequence_number``)."""

    def __init__(self) -> None:
        self._items: list[dict] = []
        self._open = False
        self._held = ""
        self._item_of_call: dict[int, int] = {}

    def add(self, piece: Piece) -> list[dict]:
        if isinstance(piece, TextPiece):
            return self._text(piece.text)
        if isinstance(piece, CallStart):
            self._held = ""
            events = self._done()
            self._item_of_call[piece.index] = len(self._items)
            item = {"id": _item_id("fc_"), "type": "function_call", "status": "in_progress",
                    "call_id": piece.id, "name": piece.name, "arguments": ""}
            return events + self._added(item)
        assert isinstance(piece, CallArguments)
        index = self._item_of_call[piece.index]
        assert self._open and index == len(self._items) - 1, "arguments after the call's item"
        item = self._items[index]
        item["arguments"] += piece.fragment
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                 "output_index": index, "delta": piece.fragment}]

    def close(self, status: str = "completed") -> list[dict]:
        """The open item's closing events, marked ``status``."""
        return self._done(status)

    def items(self) -> list[dict]:
        return [dict(item) for item in self._items]

    def _text(self, text: str) -> list[dict]:
        last = len(self._items) - 1
        if self._open and self._items[last]["type"] == "message":
            part = self._items[last]["content"][0]
            part["text"] += text
            return [self._text_delta(last, text)]
        self._held += text
        if not self._held.strip():
            return []
        text, self._held = self._held, ""
        item = {"id": _item_id("msg_"), "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        events = self._done() + self._added(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        index = len(self._items) - 1
        events.append({"type": "response.content_part.added", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "part": dict(part)})
        part["text"] = text
        return events + [self._text_delta(index, text)]

    def _text_delta(self, index: int, text: str) -> dict:
        return {"type": "response.output_text.delta", "item_id": self._items[index]["id"],
                "output_index": index, "content_index": 0, "delta": text, "logprobs": []}

    def _added(self, item: dict) -> list[dict]:
        self._items.append(item)
        self._open = True
        return [{"type": "response.output_item.added", "output_index": len(self._items) - 1,
                 "item": _copied(item)}]

    def _done(self, status: str = "completed") -> list[dict]:
        if not self._open:
            return []
        self._open = False
        index = len(self._items) - 1
        item = self._items[index]
        item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {"type": "response.output_text.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "text": part["text"],
                 "logprobs": []},
                {"type": "response.content_part.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "part": dict(part)},
            ]
        else:
            events.append({"type": "response.function_call_arguments.done",
                           "item_id": item["id"], "output_index": index, "name": item["name"],
                           "arguments": item["arguments"]})
        return events + [{"type": "response.output_item.done", "output_index": index,
                          "item": _copied(item)}]


def _copied(item: dict) -> dict:
    return msgspec.json.decode(msgspec.json.encode(item))


def usage(progress: Progress) -> dict:
    """The Responses API's usage of a finished request (see the module docstring)."""
    details: dict = {"cached_tokens": progress.num_cached_tokens,
                     "cache_write_tokens": progress.num_cache_creation_tokens}
    if progress.cached_by_tier is not None:
        details["cached_tokens_by_tier"] = tiers_dict(progress.cached_by_tier)
    return {
        "input_tokens": progress.num_prompt_tokens,
        "input_tokens_details": details,
        "output_tokens": progress.num_completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": progress.num_prompt_tokens + progress.num_completion_tokens,
    }


class ResponseShape:
    """The fields of one ``response`` object that do not change while it runs: the request's
    settings as the API echoes them."""

    def __init__(self, body: ResponsesRequest, plan: ToolPlan | None, request_id: str,
                 model: str) -> None:
        text_format = (body.text.format.model_dump(by_alias=True, exclude_none=True)
                       if body.text is not None and body.text.format is not None
                       else {"type": "text"})
        tools = [{"type": "function", "name": tool.name, "description": tool.description,
                  "parameters": tool.parameters, "strict": False}
                 for tool in (plan.tools if plan is not None else ())]
        self.fields = {
            "id": RESPONSE_ID_PREFIX + request_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": plan.parallel if plan is not None else (
                body.parallel_tool_calls is not False),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": text_format},
            "tool_choice": body.tool_choice if body.tool_choice is not None else (
                "auto" if tools else "none"),
            "tools": tools,
            "truncation": "disabled",
            "user": body.user,
        }

    def running(self) -> dict:
        return {**self.fields, "status": "in_progress", "error": None,
                "incomplete_details": None, "output": [], "usage": None}

    def finished(self, items: OutputItems, progress: Progress) -> dict:
        status = status_of(progress)
        return {**self.fields, "status": status, "error": None,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "output": items.items(), "usage": usage(progress), "baton": progress.baton()}


def status_of(progress: Progress) -> str:
    return "incomplete" if progress.finish_reason == "length" else "completed"


def full_response(text: str, progress: Progress, tools: ToolOutput, shape: ResponseShape
                  ) -> dict:
    """The non-streamed answer to a finished request whose whole output is ``text``."""
    items = OutputItems()
    for piece in tools.feed(text) + tools.close():
        items.add(piece)
    items.close(status_of(progress))
    return shape.finished(items, progress)


def sse_event(data: dict) -> bytes:
    """One server-sent event as the Responses API sends it: its ``type`` also as the event's
    name."""
    return f"event: {data['type']}\ndata: {msgspec.json.encode(data).decode()}\n\n".encode()


async def response_events(events: AsyncIterator, progress: Progress, tools: ToolOutput,
                          shape: ResponseShape, request_id: str) -> AsyncIterator[bytes]:
    """The SSE body (see the module docstring); closes ``events`` however it ends."""
    items = OutputItems()
    numbers = itertools.count()

    def numbered(data: dict) -> bytes:
        return sse_event({**data, "sequence_number": next(numbers)})

    try:
        with translated(request_id):
            async with contextlib.aclosing(events):
                opening = shape.running()
                yield numbered({"type": "response.created", "response": opening})
                yield numbered({"type": "response.in_progress", "response": opening})
                async for event in events:
                    progress.add(event)
                    for piece in tools.feed(event.text):
                        for data in items.add(piece):
                            yield numbered(data)
                assert progress.finish_reason, "router ended the stream without a finish_reason"
        status = status_of(progress)
        closing = [data for piece in tools.close() for data in items.add(piece)]
        for data in closing + items.close(status):
            yield numbered(data)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield numbered({"type": kind, "response": shape.finished(items, progress)})
    except OpenAIError as e:
        error = e.body["error"]
        yield numbered({"type": "error", "code": error["code"], "message": error["message"],
                        "param": error["param"]})
