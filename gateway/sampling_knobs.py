"""The sampling knobs beyond temperature and top_p that vLLM's sampler serves and the peers'
fronts pass on: ``top_k``, ``min_p``, the three penalties, ``min_tokens`` and ``logit_bias``.

Contract: ``checked_knobs`` takes the values as a front received them (None: unset) and the
names that front spells them with, and returns ``SamplingOptions``'s fields or raises
``InvalidField`` naming the first bad one (the HTTP fronts answer it in ``param``, gRPC in the
INVALID_ARGUMENT details). The ranges are vLLM's own (``SamplingParams._verify_args``), checked
here so that a bad value is a 400 before placement, never an engine's rejection after it;
``min_tokens`` is checked against the request's resolved ``max_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from gateway.sessions import InvalidField

MAX_PENALTY = 2.0
"""OpenAI's and vLLM's bound on presence and frequency penalties (either sign)."""
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on one token's bias (either sign): +-100 bans or forces a token."""
MAX_LOGIT_BIAS_TOKENS = 1024
"""The most biased tokens one request may carry: it keeps a request's wire size small."""


@dataclass(frozen=True)
class KnobNames:
    """How a front spells each knob (the field named in its errors)."""

    top_k: str = "top_k"
    min_p: str = "min_p"
    presence_penalty: str = "presence_penalty"
    frequency_penalty: str = "frequency_penalty"
    repetition_penalty: str = "repetition_penalty"
    min_tokens: str = "min_tokens"
    logit_bias: str = "logit_bias"


OPENAI_NAMES = KnobNames()
GRPC_NAMES = KnobNames(*(f"sampling.{name}" for name in KnobNames().__dict__))


def _number(name: str, value: object, field: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidField(f"{name} must be a finite number, got {value!r}", field or name)
    return float(value)


def _top_k(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise InvalidField(f"{name} must be an integer: a count of tokens >= 1, or 0 or -1 for "
                           f"all of them, got {value!r}", name)
    return max(0, value)


def _in_range(name: str, value: object, low: float, high: float, hint: str,
              field: str | None = None) -> float:
    """``value`` as a float in [low, high]; ``field`` (default ``name``) is the field the error
    names, ``name`` what its message calls the value."""
    number = _number(name, value, field)
    if not low <= number <= high:
        raise InvalidField(f"{name} must be in [{low:g}, {high:g}], got {value!r}; {hint}",
                           field or name)
    return number


def _repetition_penalty(name: str, value: object) -> float:
    number = _number(name, value)
    if number <= 0:
        raise InvalidField(f"{name} must be greater than 0 (1 is no penalty, above 1 penalizes "
                           f"repeats), got {value!r}", name)
    return number


def _min_tokens(name: str, value: object, max_tokens: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max_tokens:
        raise InvalidField(f"{name} must be an integer from 0 to the request's max_tokens "
                           f"({max_tokens}), got {value!r}", name)
    return value


def _logit_bias(name: str, value: object, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """Token ids as ints (OpenAI's JSON spells them as strings), sorted; biases in range."""
    if not isinstance(value, Mapping):
        raise InvalidField(f"{name} must be an object mapping token ids to biases, got "
                           f"{type(value).__name__}", name)
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidField(f"{name} biases {len(value)} tokens; at most "
                           f"{MAX_LOGIT_BIAS_TOKENS} are accepted", name)
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            token_id = -1
        if isinstance(key, bool) or not 0 <= token_id < vocab_size or str(token_id) != str(key):
            raise InvalidField(f"{name} key {key!r} is not a token id of the served model "
                               f"(0 to {vocab_size - 1})", name)
        pairs[token_id] = _in_range(f"{name}[{key!r}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS,
                                    "-100 bans the token, 100 all but forces it", name)
    return tuple(sorted(pairs.items()))


def checked_knobs(*, max_tokens: int, vocab_size: int, names: KnobNames = OPENAI_NAMES,
                  top_k: object = None, min_p: object = None, presence_penalty: object = None,
                  frequency_penalty: object = None, repetition_penalty: object = None,
                  min_tokens: object = None, logit_bias: object = None) -> dict:
    """``SamplingOptions``'s knob fields for the values given (None: unset, the neutral
    value); ``InvalidField`` naming the first bad one."""
    knobs: dict = {}
    if top_k is not None:
        knobs["top_k"] = _top_k(names.top_k, top_k)
    if min_p is not None:
        knobs["min_p"] = _in_range(names.min_p, min_p, 0.0, 1.0,
                                   "0 keeps every token, 0.05 drops those under 5% of the top")
    if presence_penalty is not None:
        knobs["presence_penalty"] = _in_range(names.presence_penalty, presence_penalty,
                                              -MAX_PENALTY, MAX_PENALTY, "0 is no penalty")
    if frequency_penalty is not None:
        knobs["frequency_penalty"] = _in_range(names.frequency_penalty, frequency_penalty,
                                               -MAX_PENALTY, MAX_PENALTY, "0 is no penalty")
    if repetition_penalty is not None:
        knobs["repetition_penalty"] = _repetition_penalty(names.repetition_penalty,
                                                          repetition_penalty)
    if min_tokens is not None:
        knobs["min_tokens"] = _min_tokens(names.min_tokens, min_tokens, max_tokens)
    if logit_bias is not None:
        knobs["logit_bias"] = _logit_bias(names.logit_bias, logit_bias, vocab_size)
    return knobs
