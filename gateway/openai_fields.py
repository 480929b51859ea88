"""Which OpenAI request fields the HTTP front serves, and the refusal of every other one.

Contract: a body field is either

- served: declared on the request model (``gateway.openai_models``) and acted on;
- accepted only at the value that asks for nothing (``NEUTRAL``): ``functions: []``,
  ``echo: false``, ``best_of: 1``, ...;
- or refused with 400 naming it (``param``), saying whether Baton does not serve it yet or does
  not know it at all.

So nothing a client asks for is silently ignored: a client that sends ``best_of: 4`` learns at
once that this server will not apply it, instead of trusting output it never shaped. The table is also the documented list of supported fields (docs/operating.md).
"""

from __future__ import annotations

from typing import Any

from gateway.openai_errors import OpenAIError, error_for
from protos.errors import InvalidRequest

_NOTHING = (None,)

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (None, 0),
    "tools": (None, ()),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, ()),
    "function_call": (None, "none"),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "store": (None, False),
    "metadata": _NOTHING,
    "modalities": (None, ("text",)),
    "service_tier": (None, "auto", "default"),
}
"""Fields Baton does not act on, with the values that ask for nothing (accepted as if unsent).
``logprobs``, ``top_logprobs``, ``response_format``, ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (chat) are served (``gateway.openai_requests``); the completions
endpoint has no ``top_logprobs`` (its ``logprobs`` is the count) and no tools, and serves
``echo``, which chat does not."""

NOT_SERVED_HINT: dict[str, str] = {
    "top_logprobs": "top_logprobs is the chat endpoint's; on /v1/completions send logprobs: k "
                    "(0 to 5) for the k most likely tokens of each position",
    "tools": "tool calling is served on /v1/chat/completions, not here",
    "tool_choice": "tool calling is served on /v1/chat/completions, not here",
    "parallel_tool_calls": "tool calling is served on /v1/chat/completions, not here",
    "functions": "the deprecated functions field is not served; send the functions as tools",
    "function_call": "the deprecated function_call is not served; use tool_choice",
    "echo": "echo is served on /v1/completions, not here",
    "best_of": "best_of is not served; only 1 is accepted",
    "suffix": "suffix (insertion) is not served; only an empty suffix is accepted",
    "store": "stored completions are not served; only false is accepted",
    "metadata": "stored completions are not served; send no metadata",
    "modalities": "only the text modality is served",
    "service_tier": "service tiers are not served; only 'auto' or 'default' is accepted",
}


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    for candidate in allowed:
        if isinstance(candidate, tuple):
            if isinstance(value, list) and tuple(value) == candidate:
                return True
        elif isinstance(candidate, bool) or isinstance(value, bool):
            if value is candidate:
                return True
        elif value == candidate:
            return True
    return False


def refused_field(extra_fields: dict[str, Any] | None,
                  neutral: dict[str, tuple[Any, ...]] = NEUTRAL,
                  hints: dict[str, str] = NOT_SERVED_HINT) -> OpenAIError | None:
    """The 400 for the first body field the front would otherwise ignore, or None.

    ``extra_fields`` are the body's fields the request model does not declare (pydantic's
    ``model_extra``), in the order the client sent them; ``neutral`` and ``hints`` are the
    route's table (default: the chat and completions routes'; ``gateway.responses_requests``
    has the Responses route's)."""
    for name, value in (extra_fields or {}).items():
        allowed = neutral.get(name)
        if allowed is not None:
            if _neutral(value, allowed):
                continue
            message = (f"{name}={value!r} is not supported by this server: "
                       f"{hints[name]} (Baton refuses a request rather than ignore a "
                       "field of it)")
        else:
            message = (f"unknown field '{name}'; see the supported fields in Baton's "
                       "docs/operating.md (Baton refuses a request rather than ignore a field "
                       "of it)")
        return error_for(InvalidRequest(message), name)
    return None
