"""Anthropic-style ``cache_control`` breakpoints on the HTTP fronts: where a request marks its
prompt, checked, and the leases the marks ask the KV store for.

A breakpoint ``{"type": "ephemeral", "ttl": "5m" | "1h"}`` (unset ttl: 5m) makes the prompt up to
the end of what it marks a leased prefix with that TTL (``sessions.breakpoint_lease``). Marks stand
where Anthropic places them: on a content block (a message's, a ``system`` block, a tool
definition; a text block inside a ``tool_result`` marks the whole result) or on the request (its
whole conversation); on the OpenAI chat route, on a message, one of its content parts or a tool
(an extra field Baton reads). At most ``MAX_BREAKPOINTS`` per request, as Anthropic allows.

Marks are listed in Anthropic's order (tools, ``system``, messages, the request's own) and, as
Anthropic requires, a longer TTL never follows a shorter one: a "1h" mark after a "5m" one is a
400 naming both.

Where a mark stands in tokens is measured, never guessed: the conversation cut at the mark
(``Breakpoint.turns``) is rendered with the request's tools under the same chat template, without
the generation prompt, and tokenized; its longest common prefix with the whole prompt's token ids
is the leased length. So a lease never covers a token the prompt does not have, and a mark whose
cut renders to nothing the prompt shares is a 400 (the breakpoint lies outside the prompt).

A mark on ``tools[i]`` leases the prompt through the first i + 1 tools' definitions: the cut is
the system turn (or none) rendered with ``tools[:i + 1]``. Baton's default preamble and templates
like Qwen's render the tools last in the system turn, after the system prompt, so for the last
tool that prefix is the system prompt, the tools and the turn's closing tokens, and for an
earlier one it ends where the next tool's definition begins. (A template that wrote the system
prompt after the tools in that turn would lease the system prompt too.) A template that puts the
tools elsewhere (Llama 3.1's first user message) cannot render that cut, or renders no tools in
it; then the whole conversation is rendered with ``tools[:i + 1]`` and with one more (probe)
tool, and the lease ends where the two diverge, where another tool's definition would begin:
never past the marked tools' text, though short of the template's closing text after the last
tool (``_tool_mark_len_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gateway.anthropic_models import (
    CountTokensRequest,
    Message,
    ToolResultBlock,
    joined,
)
from gateway.anthropic_models import ToolSpec as AnthropicToolSpec
from gateway.anthropic_requests import _assistant_turn, _user_turns
from gateway.openai_models import ChatMessage, ToolSpec
from gateway.sessions import (
    CACHE_CONTROL_TTLS_S,
    InvalidField,
    breakpoint_lease,
    cache_control_ttl_s,
)
from gateway.tokenization import PromptTokenizer
from gateway.tool_calls import EMPTY_PARAMETERS, Tool, ToolPlan, Turn, render
from protos.errors import InvalidRequest
from protos.wire import Lease

MAX_BREAKPOINTS = 4
"""Anthropic's limit of ``cache_control`` breakpoints per request."""
CACHE_CONTROL_KEYS = frozenset({"type", "ttl"})
PROBE_TOOL = Tool("baton_cache_control_probe", "", EMPTY_PARAMETERS)
"""A tool rendered after a tool mark's tools to find where their definitions end."""


@dataclass(frozen=True)
class Breakpoint:
    """One ``cache_control`` mark, checked: where it stands and what it leases."""

    field: str
    """The mark's place in the body, as errors name it ("messages[2].content[0].cache_control")."""
    ttl_s: float
    turns: tuple[Turn, ...]
    """The conversation up to the end of what it marks (a tool mark: the system turn, or none)."""
    num_tools: int | None = None
    """A mark on ``tools[i]``: i + 1, the tools it covers (None: not a tool mark)."""
    conversation: tuple[Turn, ...] = ()
    """A tool mark's whole conversation, for templates that render tools outside the system
    turn."""


def checked_ttl_s(cache_control: object, field: str) -> float:
    """The TTL in seconds of one ``cache_control`` value; ``InvalidField`` naming ``field``."""
    if not isinstance(cache_control, dict):
        raise InvalidField(f"{field} must be an object {{\"type\": \"ephemeral\", \"ttl\"?: "
                           f"\"5m\" | \"1h\"}}, got {type(cache_control).__name__}", field)
    unknown = sorted(set(cache_control) - CACHE_CONTROL_KEYS)
    if unknown:
        raise InvalidField(f"{field} has unknown keys {unknown}; it takes type and ttl", field)
    if cache_control.get("type") != "ephemeral":
        raise InvalidField(f"{field}.type must be 'ephemeral', got "
                           f"{cache_control.get('type')!r}", f"{field}.type")
    ttl = cache_control.get("ttl")
    try:
        return cache_control_ttl_s(ttl, f"{field}.ttl")
    except (InvalidRequest, TypeError) as e:  # TypeError: an unhashable ttl (a list, an object)
        raise InvalidField(f"{field}.ttl must be one of ['1h', '5m'], got {ttl!r}",
                           f"{field}.ttl") from e


def _ttl_name(ttl_s: float) -> str:
    return next(name for name, seconds in CACHE_CONTROL_TTLS_S.items() if seconds == ttl_s)


def _checked(marks: list[Breakpoint]) -> list[Breakpoint]:
    """``marks`` (in Anthropic's order), or ``InvalidField`` for a fifth mark or a longer TTL
    after a shorter one."""
    if len(marks) > MAX_BREAKPOINTS:
        where = ", ".join(mark.field for mark in marks)
        raise InvalidField(f"{marks[MAX_BREAKPOINTS].field}: at most {MAX_BREAKPOINTS} "
                           f"cache_control breakpoints per request, got {len(marks)} ({where})",
                           marks[MAX_BREAKPOINTS].field)
    for number, mark in enumerate(marks):
        shorter = next((earlier for earlier in marks[:number] if earlier.ttl_s < mark.ttl_s),
                       None)
        if shorter is not None:
            raise InvalidField(
                f"{mark.field}: a ttl='{_ttl_name(mark.ttl_s)}' cache_control breakpoint must "
                f"not come after the ttl='{_ttl_name(shorter.ttl_s)}' one at {shorter.field}; "
                "longer TTLs come first, in the order tools, system, messages: lengthen the "
                "earlier one or shorten this one", mark.field)
    return marks


def _tool_marks(specs: Sequence[ToolSpec | AnthropicToolSpec], system_turns: tuple[Turn, ...],
                conversation: Sequence[Turn]) -> list[Breakpoint]:
    """The marks on a request's tool definitions, whose tools render with ``system_turns``
    (``Breakpoint.turns``) in ``conversation``."""
    marks = []
    for index, spec in enumerate(specs):
        if spec.cache_control is not None:
            field = f"tools[{index}].cache_control"
            marks.append(Breakpoint(field, checked_ttl_s(spec.cache_control, field),
                                    system_turns, index + 1, tuple(conversation)))
    return marks


def openai_breakpoints(messages: Sequence[ChatMessage], turns: Sequence[Turn],
                       tools: Sequence[ToolSpec] = ()) -> list[Breakpoint]:
    """The marks of an OpenAI chat body, in Anthropic's order (its ``tools``, then its
    messages); ``turns`` are its messages' turns (one per message, as ``openai_requests`` made
    them)."""
    assert len(turns) == len(messages), "an OpenAI chat message is one turn"
    system_turns = tuple(turns[:1]) if turns and turns[0].role == "system" else ()
    marks = _tool_marks(tools, system_turns, turns)
    for index, message in enumerate(messages):
        parts = message.content if isinstance(message.content, list) else []
        for number, part in enumerate(parts):
            if part.cache_control is not None:
                field = f"messages[{index}].content[{number}].cache_control"
                cut = replace(turns[index], content="".join(p.text for p in parts[:number + 1]))
                marks.append(Breakpoint(field, checked_ttl_s(part.cache_control, field),
                                        (*turns[:index], cut)))
        if message.cache_control is not None:
            field = f"messages[{index}].cache_control"
            marks.append(Breakpoint(field, checked_ttl_s(message.cache_control, field),
                                    tuple(turns[:index + 1])))
    return _checked(marks)


def _message_turns(message: Message, where: str) -> list[Turn]:
    """A message's turns as ``anthropic_requests.conversation`` makes them."""
    if isinstance(message.content, str):
        return [Turn(message.role, message.content)]
    if message.role == "user":
        return _user_turns(message.content, where)
    return [_assistant_turn(message.content, where)]


def _block_mark(block) -> object | None:
    """A block's own ``cache_control``, or a ``tool_result``'s inner text block's (which marks
    the whole result)."""
    if block.cache_control is not None or not isinstance(block, ToolResultBlock):
        return block.cache_control
    inner = block.content if isinstance(block.content, list) else []
    return next((text.cache_control for text in inner if text.cache_control is not None), None)


def anthropic_breakpoints(body: CountTokensRequest) -> list[Breakpoint]:
    """The marks of a Messages body, in prompt order: tools, ``system`` blocks, the messages'
    blocks, then the request's own (its whole conversation)."""
    system = body.system
    system_turns: tuple[Turn, ...] = ()
    if system:
        system_turns = (Turn("system", system if isinstance(system, str) else joined(system)),)
    marks = []
    for number, block in enumerate(system if isinstance(system, list) else []):
        if block.cache_control is not None:
            field = f"system[{number}].cache_control"
            marks.append(Breakpoint(field, checked_ttl_s(block.cache_control, field),
                                    (Turn("system", joined(system[:number + 1])),)))
    before = list(system_turns)
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        for number, block in enumerate(message.content if isinstance(message.content, list)
                                       else []):
            mark = _block_mark(block)
            if mark is not None:
                field = f"{where}.content[{number}].cache_control"
                cut = message.model_copy(update={"content": message.content[:number + 1]})
                marks.append(Breakpoint(field, checked_ttl_s(mark, field),
                                        (*before, *_message_turns(cut, where))))
        before += _message_turns(message, where)
    if body.cache_control is not None:
        marks.append(Breakpoint("cache_control", checked_ttl_s(body.cache_control,
                                                               "cache_control"), tuple(before)))
    return _checked([*_tool_marks(body.tools or (), system_turns, before), *marks])


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    num_tokens = 0
    for x, y in zip(a, b):
        if x != y:
            break
        num_tokens += 1
    return num_tokens


def _cut_ids(turns: Sequence[Turn], plan: ToolPlan | None, tokenizer: PromptTokenizer
             ) -> list[int]:
    """Token ids of ``turns`` with ``plan``'s tools, without the generation prompt ([] when
    that renders no message); ``InvalidRequest`` when the template refuses it."""
    rendered = render(list(turns), plan, tokenizer.renders_tools)
    if not rendered.messages:  # Hugging Face renders no conversation without a message
        return []
    return tokenizer.encode_conversation(rendered.messages, rendered.tools,
                                         add_generation_prompt=False)


def _tool_mark_len_tokens(mark: Breakpoint, plan: ToolPlan, tokenizer: PromptTokenizer,
                          prompt_token_ids: Sequence[int]) -> int:
    """Prompt tokens through the tools a tool mark covers (see the module docstring)."""
    assert mark.num_tools is not None and 0 < mark.num_tools <= len(plan.tools)
    covered = replace(plan, tools=plan.tools[:mark.num_tools])
    try:
        before = common_prefix_len(_cut_ids(mark.turns, replace(
            plan, tools=plan.tools[:mark.num_tools - 1]), tokenizer), prompt_token_ids)
        through = common_prefix_len(_cut_ids(mark.turns, covered, tokenizer), prompt_token_ids)
        if through > before:  # the marked tool renders in the system turn
            return through
    except InvalidRequest:
        pass  # the template renders the tools outside a system-only conversation
    probed = replace(plan, tools=(*covered.tools, PROBE_TOOL))
    try:
        cut_ids = _cut_ids(mark.conversation, covered, tokenizer)
        probe_ids = _cut_ids(mark.conversation, probed, tokenizer)
    except InvalidRequest as e:
        raise InvalidField(f"{mark.field}: the chat template cannot render the conversation "
                           f"with the tools up to this breakpoint ({e})", mark.field) from e
    if cut_ids == probe_ids:
        raise InvalidField(f"{mark.field}: the chat template renders no tools into the prompt, "
                           "so this breakpoint marks nothing; mark a message instead",
                           mark.field)
    return min(common_prefix_len(cut_ids, probe_ids),
               common_prefix_len(cut_ids, prompt_token_ids))


def breakpoint_len_tokens(mark: Breakpoint, plan: ToolPlan | None, tokenizer: PromptTokenizer,
                          prompt_token_ids: Sequence[int]) -> int:
    """Prompt tokens up to ``mark`` (see the module docstring)."""
    if mark.num_tools is not None:
        assert plan is not None, "a tool mark comes with the request's tools"
        return _tool_mark_len_tokens(mark, plan, tokenizer, prompt_token_ids)
    try:
        cut_ids = _cut_ids(mark.turns, plan, tokenizer)
    except InvalidRequest as e:
        raise InvalidField(f"{mark.field}: the chat template cannot render the conversation "
                           f"up to this breakpoint ({e})", mark.field) from e
    return common_prefix_len(cut_ids, prompt_token_ids)


def breakpoint_leases(marks: Sequence[Breakpoint], plan: ToolPlan | None,
                      tokenizer: PromptTokenizer, prompt_token_ids: Sequence[int], tenant: str
                      ) -> tuple[Lease, ...]:
    """One lease per distinct leased prefix (two marks on one prefix: the longer TTL)."""
    leases: dict[str, Lease] = {}
    for mark in marks:
        num_tokens = breakpoint_len_tokens(mark, plan, tokenizer, prompt_token_ids)
        try:
            lease = breakpoint_lease(tenant, prompt_token_ids, num_tokens, mark.ttl_s)
        except InvalidRequest as e:
            raise InvalidField(f"{mark.field}: {e}", mark.field) from e
        known = leases.get(lease.lease_id)
        if known is None or known.ttl_s < lease.ttl_s:
            leases[lease.lease_id] = lease
    return tuple(leases.values())
