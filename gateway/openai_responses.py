"""The OpenAI HTTP front's answers: usage and Baton's own fields from a request's progress, and
how each endpoint spells its objects and choices.

Contract: ``Progress`` accumulates the router's events for one request (the gateway's
accounting: TTFT from receipt to the first token, cached and loaded tokens); ``Shape`` turns
text, a finish reason and log-probabilities into ``chat.completion``/``text_completion`` objects
and chunks. Baton's response fields sit under a top-level ``baton`` key (placement, loaded
tokens, TTFT).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from gateway.openai_logprobs import chat_logprobs, completion_logprobs
from gateway.router import Placed, cached_by_tier, num_cached_tokens
from gateway.sessions import cache_creation_tokens
from gateway.tool_calls import ToolCall
from gateway.tool_parsers import CallArguments, CallStart, Piece, TextPiece
from protos.wire import CachedByTier, Lease, PositionLogprobs, TokenChunk


@dataclass
class Progress:
    """What one request has produced so far; the gateway's accounting, for HTTP."""

    placed: Placed
    received_at: float
    num_prompt_tokens: int
    num_completion_tokens: int = 0
    ttft_ms: float = 0.0
    finish_reason: str | None = None
    num_loaded_tokens: int = 0
    num_cached_tokens: int = 0
    cached_by_tier: CachedByTier | None = None
    """``num_cached_tokens`` by tier, once finished (None: not broken down)."""
    stop_sequence: str = ""
    """The stop string that ended the answer ('' when none did: ``TokenChunk.stop_sequence``)."""
    leases: tuple[Lease, ...] = ()
    """The request's leases (session, breakpoints): what its cache writes count against."""
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()
    """The prompt's log-probabilities, from its second token on (asked for by ``echo``)."""
    prompt_only: bool = False
    """The answer is the prompt alone (``Echo.prompt_only``): the engine's one token is not
    counted, and the answer ends by "length"."""

    def add(self, event: Placed | TokenChunk) -> None:
        assert isinstance(event, TokenChunk), "router sent a second Placed event"
        if event.prompt_logprobs:
            self.prompt_logprobs = event.prompt_logprobs
        if self.prompt_only:
            if self.ttft_ms == 0.0:  # the prompt's answer: its first (and only) text
                self.ttft_ms = (time.perf_counter() - self.received_at) * 1000.0
        else:
            if event.token_ids and self.num_completion_tokens == 0:
                self.ttft_ms = (time.perf_counter() - self.received_at) * 1000.0
            self.num_completion_tokens += len(event.token_ids)
        if event.finish_reason:
            self.finish_reason = "length" if self.prompt_only else event.finish_reason
            self.num_loaded_tokens = event.num_loaded_tokens
            self.num_cached_tokens = num_cached_tokens(self.placed, event)
            self.cached_by_tier = cached_by_tier(self.placed, event)
            self.stop_sequence = event.stop_sequence

    @property
    def num_cache_creation_tokens(self) -> int:
        """Anthropic's ``cache_creation_input_tokens``: prompt tokens written under one of the
        request's leases and not read from cache; 0 until the request finishes."""
        if self.finish_reason is None:
            return 0
        return cache_creation_tokens(self.leases, self.num_prompt_tokens, self.num_cached_tokens)

    def usage(self) -> dict:
        """OpenAI's usage, with Anthropic's two cache counts beside ``cached_tokens`` and, in
        ``prompt_tokens_details``, Baton's ``cached_tokens_by_tier`` (once broken down)."""
        details: dict = {"cached_tokens": self.num_cached_tokens}
        if self.cached_by_tier is not None:
            details["cached_tokens_by_tier"] = tiers_dict(self.cached_by_tier)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": details,
            "cache_creation_input_tokens": self.num_cache_creation_tokens,
            "cache_read_input_tokens": self.num_cached_tokens,
        }

    def baton(self) -> dict:
        placement = self.placed.placement
        return {
            "placement": {
                "prefill": placement.prefill_instance,
                "decode": placement.decode_instance,
                "policy": placement.policy,
                "reason": placement.reason,
                "transfer_ms": placement.transfer_ms,
                "queue_ms": placement.queue_ms,
                "prefill_ms": placement.prefill_ms,
                "expected_cached_blocks": placement.expected_cached_blocks,
                "pulled_from": placement.pulled_from,
            },
            "loaded_tokens": self.num_loaded_tokens,
            "ttft_ms": self.ttft_ms,
        }


def tiers_dict(tiers: CachedByTier) -> dict[str, int]:
    """``{"device", "host", "disk", "pulled"}``: the tokens of each tier."""
    return {"device": tiers.device, "host": tiers.host, "disk": tiers.disk,
            "pulled": tiers.pulled}


@dataclass(frozen=True)
class Shape:
    """How one endpoint spells its objects and choices."""

    id_prefix: str
    object_full: str
    object_chunk: str
    chat: bool

    def header(self, request_id: str, created: int, model: str, chunk: bool) -> dict:
        return {
            "id": self.id_prefix + request_id,
            "object": self.object_chunk if chunk else self.object_full,
            "created": created,
            "model": model,
        }

    def full_choice(self, text: str | None, finish_reason: str | None,
                    logprobs: dict | None = None, tool_calls: Sequence[ToolCall] = (),
                    index: int = 0) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = [tool_call_entry(call) for call in tool_calls]
            content = {"message": message}
        else:
            content = {"text": text}
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choice(self, delta: dict, finish_reason: str | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
        """A chat chunk's choice with ``delta`` (``piece_delta``)."""
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def chunk_choice(self, text: str | None, finish_reason: str | None, role: bool = False,
                     logprobs: dict | None = None, index: int = 0) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            content = {"delta": delta | ({"content": text} if text is not None else {})}
        else:
            content = {"text": text or ""}
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, positions: Sequence[PositionLogprobs], text_offset: int = 0,
                 first_prompt_token: str | None = None) -> tuple[dict, int]:
        """This endpoint's ``logprobs`` of ``positions`` (``gateway.openai_logprobs``), the
        first at ``text_offset`` (completions; after ``first_prompt_token`` when it echoes the
        prompt); and the offset after the last."""
        if self.chat:
            return chat_logprobs(positions), text_offset
        return completion_logprobs(positions, text_offset, first_prompt_token)


def tool_call_entry(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def piece_delta(piece: Piece) -> dict:
    """A chat chunk's ``delta`` for one piece of a tool-calling answer, as OpenAI streams it:
    content text; a call's opening (index, id, type, name, empty arguments); arguments text."""
    if isinstance(piece, TextPiece):
        return {"content": piece.text}
    if isinstance(piece, CallStart):
        function = {"name": piece.name, "arguments": ""}
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                "function": function}]}
    assert isinstance(piece, CallArguments)
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.fragment}}]}


CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)
COMPLETION = Shape("cmpl-", "text_completion", "text_completion", chat=False)
