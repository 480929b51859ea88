"""Structured outputs through the whole cluster with SmolLM2-135M-Instruct: ``response_format``
``json_schema`` and ``json_object`` (HTTP) and ``sampling.json_schema`` (gRPC) reach vLLM's
structured-output backend on the decode instance, and sampled answers (various temperatures and
seeds) all parse and validate; a schema that backend cannot enforce is refused at the front."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from gateway import client
from tests.integration.engines import running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

NUM_SAMPLED = 20
NUM_SAMPLED_GRPC = 5
MAX_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
QUESTION = ("Answer in JSON with the name of one city and whether it is sunny there today. "
            "Rayleigh scattering makes the sky blue; the sun is shining. ") * 2


CONTEXT = ("Rayleigh scattering is the elastic scattering of light by particles much smaller than "
           "its wavelength, so blue light is scattered far more strongly than red light. ") * 8
"""Long enough for a few full KV blocks (128 tokens each)."""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(smollm2_model):
    async with running_server({"engine.model": "smollm2",
                               "kvstore.host_capacity_bytes": 512 << 20}) as srv:
        yield srv


def _openai(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                              api_key="unused", max_retries=0, timeout=120)


async def test_sampled_json_schema_answers_all_validate(server):
    oai = _openai(server)
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}

    async def one(i: int):
        return await oai.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS, temperature=0.7 + 0.3 * i / (NUM_SAMPLED - 1), seed=1000 + i,
            response_format=response_format)

    answers = await asyncio.gather(*(one(i) for i in range(NUM_SAMPLED)))

    contents = [answer.choices[0].message.content for answer in answers]
    for answer, content in zip(answers, contents):
        assert answer.choices[0].finish_reason == "stop", content
        jsonschema.validate(json.loads(content), SCHEMA)
    assert len(set(contents)) > 1  # sampled, not one answer twenty times


async def test_json_object_answer_is_one_object_and_the_prompt_kv_is_reused_as_without(server):
    """The constraint acts on sampling only: a constrained request after an unconstrained one
    of the same prompt finds the same cached prefix."""
    oai = _openai(server)
    messages = [{"role": "user", "content": CONTEXT + 'Reply with a JSON object whose only key '
                 'is "city", naming one city, like {"city": "Rome"}.'}]
    await oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
    plain = await oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)

    # with no example, one greedy answer was a 15-token object and, on a CI run in bfloat16,
    # a nested one still open after 48 tokens; the example keeps it short in both dtypes
    answer = await oai.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=2 * MAX_TOKENS, temperature=0,
        response_format={"type": "json_object"})

    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0
    assert (answer.usage.prompt_tokens_details.cached_tokens
            == plain.usage.prompt_tokens_details.cached_tokens)


async def test_sampled_grpc_json_schema_answers_all_validate(server):
    async def one(i: int):
        return await client.generate(
            server.target, text=QUESTION, chat=True, max_tokens=MAX_TOKENS,
            temperature=0.7 + 0.3 * i / (NUM_SAMPLED_GRPC - 1), seed=2000 + i,
            json_schema=json.dumps(SCHEMA))

    answers = await asyncio.gather(*(one(i) for i in range(NUM_SAMPLED_GRPC)))

    texts = [answer["text"] for answer in answers]
    for answer, text in zip(answers, texts):
        assert answer["finish_reason"] == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one answer five times


UNENFORCEABLE = {"type": "object", "properties": {"a": {"type": 7}}}
"""A JSON object that is no JSON Schema: every backend of vLLM's refuses it (the engines run
xgrammar, ``engine.compact_json``, whose message the front passes on)."""


async def test_a_schema_the_backend_refuses_is_a_400_from_the_front(server):
    """Refused at the front by vLLM's own check, with vLLM's message."""
    with pytest.raises(openai.BadRequestError) as info:
        await _openai(server).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": UNENFORCEABLE}})

    assert (info.value.body["type"], info.value.body["param"]) == ("invalid_request_error",
                                                                   "response_format")
    assert info.value.body["message"].startswith(
        "response_format.json_schema.schema is a JSON Schema the structured-output backend "
        "cannot enforce: Failed to transform json schema into a grammar: Type should be a string")


async def test_a_schema_the_backend_refuses_is_invalid_argument_over_grpc(server):
    with pytest.raises(client.GenerateFailed) as info:
        await client.generate(server.target, text="hi", max_tokens=4,
                              json_schema=json.dumps(UNENFORCEABLE))

    assert info.value.status == "INVALID_ARGUMENT"
    assert info.value.details.startswith(
        "sampling.json_schema is a JSON Schema the structured-output backend cannot enforce: "
        "Failed to transform json schema into a grammar: Type should be a string")


COLOUR_CODE = "(red|green|blue)-[0-9]{2}"
VERDICTS = ["positive", "negative", "mixed"]


async def test_sampled_choice_and_regex_answers_all_conform(server):
    """vLLM's ``structured_outputs`` extension over HTTP (chat: ``choice``; completions:
    ``regex``) and the same constraints over gRPC: every sampled answer is one of the choices or
    matches the whole pattern, and ends by itself."""
    import re

    oai = _openai(server)

    async def chat(i: int):
        return await oai.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Is the sky lovely? " * 3}],
            max_tokens=MAX_TOKENS, temperature=1.0, seed=3000 + i,
            extra_body={"structured_outputs": {"choice": VERDICTS}})

    async def completion(i: int):
        return await oai.completions.create(
            model="smollm2", prompt="A colour and a number: ", max_tokens=MAX_TOKENS,
            temperature=1.0, seed=4000 + i, extra_body={"structured_outputs": {"regex": COLOUR_CODE}})

    chats = await asyncio.gather(*(chat(i) for i in range(6)))
    completions = await asyncio.gather(*(completion(i) for i in range(6)))
    by_grpc = [await client.generate(server.target, text="Pick one. ", max_tokens=MAX_TOKENS,
                                     temperature=1.0, seed=5000 + i, knobs=knobs)
               for i, knobs in enumerate([{"choice": VERDICTS}, {"regex": COLOUR_CODE}])]

    for answer in chats:
        assert answer.choices[0].finish_reason == "stop"
        assert answer.choices[0].message.content in VERDICTS
    for answer in completions:
        assert answer.choices[0].finish_reason == "stop"
        assert re.fullmatch(COLOUR_CODE, answer.choices[0].text), answer.choices[0].text
    assert by_grpc[0]["finish_reason"] == by_grpc[1]["finish_reason"] == "stop"
    assert by_grpc[0]["text"] in VERDICTS
    assert re.fullmatch(COLOUR_CODE, by_grpc[1]["text"]), by_grpc[1]["text"]
    assert len({answer.choices[0].text for answer in completions}) > 1  # sampled, not one answer


async def test_a_regex_the_backend_refuses_is_refused_at_the_front(server):
    with pytest.raises(openai.BadRequestError) as info:
        await _openai(server).completions.create(
            model="smollm2", prompt="x", max_tokens=4,
            extra_body={"structured_outputs": {"regex": "(unclosed"}})
    with pytest.raises(client.GenerateFailed) as grpc_info:
        await client.generate(server.target, text="hi", max_tokens=4,
                              knobs={"regex": "(unclosed"})

    assert info.value.body["param"] == "structured_outputs"
    assert info.value.body["message"].startswith(
        "structured_outputs.regex is a regular expression the structured-output backend cannot "
        "enforce: Failed to transform regex into a grammar")
    assert grpc_info.value.status == "INVALID_ARGUMENT"
    assert grpc_info.value.details.startswith("sampling.regex is a regular expression")
