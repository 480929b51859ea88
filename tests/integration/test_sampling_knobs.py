"""The sampling knobs through the whole cluster (gRPC and OpenAI HTTP fronts -> conductor ->
prefill and decode actors): a request with top_k, min_p, the penalties, min_tokens or logit_bias
gets exactly what a plain vLLM engine run directly with the same ``SamplingParams`` produces,
and not what it produces without them (so each knob provably reached the engine that sampled).
Tiny random model; one short prompt (prefilled on the decode instance) and one long prompt
(prefilled on a prefill instance, its KV handed over through the store)."""

from __future__ import annotations

import openai
import pytest

from gateway import client
from tests.integration.engines import random_prompt
from tests.integration.test_logprobs import reference_engine, server  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MAX_TOKENS = 12
SHORT, LONG = 60, 300  # under and over the conductor's short_prefill_tokens (256): the server
# (test_logprobs') places the short prompts co-located, the long ones disaggregated
FORCED = 4242
"""A token id a +100 bias makes the greedy choice at every position."""

KNOBS = {
    "penalties": {"presence_penalty": -2.0, "frequency_penalty": -2.0},
    "repetition_penalty": {"repetition_penalty": 0.3},
    "logit_bias": {"logit_bias": {FORCED: 100.0}},
    "top_k 1, sampled": {"top_k": 1, "temperature": 1.0, "seed": 5},
    "min_p 1, sampled": {"min_p": 1.0, "temperature": 1.0, "seed": 5},
}
"""Knobs (and the sampling they go with; greedy unless named) whose answers must match the plain
engine's; ``top_k`` 1 and ``min_p`` 1 must turn a sampled request into the greedy answer. The
penalties encourage repeats (negative, and a repetition penalty under 1): the tiny random
model's greedy answers to these prompts repeat nothing, so a penalty against repeats would
change nothing there."""


def reference(engine, prompt: list[int], **params) -> list[int]:
    """The token ids a plain engine generates for ``prompt`` with ``SamplingParams(**params)``
    (greedy unless a temperature is given)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0} | params
    request_id = f"ref-{len(prompt)}-{prompt[0]}-{sorted(params.items())!r}"
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), SamplingParams(**params))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output.outputs[0]
    return list(final.token_ids)


def _split(knobs: dict) -> tuple[dict, dict]:
    """(the knobs proper, the plain sampling fields among them)."""
    plain = {name: knobs[name] for name in ("temperature", "seed") if name in knobs}
    return {name: value for name, value in knobs.items() if name not in plain}, plain


@pytest.mark.parametrize("num_prompt_tokens", [SHORT, LONG], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("case", KNOBS)
async def test_grpc_answers_as_the_plain_engine_does_with_the_same_knobs(
        server, reference_engine, num_prompt_tokens, case):
    # a prompt of its own per case: a repeated long prompt is held by the decode instance
    prompt = random_prompt(num_prompt_tokens, seed=300 + num_prompt_tokens + list(KNOBS).index(case))
    knobs, plain = _split(KNOBS[case])
    expected = reference(reference_engine, prompt, **KNOBS[case])
    greedy = reference(reference_engine, prompt)
    if "sampled" in case:
        assert expected == greedy  # the knob's whole effect
        assert reference(reference_engine, prompt, **plain) != greedy  # without it: sampled
    else:
        assert expected != greedy  # the knob changes this prompt's answer

    result = await client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS,
                                   temperature=plain.get("temperature", 0.0),
                                   seed=plain.get("seed"), knobs=knobs)

    placement = result["placement"]
    assert (placement["prefill"] == placement["decode"]) == (num_prompt_tokens == SHORT)
    assert result["token_ids"] == expected
    if case == "logit_bias":
        assert expected == [FORCED] * MAX_TOKENS


@pytest.mark.parametrize("num_prompt_tokens", [SHORT, LONG], ids=["colocated", "disaggregated"])
async def test_min_tokens_holds_back_the_end_of_sequence(server, tiny_model, num_prompt_tokens):
    """With the end-of-sequence token forced by its bias, the answer is that one token; with
    min_tokens 5 it is 5 other tokens first (the first of them sampled on the decode instance:
    a prefill instance's throw-away token does not end it)."""
    from gateway.engine_replies import eos_token_ids

    eos = eos_token_ids(tiny_model.path)[0]
    prompt = random_prompt(num_prompt_tokens, seed=400 + num_prompt_tokens)
    bias = {"logit_bias": {eos: 100.0}}

    at_once = await client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS,
                                    knobs=bias)
    held = await client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS,
                                 knobs=bias | {"min_tokens": 5})

    assert at_once["finish_reason"] == held["finish_reason"] == "stop"
    assert at_once["usage"]["completion_tokens"] == 1
    assert held["usage"]["completion_tokens"] == 6
    assert eos not in held["token_ids"][:5]


async def test_openai_chat_sends_the_knobs_to_the_engine(server, tiny_model):
    """The HTTP front's spelling (token ids as strings in logit_bias, vLLM's extensions in the
    body) reaches the engine: the chat answer is the forced token, repeated."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.path)
    oai = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                             api_key="unused", max_retries=0, timeout=60)
    chat = await oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "sky " * 20}], max_tokens=MAX_TOKENS,
        temperature=0, logit_bias={str(FORCED): 100},
        extra_body={"top_k": 3, "min_p": 0.01, "repetition_penalty": 1.0, "min_tokens": 2})

    assert chat.usage.completion_tokens == MAX_TOKENS
    assert chat.choices[0].message.content == tokenizer.decode([FORCED] * MAX_TOKENS,
                                                                    skip_special_tokens=True)


@pytest.mark.parametrize("num_prompt_tokens", [SHORT, LONG], ids=["colocated", "disaggregated"])
async def test_n_choices_are_the_answers_of_single_requests_seeded_one_apart(
        server, num_prompt_tokens):
    """``n`` 3 with seed 11 answers what three single requests with seeds 11, 12 and 13 do
    (vLLM's rule for n > 1), and greedy ``n`` 2 answers the greedy text twice."""
    oai = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                             api_key="unused", max_retries=0, timeout=60)
    prompt = random_prompt(num_prompt_tokens, seed=500 + num_prompt_tokens)
    sampled = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 1.0,
               "extra_body": {"ignore_eos": True}}

    several = await oai.completions.create(n=3, seed=11, **sampled)
    singles = [await oai.completions.create(seed=11 + i, **sampled) for i in range(3)]
    greedy = await oai.completions.create(**sampled | {"temperature": 0.0}, n=2)
    single_greedy = await oai.completions.create(**sampled | {"temperature": 0.0})

    assert [choice.index for choice in several.choices] == [0, 1, 2]
    assert [choice.text for choice in several.choices] == [s.choices[0].text for s in singles]
    assert len({choice.text for choice in several.choices}) == 3  # three draws, not one
    assert several.usage.completion_tokens == 3 * MAX_TOKENS
    assert several.usage.prompt_tokens == num_prompt_tokens
    assert [choice.text for choice in greedy.choices] == [single_greedy.choices[0].text] * 2


@pytest.mark.parametrize("num_prompt_tokens", [SHORT, LONG], ids=["colocated", "disaggregated"])
async def test_grpc_n_choices_are_the_answers_of_single_requests_seeded_one_apart(
        server, num_prompt_tokens):
    """``sampling.n`` 3 with seed 21 over gRPC: each choice's deltas (by their ``index``) are
    what a single request seeded 21 + index answers, and each choice ends with its own Final."""
    import grpc

    from protos.baton.v1 import inference_pb2 as pb
    from protos.baton.v1 import inference_pb2_grpc as pb_grpc

    prompt = random_prompt(num_prompt_tokens, seed=600 + num_prompt_tokens)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), request_id="n3")
    request.sampling.max_tokens = MAX_TOKENS
    request.sampling.temperature = 1.0
    request.sampling.seed = 21
    request.sampling.n = 3
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals = {}
    async with grpc.aio.insecure_channel(server.target) as channel:
        async for response in pb_grpc.InferenceStub(channel).Generate(request, timeout=120):
            if response.HasField("final"):
                finals[response.final.index] = response.final
            else:
                tokens[response.delta.index].extend(response.delta.token_ids)
    singles = [await client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS,
                                     temperature=1.0, seed=21 + index) for index in range(3)]

    assert [tokens[index] for index in range(3)] == [single["token_ids"] for single in singles]
    assert len({tuple(answer) for answer in tokens.values()}) == 3  # three draws, not one
    assert sorted(finals) == [0, 1, 2]
    assert [finals[index].request_id for index in range(3)] == ["n3", "n3-n1", "n3-n2"]
    assert [finals[index].usage.completion_tokens for index in range(3)] == [
        len(tokens[index]) for index in range(3)]
    assert {finals[index].usage.prompt_tokens for index in range(3)} == {num_prompt_tokens}
