"""The sampling knobs (top_k, min_p, penalties, min_tokens, logit_bias): checked by one
function for every front, with the field named as the front spells it."""

from __future__ import annotations

import pytest

from gateway.live_router import continuation
from gateway.sampling_knobs import (
    GRPC_NAMES,
    MAX_LOGIT_BIAS_TOKENS,
    OPENAI_NAMES,
    checked_knobs,
)
from gateway.sessions import InvalidField
from protos.wire import EngineRequest, SamplingOptions
from tests.unit.test_validation import build, make_request, tokenizer  # noqa: F401

VOCAB = 100


def test_unset_knobs_leave_the_neutral_defaults():
    assert checked_knobs(max_tokens=8, vocab_size=VOCAB) == {}
    assert SamplingOptions(max_tokens=8) == SamplingOptions(
        max_tokens=8, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
        repetition_penalty=1.0, min_tokens=0, logit_bias=())


def test_checked_values_are_sampling_options_fields():
    knobs = checked_knobs(max_tokens=8, vocab_size=VOCAB, top_k=-1, min_p=0.5,
                          presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5,
                          min_tokens=8, logit_bias={"42": 3, "7": -100.0})
    assert knobs == {"top_k": 0, "min_p": 0.5, "presence_penalty": -2.0,
                     "frequency_penalty": 2.0, "repetition_penalty": 0.5, "min_tokens": 8,
                     "logit_bias": ((7, -100.0), (42, 3.0))}
    assert SamplingOptions(max_tokens=8, **knobs).logit_bias == ((7, -100.0), (42, 3.0))


@pytest.mark.parametrize("knob, value, field, fragment", [
    ("top_k", -2, "top_k", "a count of tokens >= 1, or 0 or -1"),
    ("top_k", 2.5, "top_k", "must be an integer"),
    ("top_k", True, "top_k", "must be an integer"),
    ("min_p", -0.1, "min_p", "must be in [0, 1]"),
    ("min_p", float("nan"), "min_p", "must be a finite number"),
    ("presence_penalty", 2.01, "presence_penalty", "must be in [-2, 2]"),
    ("frequency_penalty", float("inf"), "frequency_penalty", "must be a finite number"),
    ("repetition_penalty", 0.0, "repetition_penalty", "must be greater than 0"),
    ("min_tokens", 9, "min_tokens", "from 0 to the request's max_tokens (8)"),
    ("min_tokens", -1, "min_tokens", "from 0 to the request's max_tokens (8)"),
    ("logit_bias", [1, 2], "logit_bias", "must be an object mapping token ids"),
    ("logit_bias", {"100": 1}, "logit_bias", "key '100' is not a token id of the served model"),
    ("logit_bias", {"-1": 1}, "logit_bias", "key '-1' is not a token id"),
    ("logit_bias", {"07": 1}, "logit_bias", "key '07' is not a token id"),
    ("logit_bias", {"5": 100.5}, "logit_bias", "logit_bias['5'] must be in [-100, 100]"),
    ("logit_bias", {"5": "x"}, "logit_bias", "logit_bias['5'] must be a finite number"),
])  # fmt: skip
def test_a_bad_value_names_its_field(knob, value, field, fragment):
    with pytest.raises(InvalidField) as raised:
        checked_knobs(max_tokens=8, vocab_size=VOCAB, **{knob: value})
    assert raised.value.field == field
    assert fragment in str(raised.value)


def test_too_many_biased_tokens_are_refused():
    bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}
    with pytest.raises(InvalidField, match=f"at most {MAX_LOGIT_BIAS_TOKENS} are accepted"):
        checked_knobs(max_tokens=8, vocab_size=10**6, logit_bias=bias)
    assert len(checked_knobs(max_tokens=8, vocab_size=10**6,
                             logit_bias=dict(list(bias.items())[:-1]))["logit_bias"]) \
        == MAX_LOGIT_BIAS_TOKENS


def test_each_front_spells_the_field_its_own_way():
    assert (OPENAI_NAMES.min_tokens, GRPC_NAMES.min_tokens) == ("min_tokens",
                                                                "sampling.min_tokens")
    with pytest.raises(InvalidField) as raised:
        checked_knobs(max_tokens=8, vocab_size=VOCAB, names=GRPC_NAMES, min_p=2.0)
    assert raised.value.field == "sampling.min_p"
    assert str(raised.value).startswith("sampling.min_p must be in [0, 1]")


def test_grpc_generate_carries_the_knobs(tokenizer):  # noqa: F811
    request = make_request(max_tokens=6, top_k=3, min_p=0.25, presence_penalty=0.5,
                           frequency_penalty=-0.5, repetition_penalty=1.25, min_tokens=2)
    request.sampling.logit_bias[19556] = -100.0
    request.sampling.logit_bias[905] = 4.0
    sampling = build(request, tokenizer).sampling
    assert (sampling.top_k, sampling.min_p, sampling.presence_penalty,
            sampling.frequency_penalty, sampling.repetition_penalty, sampling.min_tokens,
            sampling.logit_bias) == (3, 0.25, 0.5, -0.5, 1.25, 2, ((905, 4.0), (19556, -100.0)))
    assert build(make_request(max_tokens=6), tokenizer).sampling == SamplingOptions(
        max_tokens=6, temperature=0.0)


def test_grpc_generate_refuses_a_bad_knob_by_its_field(tokenizer):  # noqa: F811
    with pytest.raises(InvalidField) as raised:
        build(make_request(max_tokens=4, min_tokens=5), tokenizer)
    assert raised.value.field == "sampling.min_tokens"
    request = make_request()
    request.sampling.logit_bias[10**6] = 1.0
    with pytest.raises(InvalidField, match="sampling.logit_bias key 1000000 is not a token id"):
        build(request, tokenizer)


def test_a_continuation_owes_only_the_min_tokens_left():
    request = EngineRequest("r", (1, 2, 3), SamplingOptions(max_tokens=10, min_tokens=4))
    assert continuation(request, [7, 8]).sampling.min_tokens == 2
    assert continuation(request, [7, 8, 9, 10, 11]).sampling == SamplingOptions(
        max_tokens=5, min_tokens=0)


@pytest.mark.vllm
def test_the_engine_gets_the_knobs_as_vllm_sampling_params():
    from engine.sampling import sampling_params

    options = SamplingOptions(max_tokens=8, temperature=0.5, top_k=3, min_p=0.2,
                              presence_penalty=1.0, frequency_penalty=-1.0,
                              repetition_penalty=1.5, min_tokens=4, logit_bias=((9, -5.0),))
    params = sampling_params(options, 8, None)
    assert (params.top_k, params.min_p, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, params.min_tokens, params.logit_bias) == (
        3, 0.2, 1.0, -1.0, 1.5, 4, {9: -5.0})
    hand_off = sampling_params(options, 1, {"k": "v"})  # a prefill's one throw-away token
    assert (hand_off.max_tokens, hand_off.min_tokens) == (1, 1)
    assert sampling_params(SamplingOptions(max_tokens=8), 8, None).logit_bias is None
