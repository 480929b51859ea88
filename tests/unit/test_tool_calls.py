"""Tool calling's logic: the parsers (the same pieces whether the text comes whole or token by
token), the grammars of forced calls, the rendering of tools and of a tool loop's history, and
the OpenAI front's answers over real uvicorn and the official ``openai`` client, with a scripted
``FakeRouter`` standing in for the engines (the integration test runs SmolLM2)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from gateway.openai_http import build_app, start_http
from gateway.tool_calls import Tool, ToolCall, ToolPlan, Turn, render
from gateway.tool_parsers import CallArguments, CallStart, TextPiece, ToolOutput
from protos.wire import TokenChunk
from tests.unit.test_gateway_wire import FakeRouter
from tests.unit.test_openai_http import (  # noqa: F401  (the module's fixtures)
    API_KEY,
    SERVED,
    registry,
    slot,
    tokenizer,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = Tool("get_weather", "Weather in a city.", CITY)
TIME = Tool("get_time", "Time in a zone.", {"type": "object", "properties": {
    "zone": {"type": "string"}}, "required": ["zone"]})
AUTO = ToolPlan((WEATHER, TIME), "auto")
ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}'
          '</tool_call>')


def run(plan: ToolPlan | None, deltas: list[str]) -> tuple[ToolOutput, list]:
    output = ToolOutput(plan)
    pieces = [piece for delta in deltas for piece in output.feed(delta)] + output.close()
    return output, pieces


def calls_of(output: ToolOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in output.calls]


@pytest.mark.parametrize("split", ["whole", "by character", "by 7"])
def test_hermes_calls_and_content_are_the_same_however_the_text_arrives(split):
    deltas = {"whole": [ANSWER], "by character": list(ANSWER),
              "by 7": [ANSWER[i:i + 7] for i in range(0, len(ANSWER), 7)]}[split]

    output, pieces = run(AUTO, deltas)

    assert calls_of(output) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert output.content() == "Let me check.\n"
    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == "Let me check.\n"
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "get_time")]
    assert [s.id for s in starts] == [call.id for call in output.calls]
    for index, call in enumerate(output.calls):  # each call opens before its arguments
        first_argument = next(i for i, p in enumerate(pieces)
                              if isinstance(p, CallArguments) and p.index == index)
        assert pieces.index(starts[index]) < first_argument
        assert "".join(p.fragment for p in pieces
                       if isinstance(p, CallArguments) and p.index == index) == call.arguments


@pytest.mark.parametrize("text, content", [
    ('<tool_call>{"name": "send_mail", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "send_mail", "arguments": {}}</tool_call>'),  # not offered
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),  # broken JSON
    ("a < b and <tool_cal", "a < b and <tool_cal"),  # a tag's prefix, never completed
])
def test_text_that_is_not_a_call_of_an_offered_function_stays_content(text, content):
    output, _ = run(AUTO, list(text))

    assert output.calls == []
    assert output.content() == content


def test_an_unterminated_last_call_is_still_a_call_and_parallel_false_keeps_the_first():
    text = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert calls_of(run(AUTO, [text])[0]) == [("get_time", {"zone": "UTC"}),
                                               ("get_weather", {"city": "Oslo"})]
    single = ToolPlan(AUTO.tools, "auto", parallel=False)
    assert calls_of(run(single, [text])[0]) == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("text, calls, content", [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}',
     [("get_weather", {"city": "Rome"})], None),
    (' [{"name": "get_time", "arguments": {"zone": "PST"}}, '
     '{"name": "get_weather", "arguments": {"city": "Lima"}}]',
     [("get_time", {"zone": "PST"}), ("get_weather", {"city": "Lima"})], None),
    ("It is sunny {mostly}.", [], "It is sunny {mostly}."),
    ('{"not": "a call"}', [], '{"not": "a call"}'),
])
def test_the_json_parser_takes_a_whole_answer_call_or_leaves_content(text, calls, content):
    plan = ToolPlan(AUTO.tools, "auto", parser="json")
    output, _ = run(plan, list(text))
    assert calls_of(output) == calls
    assert output.content() == content


def test_a_named_call_streams_its_arguments_as_generated():
    output, pieces = run(ToolPlan(AUTO.tools, "named", "get_weather"), ['{"ci', 'ty": "Nice"}'])

    call = output.calls[0]
    assert pieces == [CallStart(0, call.id, "get_weather"), CallArguments(0, '{"ci'),
                      CallArguments(0, 'ty": "Nice"}')]
    assert calls_of(output) == [("get_weather", {"city": "Nice"})]


def test_required_answers_split_into_calls_and_the_grammars_hold_the_schemas():
    array = ('[{"name":"get_weather","arguments":{"city":"Bern"}},'
             '{"name":"get_time","arguments":{"zone":"CET"}}]')
    required = ToolPlan(AUTO.tools, "required")
    assert calls_of(run(required, list(array))[0]) == [("get_weather", {"city": "Bern"}),
                                                        ("get_time", {"zone": "CET"})]

    schema = json.loads(required.constraint())
    jsonschema.validate(json.loads(array), schema)
    for wrong in ([], [{"name": "get_weather", "arguments": {"town": "Bern"}}],
                  [{"name": "get_mail", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    one = json.loads(ToolPlan(AUTO.tools, "required", parallel=False).constraint())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(array), one)
    assert json.loads(ToolPlan(AUTO.tools, "named", "get_weather").constraint()) == CITY
    assert AUTO.constraint() == ""


def test_the_default_rendering_and_a_tool_loop_keeps_the_first_prompt_as_a_prefix(tokenizer):
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    first = [Turn("system", "Be brief."), Turn("user", "Weather in Paris?")]
    loop = first + [Turn("assistant", "", (call,)), Turn("tool", '{"temp": 18}', (), "call_1")]

    rendered = render(loop, AUTO, native=False)

    system, _, assistant, tool = rendered.messages
    assert system["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER.spec()) in system["content"]
    assert assistant == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                         '"arguments": {"city": "Paris"}}\n</tool_call>'}
    assert tool == {"role": "tool", "content": '<tool_response>\n{"temp": 18}\n</tool_response>'}
    assert rendered.tools is None
    step1 = tokenizer.encode_conversation(render(first, AUTO, native=False).messages)
    step2 = tokenizer.encode_conversation(rendered.messages)
    assert step2[:len(step1)] == step1


def test_a_template_that_renders_tools_gets_them_structured():
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    rendered = render([Turn("assistant", "", (call,)), Turn("tool", "18", (), "call_1")], AUTO,
                      native=True)
    assert rendered.tools == [WEATHER.spec(), TIME.spec()]
    assert rendered.messages == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18", "tool_call_id": "call_1"}]


# -- the OpenAI front, with scripted engine output ----------------------------------------------

TOOLS = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                           "parameters": t.parameters}} for t in (WEATHER, TIME)]
HALVES = (ANSWER[:20], ANSWER[20:61], ANSWER[61:])


@pytest_asyncio.fixture(scope="module")
async def running(slot, tokenizer, registry):  # noqa: F811
    app = build_app(slot, tokenizer, SERVED, 4096, frozenset({API_KEY}), registry)
    running = await start_http(app, "127.0.0.1", 0)
    yield running
    await running.stop()


@pytest.fixture
def router(slot) -> FakeRouter:  # noqa: F811
    chunks = [TokenChunk((i,), text) for i, text in enumerate(HALVES[:-1])]
    slot.current = FakeRouter(chunks + [TokenChunk((9,), HALVES[-1], finish_reason="stop")])
    return slot.current


@pytest_asyncio.fixture
async def client(running, router):
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1",
                                  api_key=API_KEY, max_retries=0) as client:
        yield client


async def test_auto_calls_come_back_parsed_with_finish_reason_tool_calls(client, router):
    answer = await client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Paris?"}], tools=TOOLS)

    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
            ] == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    [request] = router.requests
    assert request.sampling.json_schema == ""  # auto: parsed, not constrained


async def test_streamed_auto_calls_are_openai_deltas(client, router):
    stream = await client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Paris?"}], tools=TOOLS, stream=True)
    content, calls, finish = "", {}, None
    async for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.id:
                assert delta.type == "function" and delta.function.arguments == ""
                call["id"], call["name"] = delta.id, delta.function.name
            else:
                assert delta.function.name is None
                call["arguments"] += delta.function.arguments

    assert content == "Let me check.\n"
    assert finish == "tool_calls"
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


async def test_forced_choices_become_the_grammar_and_tools_reach_the_prompt(client, router,
                                                                            tokenizer):
    await client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    await client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False)
    await client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")

    named, required, none = router.requests
    assert json.loads(named.sampling.json_schema) == CITY
    assert json.loads(required.sampling.json_schema)["maxItems"] == 1
    assert none.sampling.json_schema == ""
    prompt = tokenizer._tokenizer.decode(none.prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_time"' in prompt
