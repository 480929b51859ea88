"""The Anthropic Messages API (``/v1/messages``) over real uvicorn, driven by the official
``anthropic`` client, with a scripted ``FakeRouter`` standing in for the engines (the integration
test runs SmolLM2): messages and usage, Anthropic's event stream, tool use parsed and forced,
the request mapping into the prompt, and errors in Anthropic's shape with the client's classes."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest
import pytest_asyncio

from conductor.policy import Overloaded
from gateway.inference import NOT_READY_MESSAGE
from gateway.openai_http import build_app, start_http
from gateway.status import STATUS_BY_ERROR
from gateway.tool_calls import ToolCall, ToolPlan, Turn, render
from protos.errors import WorkerFailed
from protos.wire import TokenChunk
from tests.unit.test_gateway_wire import FakeRouter
from tests.unit.test_openai_http import (  # noqa: F401  (the module's fixtures)
    API_KEY,
    SERVED,
    registry,
    slot,
    tokenizer,
    wait_for_closed_streams,
)
from tests.unit.test_tool_calls import ANSWER, CITY, TIME, WEATHER

MAX_MODEL_LEN = 4096
NUM_PREFILL_CACHED = 16  # what FakeRouter's prefill reports as cached
TOOLS = [{"name": t.name, "description": t.description, "input_schema": t.parameters}
         for t in (WEATHER, TIME)]
HI = [{"role": "user", "content": "Say hello"}]
TOOL_ID = re.compile(r"^toolu_[0-9a-f]{24}$")
UNENFORCEABLE = {"type": "object", "properties": {"a": {"type": 7}}}


def scripted(slot, *texts: str, finish: str = "stop", stop_sequence: str = "",  # noqa: F811
             **router_args) -> FakeRouter:
    """The module's server answers with ``texts`` as deltas, the last one finishing."""
    chunks = [TokenChunk((i,), text) for i, text in enumerate(texts[:-1])]
    chunks.append(TokenChunk((len(texts) - 1,), texts[-1], finish_reason=finish,
                             num_loaded_tokens=12, stop_sequence=stop_sequence))
    slot.current = FakeRouter(chunks, **router_args)
    return slot.current


@pytest_asyncio.fixture(scope="module")
async def running(slot, tokenizer, registry):  # noqa: F811
    app = build_app(slot, tokenizer, SERVED, MAX_MODEL_LEN, frozenset({API_KEY}), registry)
    running = await start_http(app, "127.0.0.1", 0)
    yield running
    await running.stop(grace_s=1.0)


@pytest.fixture
def router(slot) -> FakeRouter:  # noqa: F811
    return scripted(slot, "Hello", " world")


@pytest_asyncio.fixture
async def client(running, router):
    async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{running.port}",
                                        api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest_asyncio.fixture
async def http(running, router):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10,
                                 headers={"x-api-key": API_KEY}) as http:
        yield http


def expected_usage(router: FakeRouter, num_output_tokens: int) -> dict:
    num_prompt_tokens = len(router.requests[0].prompt_token_ids)
    assert num_prompt_tokens > NUM_PREFILL_CACHED
    return {"input_tokens": num_prompt_tokens - NUM_PREFILL_CACHED,
            "cache_read_input_tokens": NUM_PREFILL_CACHED, "cache_creation_input_tokens": 0,
            "output_tokens": num_output_tokens}


def usage_of(message) -> dict:
    usage = message.usage
    return {"input_tokens": usage.input_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "output_tokens": usage.output_tokens}


async def test_a_text_answer_is_a_message_with_anthropic_usage(client, router):
    raw = await client.messages.with_raw_response.create(
        model=SERVED, max_tokens=32, messages=HI, system="Be brief.", stop_sequences=["END"],
        metadata={"user_id": "u-1"},
        extra_headers={"X-Request-Id": "req-7", "anthropic-version": "2023-06-01"},
        extra_body={"temperature": 0.5, "top_p": 0.9})  # this client has no kwargs for them
    message = await raw.parse()

    assert message.id == "msg_req-7"
    assert message._request_id == "req-7"
    assert raw.headers["x-request-id"] == "req-7"
    assert raw.headers["anthropic-version"] == "2023-06-01"  # echoed
    assert (message.type, message.role, message.model) == ("message", "assistant", SERVED)
    assert [block.to_dict() for block in message.content] == [{"type": "text",
                                                               "text": "Hello world"}]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert usage_of(message) == expected_usage(router, num_output_tokens=2)
    assert message.to_dict()["baton"]["placement"]["decode"] == "decode-1"
    [request] = router.requests
    assert request.request_id == "req-7"
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.stop,
            sampling.json_schema) == (32, 0.5, 0.9, ("END",), "")


@pytest.mark.parametrize("finish, stop_sequence, stop", [
    ("length", "", ("max_tokens", None)),
    ("stop", "END", ("stop_sequence", "END")),
    ("stop", "", ("end_turn", None)),
])
async def test_stop_reasons(client, slot, finish, stop_sequence, stop):  # noqa: F811
    scripted(slot, "Hello", finish=finish, stop_sequence=stop_sequence)

    message = await client.messages.create(model=SERVED, max_tokens=8, messages=HI,
                                           stop_sequences=["END"])

    assert (message.stop_reason, message.stop_sequence) == stop


async def test_a_streamed_answer_is_anthropics_event_sequence(client, http, router):
    async with client.messages.stream(model=SERVED, max_tokens=32, messages=HI) as stream:
        texts = [text async for text in stream.text_stream]
        message = await stream.get_final_message()

    assert texts == ["Hello", " world"]
    assert message.content[0].text == "Hello world"
    assert message.stop_reason == "end_turn"
    assert usage_of(message) == expected_usage(router, num_output_tokens=2)

    async with http.stream("POST", "/v1/messages", json={
            "model": SERVED, "max_tokens": 32, "messages": HI, "stream": True}) as response:
        body = (await response.aread()).decode()
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [(event.split("\n")[0], json.loads(event.split("\n")[1].removeprefix("data: ")))
              for event in body.strip().split("\n\n")]
    assert [name for name, _ in events] == [
        "event: message_start", "event: ping", "event: content_block_start",
        "event: content_block_delta", "event: content_block_delta", "event: content_block_stop",
        "event: message_delta", "event: message_stop"]
    assert all(name == f"event: {data['type']}" for name, data in events)
    start = events[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]["output_tokens"]) == ([], None,
                                                                                        0)
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Hello"}
    delta = events[6][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["cache_read_input_tokens"] == NUM_PREFILL_CACHED
    assert delta["baton"]["loaded_tokens"] == 12


def tool_halves(slot) -> FakeRouter:  # noqa: F811
    return scripted(slot, ANSWER[:20], ANSWER[20:61], ANSWER[61:])


def blocks_of(message) -> list[tuple]:
    return [(block.type, block.text) if block.type == "text" else
            (block.type, block.name, block.input) for block in message.content]


EXPECTED_BLOCKS = [("text", "Let me check.\n"), ("tool_use", "get_weather", {"city": "Paris"}),
                   ("tool_use", "get_time", {"zone": "CET"})]


async def test_auto_tool_use_is_parsed_from_the_answer(client, slot):  # noqa: F811
    router = tool_halves(slot)

    message = await client.messages.create(model=SERVED, max_tokens=64, messages=HI,
                                           tools=TOOLS)

    assert blocks_of(message) == EXPECTED_BLOCKS
    assert all(TOOL_ID.match(block.id) for block in message.content[1:])
    assert message.stop_reason == "tool_use"
    assert message.stop_sequence is None
    assert router.requests[0].sampling.json_schema == ""  # auto: parsed, not constrained


async def test_streamed_tool_use_blocks_come_in_order(client, slot):  # noqa: F811
    tool_halves(slot)

    async with client.messages.stream(model=SERVED, max_tokens=64, messages=HI,
                                      tools=TOOLS) as stream:
        raw = [event async for event in stream if event.type in (
            "content_block_start", "content_block_delta", "content_block_stop")]
        message = await stream.get_final_message()

    assert blocks_of(message) == EXPECTED_BLOCKS
    assert message.stop_reason == "tool_use"
    starts = [event for event in raw if event.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "text"), (1, "tool_use"),
                                                                 (2, "tool_use")]
    assert starts[1].content_block.input == {}
    for index in (1, 2):
        partial = "".join(e.delta.partial_json for e in raw if e.type == "content_block_delta"
                          and e.index == index)
        assert json.loads(partial) == message.content[index].input
    stops = [event.index for event in raw if event.type == "content_block_stop"]
    assert stops == [0, 1, 2]


async def test_a_forced_tool_streams_its_input_and_ends_in_tool_use(client, slot):  # noqa: F811
    router = scripted(slot, '{"ci', 'ty": "Nice"}')
    choice = {"type": "tool", "name": "get_weather"}

    async with client.messages.stream(model=SERVED, max_tokens=64, messages=HI, tools=TOOLS,
                                      tool_choice=choice) as stream:
        message = await stream.get_final_message()

    assert blocks_of(message) == [("tool_use", "get_weather", {"city": "Nice"})]
    assert TOOL_ID.match(message.content[0].id)
    assert message.stop_reason == "tool_use"
    assert router.requests[0].sampling.json_schema == ToolPlan(
        (WEATHER, TIME), "named", "get_weather").constraint()
    assert json.loads(router.requests[0].sampling.json_schema) == CITY


async def test_a_forced_call_cut_off_by_max_tokens_is_left_out(client, slot):  # noqa: F811
    scripted(slot, '{"ci', 'ty": "Ni', finish="length")

    message = await client.messages.create(
        model=SERVED, max_tokens=3, messages=HI, tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"})

    assert (message.content, message.stop_reason) == ([], "max_tokens")


async def test_tool_choices_become_the_plans_grammar(client, router):
    for tool_choice in ({"type": "any", "disable_parallel_tool_use": True},
                        {"type": "tool", "name": "get_time"}, {"type": "none"},
                        {"type": "auto"}):
        await client.messages.create(model=SERVED, max_tokens=8, messages=HI, tools=TOOLS,
                                     tool_choice=tool_choice)

    any_, named, none, auto = (request.sampling.json_schema for request in router.requests)
    tools = (WEATHER, TIME)
    assert any_ == ToolPlan(tools, "required", parallel=False).constraint()
    assert json.loads(any_)["maxItems"] == 1
    assert named == ToolPlan(tools, "named", "get_time").constraint()
    assert none == auto == ""
    prompts = {request.prompt_token_ids for request in router.requests}
    assert len(prompts) == 1  # the tools render the same prefix whatever the choice


async def test_history_renders_into_the_prompt(client, router, tokenizer):  # noqa: F811
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                     {"type": "text", "text": "Paris?",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"zone": "CET"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": '{"temp": 18}'}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no clock",
             "is_error": True},
            {"type": "text", "text": "Thanks"}]},
    ]
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]

    await client.messages.create(model=SERVED, max_tokens=8, messages=messages, system=system,
                                 tools=TOOLS)
    counted = await client.messages.count_tokens(model=SERVED, messages=messages,
                                                 system=system, tools=TOOLS)

    turns = [
        Turn("system", "Be brief."), Turn("user", "Weather in Paris?"),
        Turn("assistant", "Checking.", (ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),
                                        ToolCall("toolu_2", "get_time", '{"zone": "CET"}'))),
        Turn("tool", '{"temp": 18}', tool_call_id="toolu_1"),
        Turn("tool", "Error: no clock", tool_call_id="toolu_2"), Turn("user", "Thanks"),
    ]
    rendered = render(turns, ToolPlan((WEATHER, TIME), "auto"), tokenizer.renders_tools)
    expected = tokenizer.encode_conversation(rendered.messages, rendered.tools)
    [request] = router.requests
    assert list(request.prompt_token_ids) == expected
    assert counted.input_tokens == len(expected)
    prompt = tokenizer._tokenizer.decode(request.prompt_token_ids)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in prompt)
    assert "<tool_response>\nError: no clock\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt.split("<tools>\n")[1]


async def test_a_last_assistant_message_is_a_prefill_the_model_continues(client, router,
                                                                        tokenizer):  # noqa: F811
    messages = HI + [{"role": "assistant", "content": [{"type": "text", "text": "Hello"},
                                                       {"type": "text", "text": " there,"}]}]

    message = await client.messages.create(model=SERVED, max_tokens=8, messages=messages)
    counted = await client.messages.count_tokens(model=SERVED, messages=messages)

    hf = tokenizer._tokenizer
    text = hf.apply_chat_template(HI + [{"role": "assistant", "content": "Hello there,"}],
                                  continue_final_message=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\nHello there,")  # left open, no end of turn
    [request] = router.requests
    assert list(request.prompt_token_ids) == hf.encode(text, add_special_tokens=False)
    assert counted.input_tokens == len(request.prompt_token_ids)
    assert message.content[0].text == "Hello world"  # the continuation only, as Anthropic


@pytest.mark.parametrize("last, fields, words", [
    ([{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "P"}}],
     {"tools": TOOLS}, "carries tool calls"),
    ("Sure", {"tools": TOOLS, "tool_choice": {"type": "any"}}, "forced tool call"),
    ("", {}, "empty"),
])
async def test_a_prefill_that_cannot_be_continued_is_refused(client, router, last, fields,
                                                             words):
    messages = HI + [{"role": "assistant", "content": last}]
    with pytest.raises(anthropic.BadRequestError, match=words):
        await client.messages.create(model=SERVED, max_tokens=8, messages=messages, **fields)
    assert router.requests == []


async def test_a_client_gone_mid_stream_closes_the_router_stream(http, slot):  # noqa: F811
    router = slot.current = FakeRouter((TokenChunk((1,), "Hello"),), hang=True)

    async with http.stream("POST", "/v1/messages", json={
            "model": SERVED, "max_tokens": 8, "messages": HI, "stream": True}) as response:
        lines = response.aiter_lines()
        while "text_delta" not in await anext(lines):
            pass
        assert router.num_closed_streams == 0

    await wait_for_closed_streams(router, 1)


async def test_an_error_after_the_first_byte_is_an_error_event(http, slot):  # noqa: F811
    slot.current = FakeRouter((TokenChunk((1,), "Hel"),), error=WorkerFailed("decode-1 died"))

    response = await http.post("/v1/messages", json={
        "model": SERVED, "max_tokens": 8, "messages": HI, "stream": True})

    events = response.text.strip().split("\n\n")
    assert response.status_code == 200
    assert events[-1] == ('event: error\ndata: {"type":"error","error":{"type":"api_error",'
                          '"message":"decode-1 died"}}')
    assert "message_stop" not in response.text


class OverloadedRouter(FakeRouter):
    """Admission refuses every request, as the conductor does when the cluster is full."""

    async def stream(self, request):
        self.requests.append(request)
        raise Overloaded("every instance would miss its TTFT target; retry in 3 s", 3)
        yield  # an async generator, like a real router's stream


def test_the_overloaded_kind_is_the_only_one_answered_429():
    # gateway.anthropic_errors answers 429 as 529: that is only right while this holds
    assert [kind for kind, row in STATUS_BY_ERROR.items() if row.http_status == 429] == [
        Overloaded]


@pytest.mark.parametrize("case, error_class, status, error_type", [
    ("unknown field", anthropic.BadRequestError, 400, "invalid_request_error"),
    ("thinking", anthropic.BadRequestError, 400, "invalid_request_error"),
    ("top_k", anthropic.BadRequestError, 400, "invalid_request_error"),
    ("assistant last", anthropic.BadRequestError, 400, "invalid_request_error"),
    ("unknown tool", anthropic.BadRequestError, 400, "invalid_request_error"),
    pytest.param("unenforceable tool", anthropic.BadRequestError, 400, "invalid_request_error",
                 marks=pytest.mark.vllm),  # vLLM's structured-output backend refuses the schema
    ("wrong key", anthropic.AuthenticationError, 401, "authentication_error"),
    ("unknown model", anthropic.NotFoundError, 404, "not_found_error"),
    ("overloaded", anthropic.OverloadedError, 529, "overloaded_error"),
    ("not ready", anthropic.ServiceUnavailableError, 503, "api_error"),
])
async def test_errors_are_anthropic_shaped_and_land_on_the_clients_classes(
        running, slot, case, error_class, status, error_type):  # noqa: F811
    slot.current = (OverloadedRouter() if case == "overloaded" else
                    FakeRouter(ready=case != "not ready"))
    fields = {
        "unknown field": {"extra_body": {"frobnicate": 1}},
        "thinking": {"thinking": {"type": "enabled", "budget_tokens": 2048}},
        "top_k": {"extra_body": {"top_k": -5}},
        "assistant last": {"messages": HI + [{"role": "assistant", "content": "Hel "}]},
        "unknown tool": {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        "unenforceable tool": {"tools": [{"name": "bad", "input_schema": UNENFORCEABLE}],
                               "tool_choice": {"type": "any"}},
        "unknown model": {"model": "claude-sonnet-4-5"},
    }.get(case, {})
    key = "sk-wrong" if case == "wrong key" else API_KEY
    async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{running.port}",
                                        api_key=key, max_retries=0) as client:
        with pytest.raises(error_class) as info:
            await client.messages.create(**({"model": SERVED, "max_tokens": 8, "messages": HI}
                                            | fields))

    error = info.value
    assert error.status_code == status
    assert error.body["type"] == "error"
    assert error.body["error"]["type"] == error_type
    message = error.body["error"]["message"]
    expected_start = {"unknown field": "frobnicate: unknown field",
                      "thinking": "thinking: extended thinking is not served",
                      "top_k": "top_k must be an integer: a count of tokens >= 1",
                      "assistant last": "messages: final assistant content cannot end with "
                      "trailing whitespace",
                      "unknown tool": "tool_choice names the function 'nope'",
                      "unenforceable tool": "tools: the forced call's schema (from "
                      "tools[].input_schema) is a JSON Schema the structured-output backend "
                      "cannot enforce",
                      "wrong key": "missing or invalid API key",
                      "unknown model": "model 'claude-sonnet-4-5' is not served here",
                      "overloaded": "every instance would miss its TTFT target",
                      "not ready": NOT_READY_MESSAGE}[case]
    assert message.startswith(expected_start), message
    retry_after = {"overloaded": "3", "not ready": "1"}.get(case)
    assert error.response.headers.get("retry-after") == retry_after


async def test_bearer_auth_is_accepted_and_bad_bodies_are_400_not_422(running, http, router):
    async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{running.port}",
                                        api_key=None, auth_token=API_KEY,
                                        max_retries=0) as client:
        message = await client.messages.create(model=SERVED, max_tokens=8, messages=HI)
    assert message.content[0].text == "Hello world"

    malformed = await http.post("/v1/messages", content=b'{"model": "tiny", "max_tokens": ',
                                headers={"content-type": "application/json"})
    missing = await http.post("/v1/messages", json={"model": SERVED, "messages": HI})
    image = await http.post("/v1/messages", json={"model": SERVED, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})

    for response in (malformed, missing, image):
        assert response.status_code == 400
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert malformed.json()["error"]["message"].startswith(
        "the request body is not valid JSON")
    assert missing.json()["error"]["message"].startswith("max_tokens: Field required")
    assert "'image'" in image.json()["error"]["message"]
    assert len(router.requests) == 1  # the bearer-authenticated one
    # the OpenAI routes keep OpenAI's shape and their own auth
    openai_shaped = await http.post("/v1/chat/completions", content=b"{",
                                    headers={"Authorization": f"Bearer {API_KEY}"})
    assert openai_shaped.status_code == 400 and "error" in openai_shaped.json()
    assert "type" not in openai_shaped.json()
