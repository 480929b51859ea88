"""``cache_control`` on tool definitions and the breakpoints' TTL order (issue 18): a mark on
``tools[i]`` (``/v1/messages``, and Baton's extension on ``/v1/chat/completions``) leases the
prompt exactly through the first i + 1 tools as the chat template renders them; a longer TTL
after a shorter one, or a fifth mark, is a 400 naming the field in each front's error shape.

The real SmolLM2 tokenizer (the ``tiny`` model's) renders tools with Baton's default preamble at
the end of the system turn; a copy of it with a template that puts the tools in the first user
message (as Llama 3.1's does) covers the other path.
"""

from __future__ import annotations

import json

import httpx
import pytest
import pytest_asyncio

from engine.models import prepare_model
from gateway.cache_control import breakpoint_leases, openai_breakpoints
from gateway.openai_http import build_app, start_http
from gateway.openai_models import ChatCompletionRequest
from gateway.openai_requests import ServedModel, prepare
from gateway.sessions import SessionsConfig, breakpoint_lease
from gateway.tokenization import PromptTokenizer
from tests.unit.test_gateway_wire import FakeRouter

SERVED = "tiny"
MAX_MODEL_LEN = 4096
SYSTEM = "You answer in one short sentence."
QUESTION = "Weather in Paris?"
FIVE_MINUTES = {"type": "ephemeral"}
FIVE_MINUTES_EXPLICIT = {"type": "ephemeral", "ttl": "5m"}
ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL_NAMES = ("get_weather", "get_time")

USER_MESSAGE_TOOLS = (
    "{% set ns = namespace(done=false) %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'user' and not ns.done and tools %}Functions:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% set ns.done = true %}{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A template that renders tools into the first user message (as Llama 3.1's does)."""


def spec_text(name: str) -> str:
    """A tool's definition as both renderers write it (``gateway.tool_calls.Tool.spec``)."""
    return json.dumps({"type": "function", "function": {
        "name": name, "description": f"{name} of a city.", "parameters": CITY}})


def openai_tool(name: str, mark: dict | None = None) -> dict:
    tool = {"type": "function", "function": {"name": name, "description": f"{name} of a city.",
                                             "parameters": CITY}}
    return tool if mark is None else {**tool, "cache_control": mark}


def anthropic_tool(name: str, mark: dict | None = None) -> dict:
    tool = {"name": name, "description": f"{name} of a city.", "input_schema": CITY}
    return tool if mark is None else {**tool, "cache_control": mark}


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


@pytest.fixture(scope="module")
def router() -> FakeRouter:
    return FakeRouter()


@pytest_asyncio.fixture(scope="module")
async def running(router, tokenizer):
    app = build_app(router, tokenizer, SERVED, MAX_MODEL_LEN, sessions=SessionsConfig())
    running = await start_http(app, "127.0.0.1", 0)
    yield running
    await running.stop(grace_s=1.0)


@pytest_asyncio.fixture
async def http(running, router):
    router.requests.clear()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}",
                                 timeout=10) as http:
        yield http


def tokens_through(tokenizer: PromptTokenizer, prompt: tuple[int, ...], end: str) -> int:
    """Tokens of the prompt's text up to (not including) ``end``'s first occurrence, checked to
    be the prompt's own leading tokens."""
    hf = tokenizer._tokenizer
    text = hf.decode(list(prompt))
    prefix = hf.encode(text[:text.index(end)], add_special_tokens=False)
    assert list(prompt[:len(prefix)]) == prefix
    return len(prefix)


def tool_body(route: str, with_system: bool) -> dict:
    marks = (ONE_HOUR, FIVE_MINUTES)
    if route == "/v1/messages":
        body = {"messages": [{"role": "user", "content": QUESTION}],
                "tools": [anthropic_tool(n, m) for n, m in zip(TOOL_NAMES, marks)]}
        return {**body, "system": SYSTEM} if with_system else body
    system = [{"role": "system", "content": SYSTEM}] if with_system else []
    return {"messages": [*system, {"role": "user", "content": QUESTION}],
            "tools": [openai_tool(n, m) for n, m in zip(TOOL_NAMES, marks)]}


@pytest.mark.parametrize("with_system", [True, False], ids=["system", "no system"])
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/chat/completions"])
async def test_a_tool_mark_leases_the_prompt_through_the_tools_it_covers(
        http, router, tokenizer, route, with_system):
    response = await http.post(route, json={"model": SERVED, "max_tokens": 4,
                                            **tool_body(route, with_system)})

    assert response.status_code == 200, response.text
    [request] = router.requests
    prompt = request.prompt_token_ids
    text = tokenizer._tokenizer.decode(list(prompt))
    assert text.startswith("<|im_start|>system\n" + (SYSTEM + "\n\n" if with_system else "")
                           + "# Tools")
    # tools[0]: up to where tools[1]'s definition begins; tools[1], the last: the system turn,
    # whose last text is the tools' preamble, through its closing tokens
    through_first = tokens_through(tokenizer, prompt, spec_text("get_time"))
    end_of_system = tokens_through(tokenizer, prompt, "<|im_start|>user")
    assert text[:text.index("<|im_start|>user")].endswith("</tool_call><|im_end|>\n")
    assert request.leases == (breakpoint_lease("", prompt, through_first, 3600.0),
                              breakpoint_lease("", prompt, end_of_system, 300.0))


def test_tools_in_the_first_user_message_lease_where_their_text_ends(tokenizer):
    user_tools = PromptTokenizer(prepare_model("tiny").path)
    user_tools._tokenizer.chat_template = USER_MESSAGE_TOOLS
    assert user_tools.renders_tools
    body = ChatCompletionRequest(
        model=SERVED, messages=[{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": QUESTION}],
        tools=[openai_tool(n, m) for n, m in zip(TOOL_NAMES, (ONE_HOUR, FIVE_MINUTES))])
    prepared = prepare(body, user_tools, ServedModel(SERVED, MAX_MODEL_LEN,
                                                     user_tools.vocab_size))
    prompt = prepared.engine.prompt_token_ids
    text = user_tools._tokenizer.decode(list(prompt))
    assert text.endswith(spec_text("get_time") + "\n" + QUESTION
                         + "<|im_end|>\n<|im_start|>assistant\n")

    marks = openai_breakpoints(body.messages, prepared.turns, body.tools)
    leases = breakpoint_leases(marks, prepared.tools, user_tools, prompt, "")

    # the last tool's lease ends with its definition's line, before the user's own text
    assert leases == (
        breakpoint_lease("", prompt, tokens_through(user_tools, prompt, spec_text("get_time")),
                         3600.0),
        breakpoint_lease("", prompt, tokens_through(user_tools, prompt, QUESTION), 300.0))


def _error(response: httpx.Response, route: str) -> tuple[str, str, str | None]:
    """(type, message, param) of an error answer, in the route's own shape."""
    body = response.json()
    if route == "/v1/messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["type"], body["error"]["message"], None
    return body["error"]["type"], body["error"]["message"], body["error"]["param"]


ORDER = ("a ttl='1h' cache_control breakpoint must not come after the ttl='5m' one at {earlier}; "
         "longer TTLs come first, in the order tools, system, messages: lengthen the earlier "
         "one or shorten this one")

BAD_ORDERS = {
    "Anthropic: a 1h system block after a 5m tool": (
        "/v1/messages", {"system": [{"type": "text", "text": SYSTEM, "cache_control": ONE_HOUR}],
                         "messages": [{"role": "user", "content": QUESTION}],
                         "tools": [anthropic_tool("get_weather", FIVE_MINUTES)]},
        "system[0].cache_control", "tools[0].cache_control"),
    "Anthropic: a 1h request mark after a 5m block": (
        "/v1/messages", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION, "cache_control": FIVE_MINUTES_EXPLICIT}]}],
            "cache_control": ONE_HOUR},
        "cache_control", "messages[0].content[0].cache_control"),
    "OpenAI: a 1h message after a 5m tool": (
        "/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM,
                                               "cache_control": ONE_HOUR},
                                              {"role": "user", "content": QUESTION}],
                                 "tools": [openai_tool("get_weather", FIVE_MINUTES)]},
        "messages[0].cache_control", "tools[0].cache_control"),
    "OpenAI: a 1h part after a 5m message": (
        "/v1/chat/completions", {"messages": [
            {"role": "system", "content": SYSTEM, "cache_control": FIVE_MINUTES},
            {"role": "user", "content": [{"type": "text", "text": QUESTION,
                                          "cache_control": ONE_HOUR}]}]},
        "messages[1].content[0].cache_control", "messages[0].cache_control"),
}


@pytest.mark.parametrize("route, fields, field, earlier", BAD_ORDERS.values(),
                         ids=BAD_ORDERS.keys())
async def test_a_longer_ttl_after_a_shorter_one_is_a_400_naming_both(
        http, router, route, fields, field, earlier):
    response = await http.post(route, json={"model": SERVED, "max_tokens": 4, **fields})

    assert response.status_code == 400, response.text
    kind, message, param = _error(response, route)
    assert kind == "invalid_request_error"
    assert message == f"{field}: " + ORDER.format(earlier=earlier)
    assert param == (None if route == "/v1/messages" else field)
    assert router.requests == []


def too_many(*fields: str) -> str:
    return (f"{fields[-1]}: at most 4 cache_control breakpoints per request, got {len(fields)} "
            f"({', '.join(fields)})")


BAD_TOOL_MARKS = {
    "a fifth mark, counting the tools'": (
        "/v1/chat/completions", {
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": f"part {i}. ", "cache_control": FIVE_MINUTES}
                for i in range(3)]}],
            "tools": [openai_tool(n, FIVE_MINUTES) for n in TOOL_NAMES]},
        "messages[0].content[2].cache_control",
        too_many("tools[0].cache_control", "tools[1].cache_control",
                 "messages[0].content[0].cache_control", "messages[0].content[1].cache_control",
                 "messages[0].content[2].cache_control")),
    "a fifth mark on Anthropic's tools": (
        "/v1/messages", {
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": f"part {i}. ", "cache_control": FIVE_MINUTES}
                for i in range(2)]}],
            "tools": [anthropic_tool(n, FIVE_MINUTES) for n in (*TOOL_NAMES, "get_date")]},
        "messages[0].content[1].cache_control",
        too_many("tools[0].cache_control", "tools[1].cache_control", "tools[2].cache_control",
                 "messages[0].content[0].cache_control", "messages[0].content[1].cache_control")),
    "a bad type on an OpenAI tool": (
        "/v1/chat/completions", {
            "messages": [{"role": "user", "content": QUESTION}],
            "tools": [openai_tool("get_weather", {"type": "persistent"})]},
        "tools[0].cache_control.type",
        "tools[0].cache_control.type must be 'ephemeral', got 'persistent'"),
}


@pytest.mark.parametrize("route, fields, field, message", BAD_TOOL_MARKS.values(),
                         ids=BAD_TOOL_MARKS.keys())
async def test_bad_tool_marks_are_400s_naming_the_field(http, router, route, fields, field,
                                                        message):
    response = await http.post(route, json={"model": SERVED, "max_tokens": 4, **fields})

    assert response.status_code == 400, response.text
    kind, text, param = _error(response, route)
    assert (kind, text) == ("invalid_request_error", message)
    assert param == (None if route == "/v1/messages" else field)
    assert router.requests == []
