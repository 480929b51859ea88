"""Log-probabilities through the whole cluster (OpenAI HTTP and gRPC fronts → conductor → prefill
and decode actors), checked against a plain vLLM engine run directly on the same prompt: the top
entries are the engine's own, and under greedy decoding the chosen token is the most likely one.
Tiny random model; one short prompt (prefilled on the decode instance) and one long prompt
(prefilled on a prefill instance, its KV handed over through the store)."""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio

from engine.builder import build_engine_args
from engine.config import EngineConfig
from gateway import client
from gateway.tokenization import PromptTokenizer
from tests.integration.engines import random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MAX_TOKENS = 8
TOP = 5
SHORT, LONG = 60, 300  # under and over the conductor's short_prefill_tokens (256)
LOGPROB_TOLERANCE = 1e-4
"""The two engines run the same model on the same prompt; the decode instance attends over KV
another engine computed, so the last digits of a logit may differ."""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    # the older rule, named: a short prompt co-located, a long one disaggregated (both paths)
    async with running_server({"engine.model": "tiny", "conductor.tuning.short_prefill_tokens": 256,
                               "kvstore.host_capacity_bytes": 256 << 20}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference_engine(tiny_model):
    """A plain vLLM engine, driven by hand: vLLM's own SamplingParams, not Baton's runner."""
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(
        build_engine_args(EngineConfig(model=tiny_model.name), tiny_model, "plain", "ref", None))


def reference(engine, prompt: list[int]) -> list[tuple[int, list[tuple[str, float]], float]]:
    """Per generated position of a greedy run with ``logprobs=TOP``: (chosen id, the TOP most
    likely as (token, logprob) best first, the chosen token's logprob)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    request_id = f"ref-{len(prompt)}-{prompt[0]}"
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output.outputs[0]
    positions = []
    for token_id, by_id in zip(final.token_ids, final.logprobs):
        top = sorted((lp for lp in by_id.values() if lp.rank <= TOP), key=lambda lp: lp.rank)
        positions.append((token_id, [(lp.decoded_token, lp.logprob) for lp in top],
                          by_id[token_id].logprob))
    return positions


def _openai(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                              api_key="unused", max_retries=0, timeout=60)


def assert_same(got: list[tuple[str, float]], expected: list[tuple[str, float]]) -> None:
    assert [token for token, _ in got] == [token for token, _ in expected]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected],
                                                  abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("num_prompt_tokens", [SHORT, LONG], ids=["colocated", "disaggregated"])
async def test_chat_top_logprobs_are_the_engines_own_and_greedy_picks_the_top(
        server, reference_engine, tiny_model, num_prompt_tokens):
    content = " ".join(["sky"] * (num_prompt_tokens - 10))
    prompt = PromptTokenizer(tiny_model.path).encode_chat([("user", content)])
    expected = reference(reference_engine, prompt)

    chat = await _openai(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, logprobs=True, top_logprobs=TOP, extra_body={"ignore_eos": True})

    placement = chat.model_extra["baton"]["placement"]
    assert (placement["prefill"] == placement["decode"]) == (num_prompt_tokens == SHORT)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == MAX_TOKENS == chat.usage.completion_tokens
    for entry, (_, top, chosen_logprob) in zip(entries, expected):
        assert_same([(t.token, t.logprob) for t in entry.top_logprobs], top)
        assert entry.logprob == pytest.approx(chosen_logprob, abs=LOGPROB_TOLERANCE)
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy: the top one
        assert entry.token == entry.top_logprobs[0].token
        assert entry.bytes == list(entry.token.encode())


@pytest.mark.parametrize("num_prompt_tokens", [SHORT, LONG], ids=["colocated", "disaggregated"])
async def test_streamed_completion_logprobs_match_the_plain_engine(
        server, reference_engine, num_prompt_tokens):
    prompt = random_prompt(num_prompt_tokens, seed=70 + num_prompt_tokens)
    expected = reference(reference_engine, prompt)

    stream = await _openai(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP,
        stream=True, extra_body={"ignore_eos": True})
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    async for chunk in stream:
        logprobs = chunk.choices[0].logprobs
        if logprobs is not None:
            tokens += logprobs.tokens
            token_logprobs += logprobs.token_logprobs
            top_logprobs += logprobs.top_logprobs
            offsets += logprobs.text_offset

    assert len(tokens) == MAX_TOKENS
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(MAX_TOKENS)]
    for token, logprob, top, (_, expected_top, expected_logprob) in zip(
            tokens, token_logprobs, top_logprobs, expected):
        assert logprob == pytest.approx(expected_logprob, abs=LOGPROB_TOLERANCE)
        assert logprob == max(top.values()) and top[token] == logprob
        assert len(top) <= TOP + 1
        expected_map = dict(expected_top)  # two ids may decode to one string: compare as maps
        assert top == pytest.approx(expected_map | {token: expected_logprob},
                                    abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("num_prompt_tokens", [SHORT, LONG], ids=["colocated", "disaggregated"])
async def test_grpc_top_logprobs_are_the_engines_own_and_greedy_picks_the_top(
        server, reference_engine, num_prompt_tokens):
    prompt = random_prompt(num_prompt_tokens, seed=110 + num_prompt_tokens)
    expected = reference(reference_engine, prompt)

    result = await client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS,
                                   temperature=0.0, logprobs=TOP)

    placement = result["placement"]
    assert (placement["prefill"] == placement["decode"]) == (num_prompt_tokens == SHORT)
    positions = result["logprobs"]
    assert [position["chosen"]["token_id"] for position in positions] == result["token_ids"]
    assert result["token_ids"] == [token_id for token_id, _, _ in expected]  # no EOS met
    for position, (_, top, chosen_logprob) in zip(positions, expected):
        assert_same([(entry["token"], entry["logprob"]) for entry in position["top"]], top)
        assert [entry["rank"] for entry in position["top"]] == list(range(1, TOP + 1))
        assert position["chosen"]["logprob"] == pytest.approx(chosen_logprob,
                                                              abs=LOGPROB_TOLERANCE)
        assert position["chosen"]["logprob"] == max(entry["logprob"] for entry in position["top"])
        assert position["chosen"] == position["top"][0]  # greedy: the top one


async def test_sampled_requests_with_logprobs_run_together(server):
    """Eight concurrent sampled requests, half of them with logprobs: each gets its own
    positions, one per generated token, and the others none."""
    oai = _openai(server)

    async def one(i: int):
        return await oai.completions.create(
            model="tiny", prompt=random_prompt(40, seed=90 + i), max_tokens=MAX_TOKENS,
            temperature=1.0, seed=i, logprobs=2 if i % 2 else None,
            extra_body={"ignore_eos": True})

    answers = await asyncio.gather(*(one(i) for i in range(8)))

    for i, answer in enumerate(answers):
        logprobs = answer.choices[0].logprobs
        if i % 2:
            assert len(logprobs.tokens) == answer.usage.completion_tokens == MAX_TOKENS
            assert all(len(top) in (2, 3) for top in logprobs.top_logprobs)
            assert all(top[token] == lp for token, lp, top in zip(
                logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))
        else:
            assert logprobs is None


def reference_prompt(engine, prompt: list[int], top: int) -> list[tuple[int, dict[int, float]]]:
    """Per prompt position from the second: (the prompt token, {token id: logprob} of it and
    the ``top`` most likely), as a plain engine computes them (``prompt_logprobs``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.add_request(f"ref-prompt-{len(prompt)}-{prompt[0]}", TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    return [(token_id, {i: lp.logprob for i, lp in by_id.items()})
            for token_id, by_id in zip(prompt[1:], final.prompt_logprobs[1:])]


@pytest.mark.parametrize("num_prompt_tokens", [SHORT, LONG], ids=["short", "long"])
async def test_echo_answers_the_prompts_logprobs_as_the_engine_computes_them(
        server, reference_engine, tiny_model, num_prompt_tokens):
    """``echo`` with ``logprobs`` on /v1/completions (what lm-eval's loglikelihood tasks send):
    the answer starts with the prompt, its first token without a log-probability and every
    other one with the engine's own; computed where it is decoded (a long prompt too, which
    is otherwise prefilled apart), and again in full when the prompt is cached (asked twice);
    with ``max_tokens`` 0, the prompt alone."""
    oai = _openai(server)
    tokenizer = PromptTokenizer(tiny_model.path)
    prompt = random_prompt(num_prompt_tokens, seed=700 + num_prompt_tokens)
    expected = reference_prompt(reference_engine, prompt, 1)
    for attempt in range(2):  # the second time every block of the prompt is cached somewhere
        reply = await oai.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                             temperature=0.0, logprobs=1, echo=True)
        choice = reply.choices[0]
        assert choice.text.startswith(tokenizer.decode(prompt))
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == num_prompt_tokens + reply.usage.completion_tokens
        assert (logprobs.token_logprobs[0], logprobs.top_logprobs[0]) == (None, None)
        got = logprobs.token_logprobs[1:num_prompt_tokens]
        assert got == pytest.approx([by_id[token_id] for token_id, by_id in expected],
                                    abs=LOGPROB_TOLERANCE)
        for top, (token_id, by_id) in zip(logprobs.top_logprobs[1:num_prompt_tokens], expected):
            assert sorted(top.values()) == pytest.approx(sorted(by_id.values()),
                                                         abs=LOGPROB_TOLERANCE)
        placement = reply.model_extra["baton"]["placement"]
        assert placement["prefill"] == placement["decode"], placement["reason"]
        assert reply.usage.prompt_tokens_details.cached_tokens == 0, attempt  # nothing reused
    scored = await oai.completions.create(model="tiny", prompt=prompt, max_tokens=0,
                                          logprobs=1, echo=True)  # the prompt alone
    assert scored.choices[0].text == tokenizer.decode(prompt)
    assert (scored.choices[0].finish_reason, scored.usage.completion_tokens) == ("length", 0)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        [by_id[token_id] for token_id, by_id in expected], abs=LOGPROB_TOLERANCE)
