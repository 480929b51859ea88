"""An assistant prefill on the OpenAI chat route: vLLM's ``continue_final_message`` (with
``add_generation_prompt`` false) leaves the last, assistant message open for the model to
continue; ``add_generation_prompt`` false alone ends the prompt without the assistant's turn
header. Prompts are compared with Hugging Face's own rendering of the tiny model's template.
(The Anthropic route's prefill, a last assistant message, is in ``test_anthropic_messages``.)"""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio

from engine.models import prepare_model
from gateway.openai_http import build_app, start_http
from gateway.tokenization import PromptTokenizer
from tests.unit.test_gateway_wire import FakeRouter

SERVED = "tiny"
ASKED = [{"role": "system", "content": "Answer in JSON."},
         {"role": "user", "content": "Where is Paris?"}]
PREFILL = ASKED + [{"role": "assistant", "content": '{"country": "'}]


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest_asyncio.fixture
async def http(router, tokenizer):
    app = build_app(router, tokenizer, SERVED, 4096)
    running = await start_http(app, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10) as http:
        yield http
    await running.stop(grace_s=1.0)


def hf_ids(tokenizer: PromptTokenizer, messages: list[dict], **flags) -> list[int]:
    hf = tokenizer._tokenizer
    return hf.encode(hf.apply_chat_template(messages, tokenize=False, **flags),
                     add_special_tokens=False)


async def chat(http, messages: list[dict], **fields) -> httpx.Response:
    return await http.post("/v1/chat/completions", json={
        "model": SERVED, "max_tokens": 4, "messages": messages, **fields})


async def test_continue_final_message_leaves_the_answer_open(http, router, tokenizer):
    response = await chat(http, PREFILL, continue_final_message=True,
                          add_generation_prompt=False)

    assert response.status_code == 200, response.text
    [request] = router.requests
    expected = hf_ids(tokenizer, PREFILL, continue_final_message=True)
    assert list(request.prompt_token_ids) == expected
    text = tokenizer._tokenizer.decode(expected)
    assert text.endswith('<|im_start|>assistant\n{"country": "')
    closed = hf_ids(tokenizer, PREFILL, add_generation_prompt=True)
    assert closed[:len(expected)] == expected  # the closed turn goes on: its end, a new header
    assert tokenizer._tokenizer.decode(closed[len(expected):]) == (
        "<|im_end|>\n<|im_start|>assistant\n")


async def test_without_the_generation_prompt_the_turns_stay_closed(http, router, tokenizer):
    response = await chat(http, ASKED, add_generation_prompt=False)

    assert response.status_code == 200, response.text
    [request] = router.requests
    assert list(request.prompt_token_ids) == hf_ids(tokenizer, ASKED,
                                                    add_generation_prompt=False)
    assert list(request.prompt_token_ids) != hf_ids(tokenizer, ASKED,
                                                    add_generation_prompt=True)


@pytest.mark.parametrize("messages, fields, param, words", [
    (PREFILL, {"continue_final_message": True}, "continue_final_message",
     "add_generation_prompt are both true"),
    (ASKED, {"continue_final_message": True, "add_generation_prompt": False}, "messages",
     "the last message to be the assistant's"),
    (ASKED + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     {"continue_final_message": True, "add_generation_prompt": False}, "messages",
     "carries tool calls"),
    (PREFILL, {"continue_final_message": True, "add_generation_prompt": False,
               "tools": [{"type": "function", "function": {"name": "f"}}],
               "tool_choice": "required"}, "messages", "forced tool call"),
])
async def test_a_prefill_that_cannot_be_continued_is_a_400(http, router, messages, fields,
                                                           param, words):
    response = await chat(http, messages, **fields)

    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param)
    assert words in error["message"]
    assert router.requests == []
