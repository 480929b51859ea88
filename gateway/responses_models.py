"""OpenAI's Responses API on the HTTP front: what ``POST /v1/responses`` accepts, as pydantic
models the handler parses the JSON into.

Contract: the declared top-level fields are the ones served (or accepted at the value that asks
for nothing, ``gateway.responses_requests.NEUTRAL``); any other top-level field is kept
(``model_extra``) and refused by name. ``input`` items and ``tools`` are parsed item by item by
``gateway.responses_requests`` (``InputMessage``, ``FunctionCallItem``, ``FunctionCallOutput``,
``FunctionTool``) so that a refusal names the item (``input[3]``) and its type. Parsing only
checks types; values are checked against the served model by ``gateway.responses_requests``.
Baton's own fields (``cache_salt``, ``tenant``, the session fields) ride as extra body fields of
the ``openai`` client, as on the chat route.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """A text part of a message: ``input_text`` (the client's) or ``output_text`` (an earlier
    answer replayed as input, with what the answer carried beside its text)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class InputMessage(_Strict):
    """A message item (``type`` ``message`` or unset): the roles' text."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A call an earlier answer made, replayed as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments object as JSON text.")
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(_Strict):
    """What the client's run of a call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class FunctionTool(_Strict):
    """A function the model may call (the Responses API's flat spelling)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON Schema of the arguments object.")
    strict: bool | None = Field(None, description="Forced calls are always held to the schema; "
                                "auto calls are parsed, not constrained.")


class TextFormat(_Strict):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (name, schema)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="Only the default is served.")


class ResponsesRequest(BaseModel):
    """``/v1/responses``. Other top-level fields are kept in ``model_extra`` and refused."""

    model_config = ConfigDict(extra="allow")

    model: str = Field("", description="Served model name; empty selects it.")
    input: str | list[dict] = Field(description="A user message's text, or a list of items.")
    instructions: str | None = Field(None, description="A system message before the input.")
    tools: list[dict] | None = Field(None, description="Function tools the model may call.")
    tool_choice: str | dict | None = Field(None, description="none, auto, required or "
                                           "{type: function, name}; unset: auto with tools.")
    parallel_tool_calls: bool | None = Field(None, description="Unset: true.")
    max_output_tokens: int | None = Field(None, description="Tokens to generate at most.")
    temperature: float | None = Field(None, description="Sampling temperature; unset: 1.0.")
    top_p: float | None = Field(None, description="Nucleus mass in (0, 1]; unset: 1.0.")
    top_k: int | None = Field(None, description="vLLM extension: sample among the k most likely "
                              "tokens; unset, 0 or -1: all.")
    min_p: float | None = Field(None, description="vLLM extension; unset: 0.")
    presence_penalty: float | None = Field(None, description="vLLM extension; unset: 0.")
    frequency_penalty: float | None = Field(None, description="vLLM extension; unset: 0.")
    repetition_penalty: float | None = Field(None, description="vLLM extension; unset: 1.")
    stream: bool = Field(False, description="Answer with server-sent events.")
    text: TextConfig | None = Field(None, description="The output's format.")
    user: str | None = Field(None, description="End-user id; accepted and ignored.")
    safety_identifier: str | None = Field(None, description="End-user id; accepted and ignored.")
    metadata: dict[str, str] | None = Field(None, description="Echoed on the response.")
    prompt_cache_key: str | None = Field(None, description="A cache routing hint; Baton places "
                                         "every request by the KV blocks its prompt reuses.")
    store: bool | None = Field(None, description="Responses are not stored: false or unset.")
    cache_salt: str | None = Field(None, description="Baton: prefix-cache isolation salt.")
    tenant: str | None = Field(None, description="Baton: the salt when cache_salt is unset.")
    session_id: str | None = Field(None, description="Baton: the agent session this request is "
                                   "a step of (or the X-Session-Id header; gateway.sessions).")
    session_ttl_s: float | None = Field(None, description="Baton: seconds the session's lease "
                                        "lives without a new step.")
    expected_next_step_s: float | None = Field(None, description="Baton: seconds until the "
                                               "session's next step, as the client expects.")
