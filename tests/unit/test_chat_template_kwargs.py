"""``chat_template_kwargs`` (vLLM's extension): more variables for the model's chat template,
as reasoning models read ``enable_thinking``. Tested with the tiny model's tokenizer under a
template that, like Qwen3's, writes an empty thought after the generation prompt when
``enable_thinking`` is false."""

from __future__ import annotations

import shutil

import httpx
import pytest
import pytest_asyncio

from engine.models import prepare_model
from gateway.openai_http import build_app, start_http
from gateway.tokenization import PromptTokenizer
from gateway.validation import MAX_TEMPLATE_KWARGS
from tests.unit.test_gateway_wire import FakeRouter

SERVED = "tiny"
NO_THOUGHT = "<think>\n\n</think>\n\n"
THINKING_SWITCH = ("{%- if add_generation_prompt and enable_thinking is defined and "
                   "enable_thinking is false %}{{ '" + NO_THOUGHT.replace("\n", "\\n") +
                   "' }}{%- endif %}")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory) -> PromptTokenizer:
    """The tiny model's tokenizer with the thinking switch appended to its chat template."""
    source = prepare_model("tiny").path
    folder = tmp_path_factory.mktemp("thinking-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, folder / name)
    template = (source / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(template + THINKING_SWITCH)
    return PromptTokenizer(folder)


def test_the_template_gets_the_variables(thinking_tokenizer):
    plain = thinking_tokenizer.encode_conversation(HI)
    no_thought = thinking_tokenizer.encode_conversation(HI,
                                                        template_kwargs={"enable_thinking": False})
    thinking = thinking_tokenizer.encode_conversation(HI, template_kwargs={"enable_thinking": True})

    assert thinking == plain
    assert no_thought[:len(plain)] == plain
    assert no_thought[len(plain):] == thinking_tokenizer.encode_text(NO_THOUGHT)


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest_asyncio.fixture
async def http(router, thinking_tokenizer):
    app = build_app(router, thinking_tokenizer, SERVED, 200)
    running = await start_http(app, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10) as http:
        yield http
    await running.stop(grace_s=1.0)


async def test_a_chat_request_is_rendered_with_its_template_kwargs(http, router,
                                                                   thinking_tokenizer):
    body = {"model": SERVED, "messages": HI, "max_tokens": 4}
    for kwargs in ({"enable_thinking": False}, None, {"enable_thinking": False, "unused": [1]}):
        fields = {} if kwargs is None else {"chat_template_kwargs": kwargs}
        assert (await http.post("/v1/chat/completions", json=body | fields)).status_code == 200

    without_thought, plain, with_unused = [r.prompt_token_ids for r in router.requests]
    assert list(plain) == thinking_tokenizer.encode_conversation(HI)
    assert list(without_thought) == thinking_tokenizer.encode_conversation(
        HI, template_kwargs={"enable_thinking": False}) != list(plain)
    assert with_unused == without_thought  # a variable the template does not read changes nothing


@pytest.mark.parametrize("kwargs, fragment", [
    ({"tools": []}, "chat_template_kwargs may not set tools"),
    ({"add_generation_prompt": False, "messages": []},
     "may not set add_generation_prompt, messages"),
    ([1, 2], "chat_template_kwargs: Input should be a valid dictionary"),
    ({f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)},
     f"at most {MAX_TEMPLATE_KWARGS} are accepted"),
])  # fmt: skip
async def test_bad_template_kwargs_are_a_400_naming_the_field(http, router, kwargs, fragment):
    response = await http.post("/v1/chat/completions", json={
        "model": SERVED, "messages": HI, "chat_template_kwargs": kwargs})

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs"
    assert fragment in error["message"]
    assert router.requests == []


async def test_the_completions_endpoint_has_no_template(http, router):
    response = await http.post("/v1/completions", json={
        "model": SERVED, "prompt": "x", "chat_template_kwargs": {"enable_thinking": False}})

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"
    assert router.requests == []
