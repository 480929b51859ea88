"""vLLM's ``/tokenize`` and ``/detokenize`` on the HTTP front, over real uvicorn with the tiny
model's tokenizer: a conversation counts exactly the tokens the chat route sends the engines,
text with and without special tokens, an over-long prompt counted, the round trip back to text,
and the 400s (404, 401) naming the field."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio

from gateway.openai_http import build_app, start_http
from tests.unit.test_assistant_prefill import router, tokenizer  # noqa: F401  (fixtures)

SERVED = "tiny"
MAX_MODEL_LEN = 512
KEY = "sk-tok"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]


@pytest_asyncio.fixture
async def http(router, tokenizer):  # noqa: F811
    app = build_app(router, tokenizer, SERVED, MAX_MODEL_LEN, frozenset({KEY}))
    running = await start_http(app, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10,
                                 headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield http
    await running.stop(grace_s=1.0)


async def test_a_conversation_counts_what_the_chat_route_sends(http, router):  # noqa: F811
    counted = (await http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})).json()
    answered = await http.post("/v1/chat/completions", json={
        "model": SERVED, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1})
    assert answered.status_code == 200, answered.text

    [request] = router.requests
    assert counted["tokens"] == list(request.prompt_token_ids)
    assert (counted["count"], counted["max_model_len"], counted["token_strs"]) == (
        len(request.prompt_token_ids), MAX_MODEL_LEN, None)


async def test_a_prefill_and_no_generation_prompt_render_as_the_template_does(
        http, tokenizer):  # noqa: F811
    hf = tokenizer._tokenizer
    prefill = MESSAGES + [{"role": "assistant", "content": "It is"}]
    open_answer = (await http.post("/tokenize", json={
        "messages": prefill, "continue_final_message": True,
        "add_generation_prompt": False})).json()
    closed = (await http.post("/tokenize", json={
        "messages": MESSAGES, "add_generation_prompt": False})).json()
    both = await http.post("/tokenize", json={"messages": prefill,
                                              "continue_final_message": True})

    assert open_answer["tokens"] == hf.encode(hf.apply_chat_template(
        prefill, continue_final_message=True, tokenize=False), add_special_tokens=False)
    assert closed["tokens"] == hf.encode(hf.apply_chat_template(
        MESSAGES, add_generation_prompt=False, tokenize=False), add_special_tokens=False)
    assert (both.status_code, both.json()["error"]["param"]) == (400, "continue_final_message")


async def test_text_with_and_without_special_tokens_and_its_strings(
        http, tokenizer):  # noqa: F811
    hf = tokenizer._tokenizer
    text = "Hello world " * 300  # longer than the context window: counted, not refused
    default = (await http.post("/tokenize", json={"prompt": text})).json()
    bare = (await http.post("/tokenize", json={"prompt": "Hello world",
                                               "add_special_tokens": False,
                                               "return_token_strs": True})).json()

    assert default["tokens"] == hf.encode(text)
    assert default["count"] == len(default["tokens"]) > MAX_MODEL_LEN
    assert bare["tokens"] == hf.encode("Hello world", add_special_tokens=False)
    assert bare["token_strs"] == hf.convert_ids_to_tokens(bare["tokens"])


async def test_detokenize_round_trips(http):
    tokens = (await http.post("/tokenize", json={"prompt": "Hello world",
                                                 "add_special_tokens": False})).json()["tokens"]

    response = await http.post("/detokenize", json={"model": SERVED, "tokens": tokens})

    assert response.json() == {"prompt": "Hello world"}


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "prompt", "exactly one"),
    ("/tokenize", {}, 400, "prompt", "exactly one"),
    ("/tokenize", {"prompt": "hi", "tools": TOOLS}, 400, "tools", "applies to messages"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": False}, 400,
     "add_generation_prompt", "applies to messages"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400,
     "add_special_tokens", "chat template holds"),
    ("/tokenize", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
    ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model", "gpt-9"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "outside the vocabulary"),
])
async def test_bad_bodies_are_refused_naming_the_field(http, path, body, status, param, words):
    response = await http.post(path, json=body)

    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (status, param)
    assert words in error["message"]


async def test_the_routes_need_the_key(http, router):  # noqa: F811
    async with httpx.AsyncClient(base_url=http.base_url) as anonymous:
        response = await anonymous.post("/tokenize", json={"prompt": "hi"})
    assert response.status_code == 401
