"""Agent sessions and ``cache_control`` at the fronts (issue 18): the session id a request names on
HTTP (OpenAI and Anthropic) and gRPC, scoped to its key and tenant; its lease; breakpoints leased
to the exact token length of the prefix they mark; the 400s; the usage counts; closing a session.

A ``SessionRouter`` (the gateway tests' ``FakeRouter``, which reports 16 prompt tokens cached)
records the ``EngineRequest`` each front built and closes the sessions it was told are live.
"""

from __future__ import annotations

import json
import math

import grpc
import httpx
import pytest
import pytest_asyncio

from engine.models import prepare_model
from gateway.admin import AdminServicer
from gateway.cache_control import Breakpoint, breakpoint_leases
from gateway.inference import InferenceServicer, start_gateway
from gateway.openai_http import build_app, start_http
from gateway.sessions import (
    InvalidField,
    SessionsConfig,
    breakpoint_lease,
    scoped_session_id,
    session_lease,
)
from gateway.tokenization import PromptTokenizer
from protos.baton.v1 import admin_pb2 as apb
from protos.baton.v1 import admin_pb2_grpc as apb_grpc
from protos.baton.v1 import inference_pb2 as pb
from protos.baton.v1 import inference_pb2_grpc as pb_grpc
from protos.wire import SessionEnd
from tests.unit.test_gateway_wire import FakeRouter

SERVED = "tiny"
MAX_MODEL_LEN = 4096
KEY_A, KEY_B = "sk-alpha", "sk-beta"
ADMIN_KEY = "adm-sessions-key"
CACHED = 16  # what FakeRouter's prefill reports as cached
HI = [{"role": "user", "content": "Say hello to the whole team, please."}]
FIVE_MINUTES = {"type": "ephemeral"}
ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}


class SessionRouter(FakeRouter):
    """A ``FakeRouter`` that also closes sessions: ``live`` maps a scoped id to its end."""

    def __init__(self, live: dict[str, SessionEnd] | None = None) -> None:
        super().__init__()
        self.live = dict(live or {})
        self.closed: list[str] = []

    async def close_session(self, scoped_id: str) -> SessionEnd | None:
        self.closed.append(scoped_id)
        return self.live.pop(scoped_id, None)


class Slot:
    """The module's servers route through whichever router the current test made."""

    current: FakeRouter

    def is_ready(self) -> bool:
        return self.current.is_ready()

    def stream(self, request):
        return self.current.stream(request)

    async def close_session(self, scoped_id: str):
        close = getattr(self.current, "close_session", None)
        return None if close is None else await close(scoped_id)


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


@pytest.fixture(scope="module")
def slot() -> Slot:
    return Slot()


@pytest.fixture
def router(slot) -> SessionRouter:
    slot.current = SessionRouter()
    return slot.current


async def _serving(slot, tokenizer, sessions: SessionsConfig):
    app = build_app(slot, tokenizer, SERVED, MAX_MODEL_LEN, frozenset({KEY_A, KEY_B}),
                    sessions=sessions)
    return await start_http(app, "127.0.0.1", 0)


@pytest_asyncio.fixture(scope="module")
async def running(slot, tokenizer):
    running = await _serving(slot, tokenizer, SessionsConfig())
    yield running
    await running.stop(grace_s=1.0)


@pytest_asyncio.fixture
async def http(running, router):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10,
                                 headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        yield http


def chat(**fields) -> dict:
    return {"model": SERVED, "max_tokens": 4, "messages": HI, **fields}


def anthropic_body(**fields) -> dict:
    return {"model": SERVED, "max_tokens": 4, "messages": HI, **fields}


def rendered_ids(tokenizer: PromptTokenizer, messages: list[dict], generation: bool) -> list[int]:
    """The token ids of ``messages`` under the model's template, straight from Hugging Face."""
    hf = tokenizer._tokenizer
    text = hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    return hf.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------ session ids (HTTP)


@pytest.mark.parametrize("how", ["header", "body"])
async def test_the_header_or_the_body_names_the_scoped_session(http, router, tokenizer, how):
    headers = {"X-Session-Id": "agent-7"} if how == "header" else {}
    fields = {"session_id": "agent-7"} if how == "body" else {}

    response = await http.post("/v1/chat/completions", json=chat(**fields), headers=headers)

    assert response.status_code == 200, response.text
    [request] = router.requests
    scoped = scoped_session_id(KEY_A, "", "agent-7")
    assert request.session_id == scoped
    prompt = rendered_ids(tokenizer, HI, generation=True)
    assert request.prompt_token_ids == tuple(prompt)
    assert request.leases == (session_lease(scoped, "", 300.0, len(prompt)),)
    assert request.leases[0].include_output is True
    assert request.expected_next_step_s == 0.0


async def test_the_same_id_under_another_key_or_tenant_is_another_session(http, router):
    await http.post("/v1/chat/completions", json=chat(session_id="s"))
    await http.post("/v1/chat/completions", json=chat(session_id="s"),
                    headers={"Authorization": f"Bearer {KEY_B}"})
    await http.post("/v1/chat/completions", json=chat(session_id="s", tenant="acme"))
    await http.post("/v1/completions", json={"model": SERVED, "prompt": "Hello world",
                                             "session_id": "s", "cache_salt": "acme"})

    ids = [request.session_id for request in router.requests]
    assert ids == [scoped_session_id(KEY_A, "", "s"), scoped_session_id(KEY_B, "", "s"),
                   scoped_session_id(KEY_A, "acme", "s"), scoped_session_id(KEY_A, "acme", "s")]
    assert len(set(ids)) == 3
    assert [lease.tenant for request in router.requests for lease in request.leases] == [
        "", "", "acme", "acme"]


async def test_ttl_and_next_step_hint_ride_on_the_request(http, router, tokenizer):
    response = await http.post("/v1/chat/completions", json=chat(
        session_id="agent-1", session_ttl_s=120, expected_next_step_s=7.5))

    assert response.status_code == 200, response.text
    [request] = router.requests
    scoped = scoped_session_id(KEY_A, "", "agent-1")
    assert request.leases == (session_lease(scoped, "", 120.0,
                                            len(request.prompt_token_ids)),)
    assert request.expected_next_step_s == 7.5


async def test_the_anthropic_route_scopes_with_its_x_api_key(running, router):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10) as http:
        by_header = await http.post("/v1/messages", json=anthropic_body(), headers={
            "x-api-key": KEY_B, "X-Session-Id": "claude-1"})
        by_body = await http.post("/v1/messages", json=anthropic_body(
            session_id="claude-1", session_ttl_s=60, expected_next_step_s=2), headers={
            "x-api-key": KEY_B})

    assert (by_header.status_code, by_body.status_code) == (200, 200), by_body.text
    scoped = scoped_session_id(KEY_B, "", "claude-1")
    first, second = router.requests
    assert (first.session_id, second.session_id) == (scoped, scoped)
    assert [lease.ttl_s for lease in first.leases + second.leases] == [300.0, 60.0]
    assert second.expected_next_step_s == 2.0


async def test_the_responses_route_names_the_scoped_session(running, router, slot, tokenizer):
    body = {"model": SERVED, "input": "Say hello to the whole team, please.",
            "max_output_tokens": 4}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10,
                                 headers={"Authorization": f"Bearer {KEY_B}"}) as http:
        by_header = await http.post("/v1/responses", json=body,
                                    headers={"X-Session-Id": "codex-1"})
        by_body = await http.post("/v1/responses", json=body | {
            "session_id": "codex-1", "session_ttl_s": 60, "expected_next_step_s": 2})
        by_user = await http.post("/v1/responses", json=body | {"user": "alice"})
    running_by_user = await _serving(slot, tokenizer, SessionsConfig(session_from_user=True))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running_by_user.port}",
                                     timeout=10,
                                     headers={"Authorization": f"Bearer {KEY_A}"}) as other:
            by_identifier = await other.post("/v1/responses", json=body | {
                "safety_identifier": "bob"})
    finally:
        await running_by_user.stop(grace_s=1.0)

    assert {r.status_code for r in (by_header, by_body, by_user, by_identifier)} == {200}
    scoped = scoped_session_id(KEY_B, "", "codex-1")
    first, second, third, fourth = router.requests
    assert (first.session_id, second.session_id, third.session_id) == (scoped, scoped, "")
    assert fourth.session_id == scoped_session_id(KEY_A, "", "bob")
    assert [lease.ttl_s for lease in first.leases + second.leases] == [300.0, 60.0]
    assert first.leases[0] == session_lease(scoped, "", 300.0, len(first.prompt_token_ids))
    assert second.expected_next_step_s == 2.0


async def test_user_is_the_session_only_where_configured(http, slot, tokenizer, router):
    await http.post("/v1/chat/completions", json=chat(user="alice"))
    assert (router.requests[0].session_id, router.requests[0].leases) == ("", ())

    running = await _serving(slot, tokenizer, SessionsConfig(session_from_user=True))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10,
                                     headers={"Authorization": f"Bearer {KEY_A}"}) as other:
            by_user = await other.post("/v1/chat/completions", json=chat(user="alice"))
            by_id = await other.post("/v1/chat/completions",
                                     json=chat(user="alice", session_id="explicit"))
            by_metadata = await other.post("/v1/messages", json=anthropic_body(
                metadata={"user_id": "bob"}))
    finally:
        await running.stop(grace_s=1.0)

    assert {by_user.status_code, by_id.status_code, by_metadata.status_code} == {200}
    assert [request.session_id for request in router.requests[1:]] == [
        scoped_session_id(KEY_A, "", "alice"), scoped_session_id(KEY_A, "", "explicit"),
        scoped_session_id(KEY_A, "", "bob")]


async def test_disabled_sessions_accept_the_fields_and_ignore_them(slot, tokenizer, router):
    running = await _serving(slot, tokenizer, SessionsConfig(enabled=False))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10,
                                     headers={"Authorization": f"Bearer {KEY_A}"}) as http:
            marked = [{"role": "user", "content": "hi", "cache_control": FIVE_MINUTES}]
            ok = await http.post("/v1/chat/completions", json=chat(
                messages=marked, session_id="a", session_ttl_s=60, expected_next_step_s=3))
            bad = await http.post("/v1/chat/completions", json=chat(session_id="a",
                                                                    session_ttl_s=-1))
    finally:
        await running.stop(grace_s=1.0)

    assert ok.status_code == 200, ok.text
    [request] = router.requests
    assert (request.session_id, request.leases, request.expected_next_step_s) == ("", (), 0.0)
    assert ok.json()["usage"]["cache_creation_input_tokens"] == 0
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "session_ttl_s")


BAD_SESSION_FIELDS = {
    "negative ttl": ({"session_id": "a", "session_ttl_s": -1}, {}, "session_ttl_s"),
    "NaN ttl": ({"session_id": "a", "session_ttl_s": math.nan}, {}, "session_ttl_s"),
    "ttl over the max": ({"session_id": "a", "session_ttl_s": 3601}, {}, "session_ttl_s"),
    "ttl without a session": ({"session_ttl_s": 60}, {}, "session_ttl_s"),
    "negative next step": ({"session_id": "a", "expected_next_step_s": -0.5}, {},
                           "expected_next_step_s"),
    "NaN next step": ({"session_id": "a", "expected_next_step_s": math.nan}, {},
                      "expected_next_step_s"),
    "next step without a session": ({"expected_next_step_s": 5}, {}, "expected_next_step_s"),
    "id too long": ({"session_id": "x" * 129}, {}, "session_id"),
    "unprintable id": ({"session_id": "a\x07b"}, {}, "session_id"),
    "header too long": ({}, {"X-Session-Id": "y" * 129}, "X-Session-Id"),
    "header and body differ": ({"session_id": "a"}, {"X-Session-Id": "b"}, "session_id"),
}


@pytest.mark.parametrize("fields, headers, param", BAD_SESSION_FIELDS.values(),
                         ids=BAD_SESSION_FIELDS.keys())
async def test_bad_session_fields_are_400s_naming_the_field(http, router, fields, headers, param):
    body = json.dumps(chat(**fields))  # NaN travels as JSON's NaN literal, as Python writes it
    response = await http.post("/v1/chat/completions", content=body, headers={
        **headers, "content-type": "application/json"})

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"]
    assert router.requests == []


async def test_anthropic_session_errors_name_the_field(http, router):
    response = await http.post("/v1/messages", json=anthropic_body(session_ttl_s=30))

    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["message"].startswith("session_ttl_s")


# ------------------------------------------------------------------ cache_control


SYSTEM = "You are a careful assistant. Answer in one short sentence."
HISTORY = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
DOCUMENT = "The report covers three quarters of sales in four regions."


async def test_a_marked_message_leases_exactly_its_rendered_prefix(http, router, tokenizer):
    messages = [dict(m) for m in HISTORY]
    messages[1]["cache_control"] = ONE_HOUR

    response = await http.post("/v1/chat/completions", json=chat(messages=messages))

    assert response.status_code == 200, response.text
    [request] = router.requests
    prompt = rendered_ids(tokenizer, HISTORY, generation=True)
    prefix = rendered_ids(tokenizer, HISTORY[:2], generation=False)
    assert request.prompt_token_ids == tuple(prompt)
    assert prompt[:len(prefix)] == prefix
    assert request.leases == (breakpoint_lease("", prompt, len(prefix), 3600.0),)
    assert request.leases[0].num_tokens == len(prefix)
    assert request.session_id == ""
    usage = response.json()["usage"]
    assert (usage["cache_creation_input_tokens"], usage["cache_read_input_tokens"]) == (
        len(prefix) - CACHED, CACHED)
    assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED}


async def test_a_marked_content_part_leases_up_to_the_end_of_the_part(http, router, tokenizer):
    parts = [{"type": "text", "text": "Read this. "},
             {"type": "text", "text": DOCUMENT, "cache_control": FIVE_MINUTES},
             {"type": "text", "text": " Then summarise it."}]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]

    response = await http.post("/v1/chat/completions", json=chat(messages=messages),
                               headers={"X-Session-Id": "doc"})

    assert response.status_code == 200, response.text
    [request] = router.requests
    flat = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Read this. " + DOCUMENT + " Then summarise it."}]
    prompt = rendered_ids(tokenizer, flat, generation=True)
    text = tokenizer._tokenizer.apply_chat_template(flat, add_generation_prompt=True,
                                                    tokenize=False)
    end_of_part = text.index(DOCUMENT) + len(DOCUMENT)
    prefix = tokenizer._tokenizer.encode(text[:end_of_part], add_special_tokens=False)
    assert prompt[:len(prefix)] == prefix
    scoped = scoped_session_id(KEY_A, "", "doc")
    assert request.leases == (session_lease(scoped, "", 300.0, len(prompt)),
                              breakpoint_lease("", prompt, len(prefix), 300.0))


async def test_anthropic_breakpoints_on_system_blocks_messages_and_tools(http, router, tokenizer):
    system = [{"type": "text", "text": SYSTEM, "cache_control": ONE_HOUR},
              {"type": "text", "text": " Be kind."}]
    messages = [{"role": "user", "content": [
                    {"type": "text", "text": DOCUMENT, "cache_control": FIVE_MINUTES}]},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": "Summarise it."}]

    response = await http.post("/v1/messages", json=anthropic_body(system=system,
                                                                   messages=messages))

    assert response.status_code == 200, response.text
    [request] = router.requests
    full = [{"role": "system", "content": SYSTEM + " Be kind."},
            {"role": "user", "content": DOCUMENT}, {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Summarise it."}]
    prompt = rendered_ids(tokenizer, full, generation=True)
    text = tokenizer._tokenizer.apply_chat_template(full, add_generation_prompt=True,
                                                    tokenize=False)
    system_prefix = tokenizer._tokenizer.encode(text[:text.index(SYSTEM) + len(SYSTEM)],
                                                add_special_tokens=False)
    message_prefix = rendered_ids(tokenizer, full[:2], generation=False)
    assert prompt[:len(system_prefix)] == system_prefix
    assert prompt[:len(message_prefix)] == message_prefix
    assert request.leases == (breakpoint_lease("", prompt, len(system_prefix), 3600.0),
                              breakpoint_lease("", prompt, len(message_prefix), 300.0))
    usage = response.json()["usage"]
    created = len(message_prefix) - CACHED
    assert usage == {"input_tokens": len(prompt) - CACHED - created,
                     "cache_creation_input_tokens": created,
                     "cache_read_input_tokens": CACHED, "output_tokens": 4}


async def test_a_tool_breakpoint_leases_the_tools_with_the_system_turn(http, router, tokenizer):
    tool = {"name": "get_weather", "description": "Weather of a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            "cache_control": FIVE_MINUTES}

    response = await http.post("/v1/messages", json=anthropic_body(system=SYSTEM, tools=[tool]))

    assert response.status_code == 200, response.text
    [request] = router.requests
    prompt = list(request.prompt_token_ids)
    end_of_system = prompt.index(prompt[0], 1)  # the second <|im_start|>: the user turn's
    [lease] = request.leases
    assert lease == breakpoint_lease("", prompt, end_of_system, 300.0)
    assert "get_weather" in tokenizer._tokenizer.decode(prompt[:lease.num_tokens])


async def test_a_mark_inside_a_tool_result_leases_the_whole_result(http, router, tokenizer):
    tool = {"name": "get_weather", "description": "Weather of a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "18 C, sunny", "cache_control": FIVE_MINUTES}]},
            {"type": "text", "text": "Thanks. Shorts?"}]},
    ]
    unmarked = [dict(m) for m in messages]
    unmarked[2] = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"}]}

    response = await http.post("/v1/messages", json=anthropic_body(messages=messages,
                                                                   tools=[tool]))
    counted = await http.post("/v1/messages/count_tokens", json={
        "model": SERVED, "messages": unmarked, "tools": [tool]})

    assert response.status_code == 200, response.text
    [request] = router.requests
    prompt = list(request.prompt_token_ids)
    generation = (len(rendered_ids(tokenizer, HI, generation=True))
                  - len(rendered_ids(tokenizer, HI, generation=False)))
    through_result = counted.json()["input_tokens"] - generation
    assert tokenizer._tokenizer.decode(prompt[:through_result]).endswith(
        "18 C, sunny\n</tool_response><|im_end|>\n")
    assert request.leases == (breakpoint_lease("", prompt, through_result, 300.0),)


async def test_the_request_level_mark_leases_the_whole_conversation(http, router, tokenizer):
    response = await http.post("/v1/messages", json=anthropic_body(cache_control=ONE_HOUR))

    assert response.status_code == 200, response.text
    [request] = router.requests
    prompt = rendered_ids(tokenizer, HI, generation=True)
    conversation = rendered_ids(tokenizer, HI, generation=False)
    assert request.leases == (breakpoint_lease("", prompt, len(conversation), 3600.0),)
    left_out = tokenizer._tokenizer.decode(prompt[len(conversation):])
    assert left_out == "<|im_start|>assistant\n"  # only the generation prompt


async def test_a_session_step_writes_its_whole_prompt(http, router):
    """A session's lease covers the prompt: what was not read is written (Anthropic's split)."""
    response = await http.post("/v1/messages", json=anthropic_body(), headers={
        "X-Session-Id": "agent"})
    async with http.stream("POST", "/v1/messages", json=anthropic_body(stream=True),
                           headers={"X-Session-Id": "agent"}) as streamed:
        events = [json.loads(line.removeprefix("data: ")) for line in
                  (await streamed.aread()).decode().splitlines() if line.startswith("data: ")]
    chat_stream = await http.post("/v1/chat/completions", json=chat(
        session_id="agent", stream=True, stream_options={"include_usage": True}))

    num_prompt_tokens = len(router.requests[0].prompt_token_ids)
    expected = {"input_tokens": 0, "cache_creation_input_tokens": num_prompt_tokens - CACHED,
                "cache_read_input_tokens": CACHED, "output_tokens": 4}
    assert response.json()["usage"] == expected
    [delta] = [event for event in events if event["type"] == "message_delta"]
    assert delta["usage"] == expected
    [start] = [event for event in events if event["type"] == "message_start"]
    assert start["message"]["usage"]["cache_creation_input_tokens"] == 0  # not known yet
    chunks = [json.loads(line.removeprefix("data: ")) for line in chat_stream.text.splitlines()
              if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert (usage["cache_creation_input_tokens"], usage["cache_read_input_tokens"]) == (
        num_prompt_tokens - CACHED, CACHED)


def _marks(count: int) -> list[dict]:
    return [{"type": "text", "text": f"part {i}. ", "cache_control": FIVE_MINUTES}
            for i in range(count)]


BAD_MARKS = {
    "five on OpenAI": (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": _marks(5)}]},
        "messages[0].content[4].cache_control"),
    "five on Anthropic": (
        "/v1/messages", {"messages": [{"role": "user", "content": _marks(4)}],
                         "cache_control": FIVE_MINUTES}, "cache_control"),
    "a bad type": (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi",
                                               "cache_control": {"type": "persistent"}}]},
        "messages[0].cache_control.type"),
    "a bad ttl": (
        "/v1/messages", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral",
                                                            "ttl": "10m"}}]}]},
        "messages[0].content[0].cache_control.ttl"),
    "an unknown key": (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral",
                                                            "scope": "global"}}]}]},
        "messages[0].content[0].cache_control"),
}


@pytest.mark.parametrize("path, fields, param", BAD_MARKS.values(), ids=BAD_MARKS.keys())
async def test_bad_breakpoints_are_400s_naming_the_field(http, router, path, fields, param):
    response = await http.post(path, json={"model": SERVED, "max_tokens": 4, **fields})

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if path == "/v1/messages":
        assert error["message"].startswith(param)
    else:
        assert error["param"] == param
    assert router.requests == []


def test_a_breakpoint_outside_the_prompt_names_its_field(tokenizer):
    mark = Breakpoint("messages[0].cache_control", 300.0, ())  # renders to no token

    with pytest.raises(InvalidField) as info:
        breakpoint_leases([mark], None, tokenizer, [1, 2, 3], "")

    assert info.value.field == "messages[0].cache_control"
    assert "outside the prompt of 3 tokens" in str(info.value)


# ------------------------------------------------------------------ closing (HTTP)


async def test_delete_closes_the_callers_session(http, slot):
    scoped = scoped_session_id(KEY_A, "acme", "agent/9")
    slot.current = router = SessionRouter({scoped: SessionEnd(scoped, 4, 11)})

    closed = await http.delete("/v1/sessions/agent/9", params={"tenant": "acme"})
    again = await http.delete("/v1/sessions/agent/9", params={"cache_salt": "acme"})
    other_key = await http.delete("/v1/sessions/agent/9", params={"tenant": "acme"},
                                  headers={"Authorization": f"Bearer {KEY_B}"})
    anthropic_style = await http.delete("/v1/sessions/agent/9", headers={
        "anthropic-version": "2023-06-01"})

    assert closed.status_code == 200, closed.text
    assert closed.json() == {"id": "agent/9", "object": "session.deleted", "deleted": True,
                             "num_steps": 4, "released_blocks": 11}
    assert again.status_code == 404
    assert again.json()["error"]["code"] == "unknown_session"
    assert again.json()["error"]["param"] == "session_id"
    assert other_key.status_code == 404
    assert anthropic_style.status_code == 404
    assert anthropic_style.json()["type"] == "error"
    assert anthropic_style.json()["error"]["type"] == "not_found_error"
    assert router.closed == [scoped, scoped, scoped_session_id(KEY_B, "acme", "agent/9"),
                             scoped_session_id(KEY_A, "", "agent/9")]


async def test_delete_needs_a_key_and_a_router_that_closes(running, slot):
    slot.current = FakeRouter()  # no close_session: no session is ever live
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10) as http:
        unauthenticated = await http.delete("/v1/sessions/a")
        by_x_api_key = await http.delete("/v1/sessions/a", headers={"x-api-key": KEY_A})

    assert unauthenticated.status_code == 401
    assert by_x_api_key.status_code == 404


# ------------------------------------------------------------------ gRPC


@pytest_asyncio.fixture
async def grpc_channel(router, tokenizer):
    servicer = InferenceServicer(router, tokenizer, SERVED, MAX_MODEL_LEN,
                                 api_keys=frozenset({KEY_A}))
    admin = AdminServicer(None, tokenizer, {ADMIN_KEY}, "sessions", router=router)
    running = await start_gateway(servicer, "127.0.0.1", 0, admin=admin)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield channel
    await running.stop(None)


async def _final(channel, request: pb.GenerateRequest) -> pb.Final:
    stub = pb_grpc.InferenceStub(channel)
    responses = [r async for r in stub.Generate(request, metadata=(
        ("authorization", f"Bearer {KEY_A}"),), timeout=10)]
    return responses[-1].final


async def test_grpc_generate_scopes_the_session_and_reports_cache_writes(grpc_channel, router):
    final = await _final(grpc_channel, pb.GenerateRequest(
        text="Hello there, this prompt is long enough to hold more than sixteen tokens of text.",
        cache_salt="acme", session_id="g-1", session_ttl_s=90, expected_next_step_s=4))

    [request] = router.requests
    scoped = scoped_session_id(KEY_A, "acme", "g-1")
    num_prompt_tokens = len(request.prompt_token_ids)
    assert num_prompt_tokens > CACHED
    assert request.session_id == scoped
    assert request.leases == (session_lease(scoped, "acme", 90.0, num_prompt_tokens),)
    assert request.expected_next_step_s == 4.0
    assert (final.usage.cached_tokens, final.usage.cache_read_input_tokens,
            final.usage.cache_creation_input_tokens) == (CACHED, CACHED,
                                                         num_prompt_tokens - CACHED)


async def test_grpc_without_a_session_writes_nothing(grpc_channel, router):
    final = await _final(grpc_channel, pb.GenerateRequest(text="Hello world"))

    assert (router.requests[0].session_id, router.requests[0].leases) == ("", ())
    assert (final.usage.cache_read_input_tokens, final.usage.cache_creation_input_tokens) == (
        CACHED, 0)


BAD_GRPC = {
    "negative ttl": (pb.GenerateRequest(text="x", session_id="a", session_ttl_s=-1),
                     "session_ttl_s"),
    "NaN ttl": (pb.GenerateRequest(text="x", session_id="a", session_ttl_s=math.nan),
                "session_ttl_s"),
    "ttl over the max": (pb.GenerateRequest(text="x", session_id="a", session_ttl_s=4000),
                         "session_ttl_s"),
    "ttl without a session": (pb.GenerateRequest(text="x", session_ttl_s=10), "session_ttl_s"),
    "NaN next step": (pb.GenerateRequest(text="x", session_id="a",
                                         expected_next_step_s=math.nan), "expected_next_step_s"),
    "next step without a session": (pb.GenerateRequest(text="x", expected_next_step_s=3),
                                    "expected_next_step_s"),
    "id too long": (pb.GenerateRequest(text="x", session_id="z" * 129), "session_id"),
}


@pytest.mark.parametrize("request_, field", BAD_GRPC.values(), ids=BAD_GRPC.keys())
async def test_grpc_bad_session_fields_are_invalid_argument(grpc_channel, router, request_,
                                                           field):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _final(grpc_channel, request_)

    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field)
    assert router.requests == []


async def test_admin_close_session(grpc_channel, router):
    scoped = scoped_session_id(KEY_A, "acme", "g-1")
    router.live[scoped] = SessionEnd(scoped, 3, 7)
    stub = apb_grpc.AdminStub(grpc_channel)
    auth = (("authorization", f"Bearer {ADMIN_KEY}"),)

    closed = await stub.CloseSession(apb.CloseSessionRequest(
        session_id="g-1", tenant="acme", api_key=KEY_A), metadata=auth)
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await stub.CloseSession(apb.CloseSessionRequest(
            session_id="g-1", tenant="acme", api_key=KEY_A), metadata=auth)
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await stub.CloseSession(apb.CloseSessionRequest(), metadata=auth)
    with pytest.raises(grpc.aio.AioRpcError) as unauthenticated:
        await stub.CloseSession(apb.CloseSessionRequest(session_id="g-1"))

    assert (closed.session_id, closed.num_steps, closed.released_blocks) == ("g-1", 3, 7)
    assert again.value.code() == grpc.StatusCode.NOT_FOUND
    assert "g-1" in again.value.details()
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert router.closed == [scoped, scoped]


async def test_admin_close_session_without_a_closing_router_is_not_found(tokenizer):
    admin = AdminServicer(None, tokenizer, {ADMIN_KEY}, "sessions", router=FakeRouter())
    running = await start_gateway(InferenceServicer(FakeRouter(), tokenizer, SERVED, 100),
                                  "127.0.0.1", 0, admin=admin)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await apb_grpc.AdminStub(channel).CloseSession(
                    apb.CloseSessionRequest(session_id="a"),
                    metadata=(("authorization", f"Bearer {ADMIN_KEY}"),))
    finally:
        await running.stop(None)

    assert info.value.code() == grpc.StatusCode.NOT_FOUND
