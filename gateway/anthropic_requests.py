"""The Anthropic Messages front's request checks: a ``/v1/messages`` body to the
``EngineRequest`` workers run, checked like the OpenAI front's (the same checks, shared from
``gateway.openai_requests``), so both fronts accept and refuse the same requests.

Mapping onto the front-neutral conversation (``gateway.tool_calls``):

* ``system`` (a string or text blocks) is the first, system turn;
* a user message's text is a user turn, each ``tool_result`` block a tool turn answering its
  ``tool_use_id`` (``is_error`` renders its content after ``Error: ``), in the blocks' order;
* an assistant message's text and ``tool_use`` blocks are one assistant turn with those calls;
* ``tools`` are the functions; ``tool_choice`` ``auto``/``any``/``tool``/``none`` are the plan's
  auto/required/named/none, ``disable_parallel_tool_use`` its ``parallel=False``.

Contract: ``prepare_message`` returns a ``Prepared`` the router may place, or raises
``OpenAIError`` naming the offending field (``gateway.anthropic_errors`` re-spells it). A field
Baton does not serve is refused by name, never ignored: any undeclared top-level field (with a
hint for Anthropic's own: ``thinking``, ``mcp_servers``, ...). A last message from the assistant
is a prefill, as Anthropic serves it: the prompt leaves it open and the answer is its
continuation (text only, no trailing whitespace, not with a forced tool).
"""

from __future__ import annotations

from typing import Any, Callable

from gateway.anthropic_models import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    joined,
)
from gateway.openai_errors import error_for
from gateway.openai_requests import (
    Prepared,
    ServedModel,
    chat_prompt,
    checked,
    checked_length,
    checked_options,
    forced_constraint,
    with_salt_offset,
)
from gateway.salts import message_salt_offset
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

MODES: dict[str, ChoiceMode] = {"auto": "auto", "any": "required", "tool": "named",
                                "none": "none"}
"""Anthropic's ``tool_choice.type`` → the plan's mode."""
NOT_SERVED_HINT = {
    "thinking": "extended thinking is not served",
    "mcp_servers": "MCP servers are not served; run the tools on the client and send them as "
                   "tools",
    "container": "code-execution containers are not served",
    "context_management": "context management is not served; send the conversation to keep",
    "output_config": "output_config is not served; for JSON held to a schema, send a tool and "
                     "tool_choice {\"type\": \"tool\", \"name\": ...}",
    "service_tier": "service tiers are not served",
}


def _refuse_extra(extra_fields: dict[str, Any] | None) -> None:
    """A 400 naming the first field the body model does not declare, if any."""
    name = next(iter(extra_fields or {}), None)
    if name is None:
        return
    reason = NOT_SERVED_HINT.get(name, "unknown field; see the supported fields in Baton's "
                                 "docs/operating.md (Anthropic Messages API)")
    raise error_for(InvalidRequest(f"{name}: {reason} (Baton refuses a request rather than "
                                   "ignore a field of it)"), name)


def _choice(body: CountTokensRequest) -> tuple[ChoiceMode, str, bool]:
    """(mode, tool name, parallel) of ``tool_choice``; unset: auto with tools, none without."""
    choice = body.tool_choice
    if choice is None:
        return ("auto" if body.tools else "none"), "", True
    if choice.type == "tool" and not choice.name:
        raise InvalidRequest("tool_choice of type 'tool' needs the name of the tool to call")
    return MODES[choice.type], choice.name or "", not choice.disable_parallel_tool_use


def tool_plan(body: CountTokensRequest, parser: str) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None without tools); ``OpenAIError`` naming the field."""
    tools = [checked("tools", checked_tool, spec.name, spec.description, spec.input_schema,
                     f"tools[{index}]")
             for index, spec in enumerate(body.tools or ())]
    mode, named, parallel = checked("tool_choice", _choice, body)
    param = "tool_choice" if mode in ("required", "named") else "tools"
    return checked(param, checked_plan, tools, mode, named, parallel, parser)


def _refuse_blocks(content: list, kind: type, where: str, belongs: str) -> None:
    for number, block in enumerate(content):
        if isinstance(block, kind):
            raise InvalidRequest(f"{where}.content[{number}]: a {block.type} block belongs in "
                                 f"{belongs}")


def _user_turns(content: list, where: str) -> list[Turn]:
    _refuse_blocks(content, ToolUseBlock, where, "an assistant message")
    turns: list[Turn] = []
    texts: list[TextBlock] = []
    for block in content:
        if isinstance(block, TextBlock):
            texts.append(block)
            continue
        if texts:
            turns.append(Turn("user", joined(texts)))
            texts = []
        result = block.text()
        turns.append(Turn("tool", f"Error: {result}" if block.is_error else result,
                          tool_call_id=block.tool_use_id))
    if texts or not turns:
        turns.append(Turn("user", joined(texts)))
    return turns


def _assistant_turn(content: list, where: str) -> Turn:
    _refuse_blocks(content, ToolResultBlock, where, "a user message")
    texts = [block for block in content if isinstance(block, TextBlock)]
    calls = tuple(
        ToolCall(block.id, block.name,
                 checked_arguments(block.input, f"{where}.content[{number}].input"))
        for number, block in enumerate(content) if isinstance(block, ToolUseBlock))
    return Turn("assistant", joined(texts), calls)


def conversation(system: str | list[TextBlock] | None, messages: list[Message]) -> list[Turn]:
    """The front-neutral turns of ``system`` and ``messages`` (see the module docstring)."""
    if not messages:
        raise InvalidRequest("messages is empty; send at least one message")
    last = messages[-1]
    if last.role == "assistant":  # a prefill: the model continues it (Anthropic's rule)
        text = last.content if isinstance(last.content, str) else joined(
            [block for block in last.content if isinstance(block, TextBlock)])
        if text != text.rstrip():
            raise InvalidRequest("final assistant content cannot end with trailing whitespace")
    turns = []
    if system:
        turns.append(Turn("system", system if isinstance(system, str) else joined(system)))
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, str):
            turns.append(Turn(message.role, content))
        elif message.role == "user":
            turns += _user_turns(content, f"messages[{index}]")
        else:
            turns.append(_assistant_turn(content, f"messages[{index}]"))
    return turns


def _prompt(body: CountTokensRequest, tokenizer: PromptTokenizer, plan: ToolPlan | None
            ) -> list[int]:
    """The prompt's token ids; a last message from the assistant is a prefill, left open for
    the model to continue."""
    turns = checked("messages", conversation, body.system, body.messages)
    return chat_prompt(turns, plan, tokenizer, "messages",
                       continue_final=body.messages[-1].role == "assistant")


def _message_salt_offset(body: CountTokensRequest, plan: ToolPlan | None,
                         tokenizer: PromptTokenizer, prompt_token_ids: list[int]
                         ) -> Callable[[int], int]:
    """Where ``messages[index]`` starts in the prompt: its first turn follows the system turn
    and the turns of the messages before it (``conversation``)."""
    def offset_of(index: int) -> int:
        first_turn = 1 if body.system else 0
        for number, message in enumerate(body.messages[:index]):
            content = message.content
            first_turn += len(_user_turns(content, f"messages[{number}]")) if (
                message.role == "user" and not isinstance(content, str)) else 1
        turns = conversation(body.system, body.messages)
        return message_salt_offset(turns, first_turn, plan, tokenizer, prompt_token_ids)
    return offset_of


def _checked_body(body: CountTokensRequest, served: ServedModel) -> ToolPlan | None:
    checked("model", check_model, body.model, served.name)
    _refuse_extra(body.model_extra)
    return tool_plan(body, served.tool_call_parser)


def count_tokens(body: CountTokensRequest, tokenizer: PromptTokenizer, served: ServedModel
                 ) -> int:
    """The prompt's length in tokens as ``/v1/messages`` would render it, tools included."""
    return len(_prompt(body, tokenizer, _checked_body(body, served)))


def prepare_message(body: MessagesRequest, tokenizer: PromptTokenizer, served: ServedModel,
                    request_id: str = "") -> Prepared:
    """Checks a ``/v1/messages`` body; cheap checks first, then tokenization. A forced call
    (``any``, ``tool``) becomes the output's grammar (``forced_constraint``: refused at the front
    when the structured-output backend cannot enforce it)."""
    plan = _checked_body(body, served)
    options = checked_options(body.temperature, body.top_p, "stop_sequences",
                              body.stop_sequences or [], body.cache_salt, body.tenant, request_id)
    prompt_token_ids = _prompt(body, tokenizer, plan)
    max_tokens = checked_length(prompt_token_ids, "messages", body.max_tokens, "max_tokens",
                                served)
    options = with_salt_offset(options, body.cache_salt_offset, body.cache_salt_from_message,
                               prompt_token_ids, len(body.messages),
                               _message_salt_offset(body, plan, tokenizer, prompt_token_ids))
    try:
        knobs = checked_knobs(max_tokens=max_tokens, vocab_size=served.vocab_size,
                              top_k=body.top_k)
    except InvalidField as e:
        raise error_for(e, e.field) from e
    json_schema = forced_constraint(plan, served, "tools[].input_schema")
    return Prepared(options.engine_request(prompt_token_ids, max_tokens,
                                           json_schema=json_schema, knobs=knobs), plan)
