"""Log-probabilities in OpenAI's two shapes, from the engine's ``PositionLogprobs``.

Contract: pure functions of the positions a chunk (or a whole answer) carries. Chat
(``logprobs: true``, ``top_logprobs: k``) answers ``{"content": [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}, ... k of them, best first]}]}``; completions
(``logprobs: k``) answer ``{tokens, token_logprobs, top_logprobs: [{token: logprob}, ...],
text_offset}``, each position's map holding the k most likely tokens and the chosen one (so up
to k + 1, as OpenAI's); with ``echo``, the prompt's tokens first. Like vLLM's server, ``-inf`` is written as -9999.0 (JSON has no
infinity) and ``text_offset`` counts the characters of the tokens before, from the start of the
answer.
"""

from __future__ import annotations

from typing import Iterable

from protos.wire import PositionLogprobs, TokenLogprob

MIN_LOGPROB = -9999.0
"""What a log-probability of -inf is written as."""


def _logprob(entry: TokenLogprob) -> float:
    return max(entry.logprob, MIN_LOGPROB)


def _chat_entry(entry: TokenLogprob) -> dict:
    return {"token": entry.token, "logprob": _logprob(entry),
            "bytes": list(entry.token.encode("utf-8", errors="replace"))}


def chat_logprobs(positions: Iterable[PositionLogprobs]) -> dict:
    """A chat choice's (or chunk choice's) ``logprobs``."""
    return {"content": [
        _chat_entry(position.chosen) | {"top_logprobs": [_chat_entry(top) for top in position.top]}
        for position in positions
    ]}


def completion_logprobs(positions: Iterable[PositionLogprobs], first_offset: int = 0,
                        first_prompt_token: str | None = None) -> tuple[dict, int]:
    """A completion choice's ``logprobs``, its first token at character ``first_offset`` of the
    answer; and the offset after its last token (where the next chunk's first one starts).
    With ``echo`` the answer starts with the prompt: ``first_prompt_token`` (the prompt's first
    token, which has no log-probability: ``null`` in ``token_logprobs`` and ``top_logprobs``, as
    OpenAI's and vLLM's) comes first, then ``positions`` (the prompt's other tokens, then the
    answer's)."""
    tokens, token_logprobs, top_logprobs, text_offsets = [], [], [], []
    offset = first_offset
    if first_prompt_token is not None:
        tokens.append(first_prompt_token)
        token_logprobs.append(None)
        top_logprobs.append(None)
        text_offsets.append(offset)
        offset += len(first_prompt_token)
    for position in positions:
        chosen = position.chosen
        tokens.append(chosen.token)
        token_logprobs.append(_logprob(chosen))
        top = {entry.token: _logprob(entry) for entry in position.top}
        top.setdefault(chosen.token, _logprob(chosen))
        top_logprobs.append(top)
        text_offsets.append(offset)
        offset += len(chosen.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offsets}, offset
