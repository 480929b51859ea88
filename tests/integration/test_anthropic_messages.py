"""The Anthropic Messages API through the whole cluster with SmolLM2-135M-Instruct and the
official ``anthropic`` client: a streamed message and its usage split, a stop sequence reported
by the engine, a forced tool call held to its schema and a tool loop that reuses the first
step's KV, and an unknown model answered as Anthropic's ``not_found_error``."""

from __future__ import annotations

import anthropic
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
GREEDY = {"temperature": 0.0}  # this anthropic client takes temperature as an extra field
TOOLS = [{"name": "get_weather", "description": "The current weather in a city.",
          "input_schema": WEATHER}]


@pytest_asyncio.fixture(loop_scope="session")
async def client(server):  # noqa: F811
    async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.http_port}",
                                        api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def prompt_tokens(usage) -> int:
    return (usage.input_tokens + usage.cache_read_input_tokens
            + usage.cache_creation_input_tokens)


async def test_a_streamed_message_and_its_usage_split(client):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    async with client.messages.stream(model=MODEL, max_tokens=24, messages=messages,
                                      extra_body=GREEDY) as stream:
        texts = [text async for text in stream.text_stream]
        message = await stream.get_final_message()
    counted = await client.messages.count_tokens(model=MODEL, messages=messages)

    assert len(texts) > 1 and "".join(texts).strip()
    assert message.content[0].text == "".join(texts)
    assert message.stop_reason in ("end_turn", "max_tokens")
    usage = message.usage
    assert usage.cache_creation_input_tokens == 0
    assert usage.cache_read_input_tokens is not None and usage.cache_read_input_tokens >= 0
    assert prompt_tokens(usage) == counted.input_tokens
    assert 0 < usage.output_tokens <= 24


async def test_the_matched_stop_sequence_comes_back(client):
    message = await client.messages.create(
        model=MODEL, max_tokens=32, stop_sequences=[" "], extra_body=GREEDY,
        messages=[{"role": "user", "content": "Write one sentence about the sea."}])

    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " ")
    assert " " not in "".join(block.text for block in message.content)


async def test_a_forced_tool_call_and_a_tool_loop_that_reuses_its_kv(client):
    first = await client.messages.create(
        model=MODEL, max_tokens=96, messages=QUESTION, tools=TOOLS, extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"})

    [call] = first.content
    assert (call.type, call.name, first.stop_reason) == ("tool_use", "get_weather", "tool_use")
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)

    history = QUESTION + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id,
                                           "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": '{"temperature": 18}'}]},
    ]
    second = await client.messages.create(model=MODEL, max_tokens=8, messages=history,
                                          tools=TOOLS, tool_choice={"type": "none"},
                                          extra_body=GREEDY)

    first_prompt = prompt_tokens(first.usage)
    assert first_prompt >= BLOCK_TOKENS  # the tool preamble alone fills a block
    assert prompt_tokens(second.usage) > first_prompt
    assert second.usage.cache_read_input_tokens >= first_prompt // BLOCK_TOKENS * BLOCK_TOKENS
    assert [block.type for block in second.content] in ([], ["text"])  # none: text only
    assert second.stop_reason in ("end_turn", "max_tokens")


async def test_an_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=QUESTION)

    assert info.value.body["error"]["type"] == "not_found_error"
    assert info.value.body["error"]["message"].startswith("model 'claude-sonnet-4-5' is not served")


async def test_a_prefill_is_continued_as_the_chat_routes_continue_final_message(
        client, server):  # noqa: F811
    """The same greedy continuation of the same open prompt on both routes: Anthropic's last
    assistant message, vLLM's ``continue_final_message`` on the chat route."""
    asked = [{"role": "user", "content": "Name the capital of France in one word."}]
    prefill = {"role": "assistant", "content": "The capital of France is"}
    message = await client.messages.create(model=MODEL, max_tokens=8, messages=asked + [prefill],
                                           extra_body=GREEDY)
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                                  api_key="unused", max_retries=0, timeout=120) as oai:
        chat = await oai.chat.completions.create(
            model=MODEL, messages=asked + [prefill], max_tokens=8, temperature=0.0,
            extra_body={"continue_final_message": True, "add_generation_prompt": False})
        closed = await oai.chat.completions.create(model=MODEL, messages=asked + [prefill],
                                                   max_tokens=8, temperature=0.0)

    [block] = message.content
    assert block.text == chat.choices[0].message.content
    assert block.text.strip()
    assert prompt_tokens(message.usage) == chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens < closed.usage.prompt_tokens  # no end of turn, no header
