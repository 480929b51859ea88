"""vLLM's tokenizer routes on the HTTP front: ``POST /tokenize`` and ``POST /detokenize``, for
clients that count tokens against the served model's own tokenizer and chat template (to keep an
agent's context inside the window) the way they do against a vLLM server.

Contract, as vLLM serves them:

* ``/tokenize`` takes exactly one of ``prompt`` (text; ``add_special_tokens`` unset or true adds
  the tokenizer's own, e.g. a BOS) or ``messages`` (the chat route's conversation, with its
  ``tools``, ``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message``,
  rendered exactly as ``/v1/chat/completions`` renders it; ``add_special_tokens`` may not be
  true: the template holds them) and answers ``{"count", "max_model_len", "tokens",
  "token_strs"}`` (``token_strs`` with ``return_token_strs``, else null). A prompt longer than
  the context window is counted, not refused: counting is what the route is for.
* ``/detokenize`` takes ``tokens`` (ids of the vocabulary) and answers ``{"prompt": text}``.

Both sit beside ``/health`` (not under ``/v1``, as in vLLM), behind the same bearer key as the
``/v1`` routes; errors are OpenAI's shape, 400 naming the field (404 for another model).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from gateway.openai_errors import error_for
from gateway.openai_models import ChatCompletionRequest, ChatMessage, ToolSpec
from gateway.openai_requests import ServedModel, checked, rendered_chat, tool_plan
from gateway.tokenization import PromptTokenizer
from gateway.validation import check_model, check_token_ids
from protos.errors import InvalidRequest


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("", description="Served model name; empty selects it.")
    prompt: str | None = Field(None, description="Text to tokenize (exclusive with messages).")
    messages: list[ChatMessage] | None = Field(None, description="A conversation, rendered as "
                                               "/v1/chat/completions renders it.")
    add_special_tokens: bool | None = Field(None, description="prompt: add the tokenizer's "
                                            "special tokens (unset: true); messages: false only.")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's "
                                        "turn header.")
    continue_final_message: bool = Field(False, description="messages: leave the last, "
                                         "assistant message open.")
    tools: list[ToolSpec] | None = Field(None, description="messages: the functions offered.")
    chat_template_kwargs: dict | None = Field(None, description="messages: more template "
                                              "variables.")
    return_token_strs: bool = Field(False, description="Also answer each token's string.")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("", description="Served model name; empty selects it.")
    tokens: list[int] = Field(description="Token ids of the served model's vocabulary.")


CHAT_ONLY = ("tools", "chat_template_kwargs")


def tokenized(body: TokenizeRequest, tokenizer: PromptTokenizer, served: ServedModel) -> dict:
    """``/tokenize``'s answer (see the module docstring); ``OpenAIError`` naming the field."""
    checked("model", check_model, body.model, served.name)
    if (body.prompt is None) == (body.messages is None):
        raise error_for(InvalidRequest("send exactly one of prompt (text) and messages (a "
                                       "conversation)"), "prompt")
    if body.prompt is not None:
        for name in ("continue_final_message", *CHAT_ONLY):
            if getattr(body, name):
                raise error_for(InvalidRequest(f"{name} applies to messages, not to a prompt"),
                                name)
        if not body.add_generation_prompt:
            raise error_for(InvalidRequest("add_generation_prompt applies to messages, not to a "
                                           "prompt"), "add_generation_prompt")
        token_ids = tokenizer.encode_text(body.prompt, body.add_special_tokens is not False)
    else:
        if body.add_special_tokens:
            raise error_for(InvalidRequest(
                "add_special_tokens is false for messages: the chat template holds the special "
                "tokens"), "add_special_tokens")
        chat = ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs,
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message)
        token_ids, _turns = rendered_chat(chat, tool_plan(chat, served.tool_call_parser),
                                          tokenizer)
    return {"count": len(token_ids), "max_model_len": served.max_model_len, "tokens": token_ids,
            "token_strs": tokenizer.token_strs(token_ids) if body.return_token_strs else None}


def detokenized(body: DetokenizeRequest, tokenizer: PromptTokenizer, served: ServedModel
                ) -> dict:
    """``/detokenize``'s answer; ``OpenAIError`` naming the field."""
    checked("model", check_model, body.model, served.name)
    checked("tokens", check_token_ids, body.tokens, served.vocab_size)
    return {"prompt": tokenizer.decode(body.tokens)}


def tokenize_routes(tokenizer: PromptTokenizer, served: ServedModel,
                    auth: Any) -> APIRouter:
    """``/tokenize`` and ``/detokenize``, behind the ``auth`` dependency."""
    routes = APIRouter(dependencies=[Depends(auth)])

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await asyncio.to_thread(tokenized, body, tokenizer, served)

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await asyncio.to_thread(detokenized, body, tokenizer, served)

    return routes
