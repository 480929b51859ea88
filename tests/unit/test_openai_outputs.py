"""Log-probabilities and structured outputs at the OpenAI HTTP front, over real uvicorn with the
official ``openai`` client and a scripted ``FakeRouter``: what a request asks the engines for
(its ``SamplingOptions``), how the engines' logprobs are spelled (chat and completions,
streaming and not), and the 400s naming the field for values out of range.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from decode_worker.worker import position_logprobs
from protos.wire import PositionLogprobs, SamplingOptions, TokenChunk, TokenLogprob
from tests.unit.test_gateway_wire import FakeRouter
from tests.unit.test_openai_http import (  # noqa: F401  (the module's server fixtures)
    AUTH,
    HI,
    SERVED,
    client,
    http,
    registry,
    running,
    server,
    slot,
    tokenizer,
)


def _lp(token_id: int, token: str, logprob: float, rank: int) -> TokenLogprob:
    return TokenLogprob(token_id, token, logprob, rank)


A, X, B = _lp(5, "a", -0.5, 1), _lp(9, "x", -1.5, 2), _lp(6, "b", -2.0, 3)
C, E_ACUTE = _lp(7, "c", -0.25, 1), _lp(8, "é", -1.0, 2)
D = _lp(11, "d", float("-inf"), 4)  # a token the sampler gave no mass (greedy never picks it)
POSITIONS = (
    PositionLogprobs(A, (A, X)),
    PositionLogprobs(B, (C, E_ACUTE)),  # chosen, but ranked below the top two
    PositionLogprobs(C, (C, E_ACUTE)),
    PositionLogprobs(D, (C, E_ACUTE)),
)
LOGPROB_CHUNKS = (
    TokenChunk((5, 6), "ab", logprobs=POSITIONS[:2]),
    TokenChunk((), ""),
    TokenChunk((7,), "", logprobs=POSITIONS[2:3]),  # a token whose text is held back
    TokenChunk((11,), "cd", finish_reason="stop", num_loaded_tokens=12, logprobs=POSITIONS[3:]),
)


@pytest.fixture
def router(slot) -> FakeRouter:  # noqa: F811
    slot.current = FakeRouter(LOGPROB_CHUNKS)
    return slot.current


def chat_entry(entry: TokenLogprob) -> dict:
    logprob = max(entry.logprob, -9999.0)
    return {"token": entry.token, "logprob": logprob, "bytes": list(entry.token.encode())}


def chat_content(positions) -> list[dict]:
    return [chat_entry(p.chosen) | {"top_logprobs": [chat_entry(t) for t in p.top]}
            for p in positions]


def test_chat_entries_spell_bytes_and_infinity_as_openai_does():
    assert chat_content(POSITIONS[3:]) == [{
        "token": "d", "logprob": -9999.0, "bytes": [100],
        "top_logprobs": [{"token": "c", "logprob": -0.25, "bytes": [99]},
                         {"token": "é", "logprob": -1.0, "bytes": [195, 169]}]}]


COMPLETION_LOGPROBS = {
    "tokens": ["a", "b", "c", "d"],
    "token_logprobs": [-0.5, -2.0, -0.25, -9999.0],
    "top_logprobs": [{"a": -0.5, "x": -1.5}, {"c": -0.25, "é": -1.0, "b": -2.0},
                     {"c": -0.25, "é": -1.0}, {"c": -0.25, "é": -1.0, "d": -9999.0}],
    "text_offset": [0, 1, 2, 3],
}


async def test_chat_logprobs_are_asked_for_and_answered_in_openai_shape(client, router):
    completion = await client.chat.completions.create(
        model=SERVED, messages=HI, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)

    [engine_request] = router.requests
    assert engine_request.sampling == SamplingOptions(max_tokens=4, temperature=0.0,
                                                      num_logprobs=2)
    [choice] = completion.choices
    assert choice.message.content == "abcd"
    assert choice.logprobs.model_dump(exclude_none=True) == {"content": chat_content(POSITIONS)}


async def test_streamed_chat_chunks_carry_their_own_tokens_logprobs(client, router):
    stream = await client.chat.completions.create(
        model=SERVED, messages=HI, max_tokens=4, logprobs=True, top_logprobs=2, stream=True)
    chunks = [chunk.choices[0] async for chunk in stream]

    opening, *deltas, finish = chunks
    assert opening.logprobs is None and finish.logprobs is None
    assert [(d.delta.content, d.logprobs.model_dump(exclude_none=True)) for d in deltas] == [
        ("ab", {"content": chat_content(POSITIONS[:2])}),
        ("", {"content": chat_content(POSITIONS[2:3])}),
        ("cd", {"content": chat_content(POSITIONS[3:])}),
    ]
    assert router.requests[0].sampling.num_logprobs == 2


async def test_chat_logprobs_without_top_logprobs_ask_for_the_chosen_token_only(client, router):
    await client.chat.completions.create(model=SERVED, messages=HI, logprobs=True)

    assert router.requests[0].sampling.num_logprobs == 0


async def test_completion_logprobs_in_openai_shape(client, router):
    completion = await client.completions.create(model=SERVED, prompt="Hello", logprobs=2)

    assert router.requests[0].sampling.num_logprobs == 2
    [choice] = completion.choices
    assert choice.text == "abcd"
    assert choice.logprobs.model_dump() == COMPLETION_LOGPROBS


async def test_streamed_completion_text_offsets_run_on_across_chunks(client, router):
    stream = await client.completions.create(model=SERVED, prompt="Hello", logprobs=2,
                                             stream=True)
    chunks = [chunk.choices[0] async for chunk in stream]

    *deltas, finish = chunks
    assert finish.logprobs is None
    merged = {key: [] for key in COMPLETION_LOGPROBS}
    for delta in deltas:
        for key, values in delta.logprobs.model_dump().items():
            merged[key].extend(values)
    assert [len(delta.logprobs.tokens) for delta in deltas] == [2, 1, 1]
    assert merged == COMPLETION_LOGPROBS


async def test_no_logprobs_unless_asked(client, router):
    completion = await client.completions.create(model=SERVED, prompt="Hello")

    assert completion.choices[0].logprobs is None
    assert router.requests[0].sampling.num_logprobs is None


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
async def test_response_formats_reach_the_sampling_options(http, router, endpoint):
    path, base = (("/v1/chat/completions", {"messages": HI}) if endpoint == "chat"
                  else ("/v1/completions", {"prompt": "x"}))
    formats = [{"type": "text"}, {"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                       "strict": True}}]

    for response_format in formats:
        answer = await http.post(path, headers=AUTH, json={
            "model": SERVED, **base, "response_format": response_format})
        assert answer.status_code == 200, answer.text

    text, json_object, json_schema = (r.sampling for r in router.requests)
    assert (text.json_schema, text.json_object) == ("", False)
    assert (json_object.json_schema, json_object.json_object) == ("", True)
    assert json.loads(json_schema.json_schema) == SCHEMA
    assert json_schema.json_object is False
    assert all(r.prompt_token_ids == router.requests[0].prompt_token_ids for r in router.requests)


OUT_OF_RANGE = {
    "top_logprobs 21": ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
                        "top_logprobs must be an integer from 0 to 20, got 21"),
    "top_logprobs -1": ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs",
                        "from 0 to 20, got -1"),
    "top_logprobs without logprobs": ("chat", {"top_logprobs": 3}, "top_logprobs",
                                      "top_logprobs=3 needs logprobs: true"),
    "top_logprobs with logprobs false": ("chat", {"logprobs": False, "top_logprobs": 1},
                                         "top_logprobs", "needs logprobs: true"),
    "chat logprobs not a bool": ("chat", {"logprobs": "many"}, "logprobs", "valid boolean"),
    "completion logprobs 6": ("completion", {"logprobs": 6}, "logprobs",
                              "logprobs must be an integer from 0 to 5, got 6"),
    "completion logprobs -1": ("completion", {"logprobs": -1}, "logprobs", "from 0 to 5"),
    "response_format regex": ("chat", {"response_format": {"type": "regex"}}, "response_format",
                              "response_format type 'regex' is not served; use one of text, "
                              "json_object, json_schema"),
    "response_format not an object": ("chat", {"response_format": "json"}, "response_format",
                                      "valid dictionary"),
    "json_schema without a schema": (
        "chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format", "response_format.json_schema.schema must be a JSON Schema object, got "
        "NoneType"),
    "json_schema schema a list": (
        "completion", {"response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": [1]}}},
        "response_format", "schema must be a JSON Schema object, got list"),
    "json_schema the backend refuses": pytest.param(
        "chat", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}}},
        "response_format", "response_format.json_schema.schema is a JSON Schema the "
        "structured-output backend cannot enforce: Grammar error: type must be a string or "
        "array of strings", marks=pytest.mark.vllm),
    "json_schema without a name": (
        "chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format", "response_format.json_schema.name must be a non-empty string"),
    "json_schema unknown key": (
        "chat", {"response_format": {"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": {}, "regex": "a"}}},
        "response_format", "response_format.json_schema has unknown keys ['regex']"),
    "json_object with a schema": (
        "chat", {"response_format": {"type": "json_object", "json_schema": {}}},
        "response_format", "response_format of type 'json_object' takes no json_schema"),
}  # fmt: skip


@pytest.mark.parametrize("endpoint, fields, param, fragment", OUT_OF_RANGE.values(),
                         ids=OUT_OF_RANGE.keys())
async def test_out_of_range_values_are_refused_by_name(http, router, endpoint, fields, param,
                                                       fragment):
    path, base = (("/v1/chat/completions", {"messages": HI}) if endpoint == "chat"
                  else ("/v1/completions", {"prompt": "x"}))

    refused = await http.post(path, json={"model": SERVED, **base, **fields}, headers=AUTH)

    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert fragment in error["message"]
    assert router.requests == []


def test_the_decode_worker_keeps_the_top_by_rank_and_the_chosen_token_apart():
    """vLLM's per-position map holds the sampled token first (whatever its rank), then the top
    ones; the wire keeps the chosen one and the top ``num_top`` by rank."""
    def vllm(logprob: float, rank: int, text: str) -> SimpleNamespace:
        return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=text)

    maps = [{6: vllm(-2.0, 3, "b"), 7: vllm(-0.25, 1, "c"), 8: vllm(-1.0, 2, "é")},
            {8: vllm(-1.0, 2, "é"), 7: vllm(-0.25, 1, "c")}]

    positions = position_logprobs([6, 8], maps, 2)

    assert positions == (PositionLogprobs(B, (C, E_ACUTE)),
                         PositionLogprobs(_lp(8, "é", -1.0, 2), (C, _lp(8, "é", -1.0, 2))))
    assert position_logprobs([6], [maps[0]], None) == ()
    assert position_logprobs([], [], 2) == ()
