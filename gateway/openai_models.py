"""The OpenAI HTTP front's request bodies: what ``/v1/chat/completions`` and ``/v1/completions``
accept, as pydantic models FastAPI parses the JSON into.

Contract: the declared fields are the ones served; any other field the body carries is kept
(``model_extra``) for ``gateway.openai_fields`` to accept at its neutral value or refuse by name,
so nothing is silently ignored. Baton's own request fields (``cache_salt``, ``tenant``, the
session fields, ``cache_control`` on messages, content parts and tools) ride as extra body
fields of the ``openai`` client. Parsing only checks types (and the seed's int64 range);
``gateway.openai_requests`` checks values against the served model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with usage.")


class _Body(BaseModel):
    """Fields shared by both endpoints. Other fields are kept in ``model_extra`` and checked by
    ``gateway.openai_fields``."""

    model_config = ConfigDict(extra="allow")

    model: str = Field("", description="Served model name; empty selects it.")
    max_tokens: int | None = Field(None, description="Tokens to generate at most.")
    max_completion_tokens: int | None = Field(None, description="Wins over max_tokens.")
    temperature: float | None = Field(None, description="Sampling temperature; unset: 1.0.")
    top_p: float | None = Field(None, description="Nucleus mass in (0, 1]; unset: 1.0.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="Sampling seed.")
    stop: str | list[str] | None = Field(None, description="Stop string(s).")
    presence_penalty: float | None = Field(None, description="In [-2, 2], per token already "
                                           "in the output; unset: 0.")
    frequency_penalty: float | None = Field(None, description="In [-2, 2], per occurrence in "
                                            "the output; unset: 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias in "
                                                "[-100, 100], added to its logit.")
    top_k: int | None = Field(None, description="vLLM extension: sample among the k most likely "
                              "tokens; unset, 0 or -1: all.")
    min_p: float | None = Field(None, description="vLLM extension: drop tokens under min_p times "
                                "the most likely one's probability; unset: 0.")
    repetition_penalty: float | None = Field(None, description="vLLM extension: > 0, above 1 "
                                             "penalizes tokens of the prompt and output; unset: 1.")
    min_tokens: int | None = Field(None, description="vLLM extension: no end of sequence or stop "
                                   "before this many tokens; unset: 0.")
    n: int = Field(1, description="Choices per request, 1 to 16 (gateway.openai_choices).")
    stream: bool = Field(False, description="Answer with server-sent events.")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="End-user id; accepted and ignored.")
    ignore_eos: bool = Field(False, description="vLLM extension: generate max_tokens tokens, past "
                             "the end-of-sequence token.")
    response_format: dict | None = Field(None, description="text, json_object or json_schema "
                                         "(structured outputs; checked by openai_requests).")
    structured_outputs: dict | None = Field(None, description="vLLM extension: one of json (a "
                                            "schema), regex or choice (a list of strings); "
                                            "checked by openai_requests.")
    cache_salt: str | None = Field(None, description="Baton: prefix-cache isolation salt.")
    tenant: str | None = Field(None, description="Baton: the salt when cache_salt is unset.")
    session_id: str | None = Field(None, description="Baton: the agent session this request is "
                                   "a step of (or the X-Session-Id header; gateway.sessions).")
    session_ttl_s: float | None = Field(None, description="Baton: seconds the session's lease "
                                        "lives without a new step; unset: sessions.default_ttl_s.")
    expected_next_step_s: float | None = Field(None, description="Baton: seconds until the "
                                               "session's next step, as the client expects.")
    cache_salt_offset: int | None = Field(None, description="Baton: the token offset from which "
                                          "the salt applies (a public trunk before it is shared "
                                          "across tenants; gateway.salts); unset: 0.")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str
    cache_control: dict | None = Field(None, description="Baton: an Anthropic-style breakpoint "
                                       "(gateway.cache_control).")


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict = Field(description="JSON text of an object (a dict is taken too).")


class ToolCall(BaseModel):
    """A call an assistant message of the history made."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's past calls.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")
    name: str | None = Field(None, description="The participant's name; accepted, not rendered.")
    cache_control: dict | None = Field(None, description="Baton: an Anthropic-style breakpoint "
                                       "(gateway.cache_control).")

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON Schema of the arguments; unset: "
                                    "none.")
    strict: bool | None = Field(None, description="Forced calls are always held to the schema; "
                                "auto calls are parsed, not constrained.")


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec
    cache_control: dict | None = Field(None, description="Baton: an Anthropic-style breakpoint "
                                       "after this tool's definition (gateway.cache_control).")


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage]
    tools: list[ToolSpec] | None = Field(None, description="Functions the model may call.")
    tool_choice: str | dict | None = Field(None, description="none, auto, required or "
                                           "{type: function, function: {name}}; unset: auto "
                                           "with tools, none without.")
    parallel_tool_calls: bool | None = Field(None, description="More than one call per answer; "
                                             "unset: true.")
    logprobs: bool | None = Field(None, description="Return each token's log-probability.")
    top_logprobs: int | None = Field(None, description="... and the 0..20 most likely tokens "
                                     "of each position; needs logprobs true.")
    chat_template_kwargs: dict | None = Field(None, description="vLLM extension: more variables "
                                              "for the model's chat template (enable_thinking, "
                                              "...); checked by gateway.validation.")
    cache_salt_from_message: int | None = Field(None, description="Baton: the salt applies from "
                                                "the first token of this message (an index into "
                                                "messages; exclusive with cache_salt_offset).")
    continue_final_message: bool = Field(False, description="vLLM extension: the last message is "
                                         "the assistant's answer so far, left open for the model "
                                         "to continue (needs add_generation_prompt false).")
    add_generation_prompt: bool = Field(True, description="vLLM extension: end the prompt with "
                                        "the assistant's turn header.")


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, description="Log-probabilities of each token and of the "
                                 "0..5 most likely tokens of each position.")
    echo: bool = Field(False, description="The answer's text starts with the prompt; with "
                       "logprobs, so do its log-probabilities (the prompt's first token has "
                       "none), the prompt computed whole where it is decoded.")
