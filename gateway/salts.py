"""Segmented salts at the fronts: from which token of the prompt a request's ``cache_salt``
applies (``EngineRequest.cache_salt_offset``).

A tenant's requests often share a public trunk (a system prompt, tool definitions) and differ
after it. With a salt from the trunk's end on, the store and the conductor's index key the trunk
unsalted (shared by every tenant, served from the store's host tier) and everything after it
salted (``kvstore.keys``: segmented salts). vLLM's own prefix cache keeps the whole-prompt salt.

The offset is given as a token offset (``cache_salt_offset``, gRPC and HTTP) or, on the chat
fronts, as a message index (``cache_salt_from_message``): the salt applies from the first token
of that message in the rendered prompt. That token is found by rendering the messages before it
with the same chat template and tools and taking the longest common prefix with the whole
prompt's tokens: where a template renders a shorter conversation differently, the offset only
moves earlier (more of the prompt salted), never into another tenant's reach.

Pure functions: the fronts call them once the prompt is tokenized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.openai_errors import error_for
from gateway.tokenization import PromptTokenizer
from gateway.tool_calls import ToolPlan, Turn, render
from protos.errors import InvalidRequest

OFFSET_FIELD = "cache_salt_offset"
MESSAGE_FIELD = "cache_salt_from_message"


def check_salt_offset(offset: int | None, cache_salt: str, num_prompt_tokens: int,
                      field: str = OFFSET_FIELD) -> int:
    """The token offset from which ``cache_salt`` applies (0 when unset: the whole prompt);
    ``InvalidRequest`` naming ``field`` when it is not in ``[0, num_prompt_tokens]`` or there
    is no salt to apply."""
    if offset is None:
        return 0
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise InvalidRequest(f"{field} must be an integer token offset, got {offset!r}")
    if not cache_salt:
        raise InvalidRequest(f"{field} is set but the request has no cache_salt; send the salt "
                             f"to apply from that offset, or drop {field}")
    if not 0 <= offset <= num_prompt_tokens:
        raise InvalidRequest(f"{field} must be a token offset from 0 to the prompt's "
                             f"{num_prompt_tokens} tokens, got {offset}")
    return offset


def check_message_index(index: int, cache_salt: str, num_messages: int,
                        field: str = MESSAGE_FIELD) -> int:
    """``index`` when it names one of the ``num_messages`` messages and there is a salt;
    ``InvalidRequest`` naming ``field`` otherwise."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise InvalidRequest(f"{field} must be an integer message index, got {index!r}")
    if not cache_salt:
        raise InvalidRequest(f"{field} is set but the request has no cache_salt; send the salt "
                             f"to apply from that message, or drop {field}")
    if not 0 <= index < num_messages:
        raise InvalidRequest(f"{field} must index one of the {num_messages} messages "
                             f"(0 to {num_messages - 1}), got {index}")
    return index


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def message_salt_offset(turns: list[Turn], first_turn: int, plan: ToolPlan | None,
                        tokenizer: PromptTokenizer, prompt_token_ids: Sequence[int]) -> int:
    """The token offset at which ``turns[first_turn]`` starts in ``prompt_token_ids`` (the
    whole conversation rendered with ``plan``'s tools): the longest common prefix with the turns
    before it, rendered alike without a generation prompt. ``InvalidRequest`` when the chat
    template refuses that shorter conversation."""
    if first_turn == 0:
        return 0
    rendered = render(turns[:first_turn], plan, tokenizer.renders_tools)
    before = tokenizer.encode_conversation(rendered.messages, rendered.tools,
                                           add_generation_prompt=False)
    return common_prefix_len(before, prompt_token_ids)


def http_salt_offset(offset: int | None, from_message: int | None, cache_salt: str,
                     num_prompt_tokens: int, num_messages: int,
                     offset_of_message: Callable[[int], int]) -> int:
    """``EngineRequest.cache_salt_offset`` of an HTTP body: its ``cache_salt_offset``, or the
    offset of message ``cache_salt_from_message`` (``offset_of_message``), 0 with neither.
    Raises ``OpenAIError`` (400) naming the offending field; both at once is refused."""
    if from_message is None:
        try:
            return check_salt_offset(offset, cache_salt, num_prompt_tokens)
        except InvalidRequest as e:
            raise error_for(e, OFFSET_FIELD) from e
    try:
        if offset is not None:
            raise InvalidRequest(f"{OFFSET_FIELD} and {MESSAGE_FIELD} both say where the salt "
                                 "starts; send one of them")
        return offset_of_message(check_message_index(from_message, cache_salt, num_messages))
    except InvalidRequest as e:
        raise error_for(e, MESSAGE_FIELD) from e
