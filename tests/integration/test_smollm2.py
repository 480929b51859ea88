"""SmolLM2-135M-Instruct through the disaggregated path: real text, identical to a plain engine."""

from __future__ import annotations

import pytest
import pytest_asyncio

from gateway import client
from gateway.tokenization import PromptTokenizer
from tests.integration.engines import plain_generate, plain_runner, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

LONG_CONTEXT = (
    "Rayleigh scattering is the elastic scattering of light by particles much smaller than its "
    "wavelength. The intensity of the scattered light varies inversely with the fourth power of "
    "the wavelength, so blue light is scattered far more strongly than red light. "
) * 12


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(smollm2_model):
    async with running_server({"engine.model": "smollm2", "kvstore.host_capacity_bytes": 512 << 20,
                               "conductor.tuning.short_prefill_tokens": 0}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(smollm2_model):
    runner = plain_runner(smollm2_model)
    yield runner
    runner.shutdown()


async def test_chat_answer_is_sensible_and_identical_to_plain_engine(server, reference, smollm2_model):
    tokenizer = PromptTokenizer(smollm2_model.path)
    prompt_ids = tokenizer.encode_chat([("user", "Why is the sky blue?")])
    expected = await plain_generate(reference, prompt_ids, 40, "smol-ref-chat")

    result = await client.generate(server.target, text="Why is the sky blue?", chat=True, max_tokens=40)

    assert result["token_ids"] == expected
    assert result["usage"]["prompt_tokens"] == len(prompt_ids)
    text = result["text"].lower()
    assert "scatter" in text or "wavelength" in text or "light" in text, result["text"]


async def test_multi_block_prompt_loads_kv_and_matches_plain_engine(server, reference, smollm2_model):
    tokenizer = PromptTokenizer(smollm2_model.path)
    question = LONG_CONTEXT + "\nIn one sentence, why is the sky blue?"
    prompt_ids = tokenizer.encode_chat([("user", question)])
    assert len(prompt_ids) > 3 * 128
    expected = await plain_generate(reference, prompt_ids, 32, "smol-ref-long")

    result = await client.generate(server.target, text=question, chat=True, max_tokens=32)

    assert result["token_ids"] == expected
    assert result["usage"]["loaded_tokens"] == len(prompt_ids) - 1
