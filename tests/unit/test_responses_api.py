"""OpenAI's Responses API (``/v1/responses``) over real uvicorn, driven by the official ``openai``
client's ``responses`` resource, with a scripted ``FakeRouter`` standing in for the engines (the
integration test runs SmolLM2): the response object and usage, the event stream, function calls
parsed and forced, input items into the prompt, formats, and refusals naming the field."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import pytest_asyncio

from gateway.tool_calls import ToolCall, ToolPlan, Turn, render
from protos.errors import WorkerFailed
from protos.wire import TokenChunk
from tests.unit.test_anthropic_messages import (  # noqa: F401  (its server and router)
    router,
    running,
    scripted,
    tool_halves,
)
from tests.unit.test_gateway_wire import FakeRouter
from tests.unit.test_openai_http import (  # noqa: F401  (the module's fixtures)
    API_KEY,
    SERVED,
    registry,
    slot,
    tokenizer,
    wait_for_closed_streams,
)
from tests.unit.test_tool_calls import CITY, TIME, WEATHER

NUM_PREFILL_CACHED = 16  # what FakeRouter's prefill reports as cached
TOOLS = [{"type": "function", "name": t.name, "description": t.description,
          "parameters": t.parameters} for t in (WEATHER, TIME)]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
ITEM_ID = re.compile(r"^fc_[0-9a-f]{24}$")


@pytest_asyncio.fixture
async def client(running, router):
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1",
                                  api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest_asyncio.fixture
async def http(running, router):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        yield http


def sse_events(text: str) -> list[dict]:
    """The data of each event of a Responses stream, checked against its ``event:`` name."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


async def test_a_text_answer_is_a_response_with_usage(client, router, tokenizer):  # noqa: F811
    raw = await client.responses.with_raw_response.create(
        model=SERVED, input="Say hello", instructions="Be brief.", max_output_tokens=32,
        temperature=0.5, top_p=0.9, metadata={"run": "r1"},
        extra_headers={"X-Request-Id": "req-7"})
    response = raw.parse()

    assert raw.headers["x-request-id"] == "req-7"
    assert (response.id, response.object, response.model) == ("resp_req-7", "response", SERVED)
    assert (response.status, response.error, response.incomplete_details) == (
        "completed", None, None)
    [item] = response.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert [part.to_dict() for part in item.content] == [
        {"type": "output_text", "text": "Hello world", "annotations": []}]
    assert response.output_text == "Hello world"
    assert (response.instructions, response.max_output_tokens, response.temperature,
            response.top_p, response.metadata, response.store) == (
        "Be brief.", 32, 0.5, 0.9, {"run": "r1"}, False)
    [request] = router.requests
    num_prompt_tokens = len(request.prompt_token_ids)
    assert response.usage.to_dict() == {
        "input_tokens": num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": NUM_PREFILL_CACHED, "cache_write_tokens": 0},
        "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt_tokens + 2}
    assert response.to_dict()["baton"]["placement"]["decode"] == "decode-1"
    assert request.request_id == "req-7"
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.json_schema) == (
        32, 0.5, 0.9, "")
    expected = tokenizer.encode_conversation(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}],
        None)
    assert list(request.prompt_token_ids) == expected


async def test_the_length_limit_makes_it_incomplete(client, slot):  # noqa: F811
    scripted(slot, "Hello", finish="length")

    response = await client.responses.create(model=SERVED, input="Say hello",
                                             max_output_tokens=1)

    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


async def test_a_streamed_answer_is_the_responses_event_sequence(client, http, router):
    response = await http.post("/v1/responses", json={
        "model": SERVED, "input": "Say hello", "stream": True})

    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    assert [event["delta"] for event in events if "delta" in event] == ["Hello", " world"]
    item_id = events[2]["item"]["id"]
    assert {event["item_id"] for event in events[3:8]} == {item_id}
    assert events[6]["text"] == "Hello world"
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert final["output"] == [events[8]["item"]]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == NUM_PREFILL_CACHED
    assert final["baton"]["loaded_tokens"] == 12

    async with client.responses.stream(model=SERVED, input="Say hello") as stream:
        deltas = [event.delta async for event in stream
                  if event.type == "response.output_text.delta"]
        streamed = await stream.get_final_response()
    assert deltas == ["Hello", " world"]
    assert streamed.output_text == "Hello world"


EXPECTED_ITEMS = [("message", "Let me check.\n"), ("function_call", "get_weather",
                                                   {"city": "Paris"}),
                  ("function_call", "get_time", {"zone": "CET"})]


def items_of(response) -> list[tuple]:
    return [(item.type, item.content[0].text) if item.type == "message" else
            (item.type, item.name, json.loads(item.arguments)) for item in response.output]


async def test_auto_function_calls_are_parsed_from_the_answer(client, slot):  # noqa: F811
    router = tool_halves(slot)

    response = await client.responses.create(model=SERVED, input="Weather?", tools=TOOLS)

    assert items_of(response) == EXPECTED_ITEMS
    calls = response.output[1:]
    assert all(CALL_ID.match(call.call_id) and ITEM_ID.match(call.id) for call in calls)
    assert {call.status for call in calls} == {"completed"}
    assert router.requests[0].sampling.json_schema == ""  # auto: parsed, not constrained
    assert response.tool_choice == "auto"
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]


async def test_streamed_function_calls_come_in_order(client, slot):  # noqa: F811
    tool_halves(slot)

    async with client.responses.stream(model=SERVED, input="Weather?", tools=TOOLS) as stream:
        raw = [event async for event in stream]
        response = await stream.get_final_response()

    assert items_of(response) == EXPECTED_ITEMS
    added = [event for event in raw if event.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [
        (0, "message"), (1, "function_call"), (2, "function_call")]
    assert added[1].item.arguments == ""
    for index in (1, 2):
        arguments = "".join(e.delta for e in raw if e.type ==
                            "response.function_call_arguments.delta" and e.output_index == index)
        [done] = [e for e in raw if e.type == "response.function_call_arguments.done"
                  and e.output_index == index]
        assert json.loads(arguments) == json.loads(done.arguments) == json.loads(
            response.output[index].arguments)
    assert [e.output_index for e in raw if e.type == "response.output_item.done"] == [0, 1, 2]


async def test_a_forced_function_is_the_answers_grammar(client, slot):  # noqa: F811
    router = scripted(slot, '{"ci', 'ty": "Nice"}')

    response = await client.responses.create(
        model=SERVED, input="Weather?", tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"})

    assert items_of(response) == [("function_call", "get_weather", {"city": "Nice"})]
    assert router.requests[0].sampling.json_schema == ToolPlan(
        (WEATHER, TIME), "named", "get_weather").constraint()
    assert json.loads(router.requests[0].sampling.json_schema) == CITY

    await client.responses.create(model=SERVED, input="Time?", tools=TOOLS,
                                  tool_choice="required", parallel_tool_calls=False)
    assert router.requests[1].sampling.json_schema == ToolPlan(
        (WEATHER, TIME), "required", parallel=False).constraint()


async def test_input_items_render_into_the_prompt(client, router, tokenizer):  # noqa: F811
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                           "text": "Paris?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time",
         "arguments": '{"zone": "CET"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 18}'},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "no clock"}]},
        {"role": "user", "content": "Thanks"},
    ]

    await client.responses.create(model=SERVED, input=items, instructions="You are a bot.",
                                  tools=TOOLS)

    turns = [
        Turn("system", "You are a bot."), Turn("system", "Be brief."),
        Turn("user", "Weather in Paris?"),
        Turn("assistant", "Checking.", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                                        ToolCall("call_2", "get_time", '{"zone": "CET"}'))),
        Turn("tool", '{"temp": 18}', tool_call_id="call_1"),
        Turn("tool", "no clock", tool_call_id="call_2"), Turn("user", "Thanks"),
    ]
    rendered = render(turns, ToolPlan((WEATHER, TIME), "auto"), tokenizer.renders_tools)
    expected = tokenizer.encode_conversation(rendered.messages, rendered.tools)
    [request] = router.requests
    assert list(request.prompt_token_ids) == expected

    counted = await client.responses.input_tokens.count(
        model=SERVED, input=items, instructions="You are a bot.", tools=TOOLS)
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", len(expected))
    assert len(router.requests) == 1  # counting places nothing
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await client.responses.input_tokens.count(model=SERVED, input="Hi",
                                                  previous_response_id="resp_1")


async def test_text_formats_are_the_chat_routes_structured_outputs(client, router):
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    await client.responses.create(model=SERVED, input="City?", text={"format": {
        "type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    response = await client.responses.create(model=SERVED, input="JSON?",
                                             text={"format": {"type": "json_object"}})

    as_schema, as_object = (request.sampling for request in router.requests)
    assert json.loads(as_schema.json_schema) == schema
    assert (as_object.json_schema, as_object.json_object) == ("", True)
    assert response.text.format.type == "json_object"


@pytest.mark.parametrize("body, param, words", [
    ({"store": True}, "store", "not stored"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include: []"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice",
     "not among the tools"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input",
     "input[0]: items of type 'reasoning'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "not stored"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input[0].content[0]: input_image parts are not served"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input", "input[0].arguments: the arguments must be a JSON object"),
    ({"input": []}, "input", "input is empty"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": 7}}}}}}, "text.format",
     "text.format.schema is a JSON Schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format", "text.format.name must be a non-empty string"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "context"),
    ({"frobnicate": 1}, "frobnicate", "unknown field"),
    ({"model": "gpt-9"}, "model", "gpt-9"),
])
async def test_what_is_not_served_is_refused_by_name(http, router, body, param, words):
    response = await http.post("/v1/responses", json={"model": SERVED, "input": "Hi"} | body)

    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (404 if param == "model" else 400, param)
    assert words in error["message"]
    assert router.requests == []


async def test_stored_responses_are_a_404_that_says_so(client, router):
    with pytest.raises(openai.NotFoundError, match="responses are not stored"):
        await client.responses.retrieve("resp_abc")
    with pytest.raises(openai.NotFoundError, match="responses are not stored"):
        await client.responses.delete("resp_abc")


async def test_neutral_values_are_accepted(client, router):
    response = await client.responses.create(
        model=SERVED, input="Hi", store=False, include=[], truncation="disabled",
        service_tier="auto", parallel_tool_calls=True, prompt_cache_key="agent-1",
        safety_identifier="u-1", user="u-1")

    assert response.status == "completed"
    assert len(router.requests) == 1


async def test_auth_is_the_openai_routes(running, router):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}") as http:
        response = await http.post("/v1/responses", json={"model": SERVED, "input": "Hi"})
    assert response.status_code == 401
    assert router.requests == []


async def test_an_error_after_the_first_byte_is_an_error_event(http, slot):  # noqa: F811
    slot.current = FakeRouter((TokenChunk((1,), "Hel"),), error=WorkerFailed("decode-1 died"))

    response = await http.post("/v1/responses", json={
        "model": SERVED, "input": "Hi", "stream": True})

    events = sse_events(response.text)
    assert response.status_code == 200
    assert events[-1]["type"] == "error"
    assert events[-1]["message"] == "decode-1 died"
    assert events[-1]["sequence_number"] == len(events) - 1
    assert "response.completed" not in response.text


async def test_a_client_gone_mid_stream_closes_the_router_stream(http, slot):  # noqa: F811
    router = slot.current = FakeRouter((TokenChunk((1,), "Hello"),), hang=True)

    async with http.stream("POST", "/v1/responses", json={
            "model": SERVED, "input": "Hi", "stream": True}) as response:
        lines = response.aiter_lines()
        while "output_text.delta" not in await anext(lines):
            pass
        assert router.num_closed_streams == 0

    await wait_for_closed_streams(router, 1)
