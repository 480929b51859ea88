"""OpenAI's Responses API through the whole cluster with SmolLM2-135M-Instruct and the official
``openai`` client's ``responses`` resource: a greedy answer equals the chat route's for the same
conversation, token for token, with the same prompt count; a streamed answer's deltas make its
final text; a forced function call is held to its schema, and the agent loop the Agents SDK runs
(the answer's output items and the call's output sent back as input) reuses the first step's KV."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.integration.test_tool_calling import (  # noqa: F401  (server: SmolLM2's cluster)
    BLOCK_TOKENS,
    QUESTION,
    WEATHER,
    server,
)

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MODEL = "smollm2"
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER,
          "description": "The current weather in a city."}]
SEA = "Write one sentence about the sea."


@pytest_asyncio.fixture(loop_scope="session")
async def client(server):  # noqa: F811
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                                  api_key="unused", max_retries=0, timeout=120) as client:
        yield client


async def test_a_greedy_answer_is_the_chat_routes_answer(client):
    response = await client.responses.create(
        model=MODEL, instructions="Be brief.", input=SEA, temperature=0.0,
        max_output_tokens=16)
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": SEA}],
        temperature=0.0, max_tokens=16)

    assert response.output_text == chat.choices[0].message.content
    assert response.output_text.strip()
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    finished = {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    assert response.status == finished


async def test_a_streamed_answer_builds_its_final_text(client):
    async with client.responses.stream(model=MODEL, input=SEA, temperature=0.0,
                                       max_output_tokens=24) as stream:
        events = [event async for event in stream]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    # the last event: response.completed, or response.incomplete at the length limit (which
    # the client's get_final_response() does not take)
    assert events[-1].type in ("response.completed", "response.incomplete")
    response = events[-1].response

    assert len(deltas) > 1
    assert response.output_text == "".join(deltas)
    assert 0 < response.usage.output_tokens <= 24


async def test_a_forced_call_and_the_agent_loop_reuse_its_kv(client):
    first = await client.responses.create(
        model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required", temperature=0.0,
        max_output_tokens=96)

    [call] = first.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    history = [*QUESTION, *(item.model_dump(exclude_none=True) for item in first.output),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature": 18}'}]
    second = await client.responses.create(model=MODEL, input=history, tools=TOOLS,
                                           tool_choice="none", temperature=0.0,
                                           max_output_tokens=8)

    first_prompt = first.usage.input_tokens
    assert first_prompt >= BLOCK_TOKENS  # the tool preamble alone fills a block
    assert second.usage.input_tokens > first_prompt
    assert second.usage.input_tokens_details.cached_tokens >= (
        first_prompt // BLOCK_TOKENS * BLOCK_TOKENS)
    assert [item.type for item in second.output] in ([], ["message"])  # none: text only
