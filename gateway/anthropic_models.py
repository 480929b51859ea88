"""The Anthropic Messages front's request bodies: what ``/v1/messages`` and
``/v1/messages/count_tokens`` accept, as pydantic models the handlers parse the JSON into.

Contract: the declared fields are the ones served. A top-level field the body carries beyond them
is kept (``model_extra``) for ``gateway.anthropic_requests`` to refuse by name; a nested one
(a content block's, a tool's) fails parsing, which names where it stands. Both answer 400: nothing
is silently ignored. ``cache_control`` (on the request, system and content blocks, tools) is a
breakpoint whose prefix is leased in the KV store (``gateway.cache_control``). Baton's own
``cache_salt``, ``tenant`` and session fields ride as extra body fields of the ``anthropic``
client (``extra_body``). Parsing only checks types; values are checked against the
served model by ``gateway.anthropic_requests``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

CACHE_CONTROL = ("A breakpoint {type: ephemeral, ttl?: 5m | 1h}: the prompt up to it is leased "
                 "in the KV store for the TTL (gateway.cache_control).")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = Field(None, description=CACHE_CONTROL)


class ToolUseBlock(_Strict):
    """A call an assistant message of the history made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict = Field(description="The arguments object.")
    cache_control: dict | None = Field(None, description=CACHE_CONTROL)


class ToolResultBlock(_Strict):
    """What a call of the history returned (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = Field(False, description="The call failed: its content is rendered after "
                           "'Error: '.")
    cache_control: dict | None = Field(None, description=CACHE_CONTROL)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else joined(self.content)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def joined(blocks: list[TextBlock]) -> str:
    """The text of consecutive text blocks, concatenated as they are (as OpenAI's content parts
    are)."""
    return "".join(block.text for block in blocks)


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolSpec(_Strict):
    """A client tool: a function the model may call."""

    type: Literal["custom"] | None = Field(None, description="Only client tools are served.")
    name: str
    description: str | None = None
    input_schema: dict = Field(description="JSON Schema of the input object.")
    cache_control: dict | None = Field(None, description=CACHE_CONTROL)
    strict: bool | None = Field(None, description="Forced calls are always held to the schema; "
                                "auto calls are parsed, not constrained.")


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="The tool a 'tool' choice forces.")
    disable_parallel_tool_use: bool = Field(False, description="At most one call per answer.")


class Metadata(_Strict):
    user_id: str | None = Field(None, description="End-user id; accepted and ignored.")


class CountTokensRequest(BaseModel):
    """``/v1/messages/count_tokens``: the prompt without the sampling. Other fields are kept in
    ``model_extra`` and refused by ``gateway.anthropic_requests``."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, description="Unset: auto with tools, none "
                                           "without.")
    cache_control: dict | None = Field(None, description=CACHE_CONTROL)
    cache_salt: str | None = Field(None, description="Baton: prefix-cache isolation salt.")
    tenant: str | None = Field(None, description="Baton: the salt when cache_salt is unset.")
    cache_salt_offset: int | None = Field(None, description="Baton: the token offset from which "
                                          "the salt applies (gateway.salts); unset: 0.")
    cache_salt_from_message: int | None = Field(None, description="Baton: the salt applies from "
                                                "the first token of this message (an index into "
                                                "messages; exclusive with cache_salt_offset).")


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``."""

    max_tokens: int = Field(description="Tokens to generate at most.")
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, description="Sampling temperature; unset: 1.0.")
    top_p: float | None = Field(None, description="Nucleus mass in (0, 1]; unset: 1.0.")
    top_k: int | None = Field(None, description="Sample among the k most likely tokens; unset "
                              "or 0: all.")
    stream: bool = Field(False, description="Answer with server-sent events.")
    metadata: Metadata | None = None
    session_id: str | None = Field(None, description="Baton: the agent session this request is "
                                   "a step of (or the X-Session-Id header; gateway.sessions).")
    session_ttl_s: float | None = Field(None, description="Baton: seconds the session's lease "
                                        "lives without a new step; unset: sessions.default_ttl_s.")
    expected_next_step_s: float | None = Field(None, description="Baton: seconds until the "
                                               "session's next step, as the client expects.")
