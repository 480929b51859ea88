"""Tool calling through the whole cluster with SmolLM2-135M-Instruct and the official ``openai``
client: forced calls (``tool_choice`` ``required`` and a named function) are held to the
functions' JSON schemas by constrained decoding, streamed and not; a tool loop (call, result
appended, next request) reuses the previous step's KV."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.integration.engines import running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

NUM_SAMPLED = 6
MAX_TOKENS = 96
BLOCK_TOKENS = 128  # vLLM-CPU's KV block: cached_tokens count whole blocks
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 12}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
     "The current weather in a city.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description":
     "The current time in a timezone.", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(smollm2_model):
    async with running_server({"engine.model": "smollm2",
                               "kvstore.host_capacity_bytes": 512 << 20}) as srv:
        yield srv


def _openai(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                              api_key="unused", max_retries=0, timeout=120)


def _assert_valid_calls(calls, only: str | None = None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        assert call.function.name in ((only,) if only else SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def _streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """The tool calls a stream's deltas add up to (as the openai client's users accumulate
    them), the finish reason and the streamed content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            if delta.id:
                assert not call["id"], "a call opened twice"
                call["id"] = delta.id
            if delta.function and delta.function.name:
                call["name"] = delta.function.name
            if delta.function and delta.function.arguments:
                assert call["id"], "arguments before the call's opening delta"
                call["arguments"] += delta.function.arguments
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("tool_choice", ["required", "named"])
async def test_forced_calls_always_validate(server, tool_choice):
    oai = _openai(server)
    choice = ("required" if tool_choice == "required"
              else {"type": "function", "function": {"name": "get_time"}})

    async def one(i: int):  # one call each: a sampled 135M model may repeat calls past any budget
        return await oai.chat.completions.create(
            model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=MAX_TOKENS,
            temperature=0.8 + 0.4 * i / NUM_SAMPLED, seed=2000 + i)

    answers = await asyncio.gather(*(one(i) for i in range(NUM_SAMPLED)))

    for answer in answers:
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls", message
        assert message.content is None
        _assert_valid_calls(message.tool_calls, None if tool_choice == "required" else "get_time")
        if tool_choice == "named":
            assert len(message.tool_calls) == 1
    arguments = {answer.choices[0].message.tool_calls[0].function.arguments for answer in answers}
    assert len(arguments) > 1  # sampled, not one answer six times


@pytest.mark.parametrize("tool_choice", ["required", "named"])
async def test_streamed_forced_calls_validate(server, tool_choice):
    oai = _openai(server)
    choice = ("required" if tool_choice == "required"
              else {"type": "function", "function": {"name": "get_weather"}})
    for seed in (1, 2):
        stream = await oai.chat.completions.create(
            model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            stream=True)
        calls, finish, content = await _streamed_calls(stream)

        assert finish == "tool_calls"
        assert content == ""
        assert calls
        for call in calls:
            assert call["id"].startswith("call_")
            if tool_choice == "named":
                assert call["name"] == "get_weather"
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


async def test_required_with_parallel_calls_allowed_is_an_array_of_valid_calls(server):
    """Greedy, so the answer is the model's own choice of how many calls; each validates."""
    answer = await _openai(server).chat.completions.create(
        model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=256,
        temperature=0.0)

    assert answer.choices[0].finish_reason == "tool_calls", answer.choices[0].message
    _assert_valid_calls(answer.choices[0].message.tool_calls)


async def test_parallel_tool_calls_false_makes_one_call(server):
    oai = _openai(server)
    for seed in (3, 4, 5):
        answer = await oai.chat.completions.create(
            model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        calls = answer.choices[0].message.tool_calls
        _assert_valid_calls(calls)
        assert len(calls) == 1


async def test_a_tool_loop_reuses_the_previous_steps_kv(server):
    """Request → forced call → the call and its result appended → next request: the second
    prompt starts with the first, so its cached tokens cover the first prompt's whole blocks."""
    oai = _openai(server)
    first = await oai.chat.completions.create(
        model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required",
        max_tokens=MAX_TOKENS, temperature=0.0)
    call = first.choices[0].message.tool_calls[0]
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = await oai.chat.completions.create(
        model="smollm2", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8,
        temperature=0.0)

    first_prompt = first.usage.prompt_tokens
    assert first_prompt >= BLOCK_TOKENS  # the tool preamble alone fills a block
    assert second.usage.prompt_tokens > first_prompt
    assert second.usage.prompt_tokens_details.cached_tokens >= (
        first_prompt // BLOCK_TOKENS * BLOCK_TOKENS)
    assert second.choices[0].message.tool_calls is None  # tool_choice none: text only
    assert second.choices[0].finish_reason in ("stop", "length")


async def test_bad_tool_requests_are_400_naming_the_field_and_serving_goes_on(server):
    oai = _openai(server)
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools",
         "function name"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "send one of them"),
        ({"tools": [{"type": "function", "function": {"name": "count", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}}],
          "tool_choice": "required"},  # the engines' xgrammar cannot enforce multipleOf
         "tools", "cannot enforce"),
    ]
    for fields, param, fragment in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4,
                                              **fields)
        error = info.value.body
        assert error["param"] == param, error
        assert fragment in error["message"], error
    served = await oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4)
    assert served.choices[0].finish_reason in ("stop", "length")
