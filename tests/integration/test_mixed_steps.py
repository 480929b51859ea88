"""Mixed steps on a real engine (``engine.step_shapes``): while one request decodes, a long prompt
computed in chunks shares its steps; the runner reports each such step with the chunk it
computed, numbered in the count decode-only steps share, and the decoding request's span
covers them."""

from __future__ import annotations

import asyncio

import pytest

from engine.builder import build_engine_args
from engine.config import EngineConfig
from engine.runner import EngineRunner
from protos.wire import EngineRequest, PromptChunk, SamplingOptions
from tests.integration.engines import random_prompt

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

STEP_TOKENS = 128
PROMPT_TOKENS = 600


async def _answer(runner: EngineRunner, request_id: str, prompt: list[int], max_tokens: int) -> int:
    request = EngineRequest(request_id, tuple(prompt),
                            SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    count = 0
    async for output in runner.generate(request):
        count += len(output.outputs[0].token_ids)
    return count


async def test_a_prompt_computed_beside_a_decoding_request_is_reported_chunk_by_chunk(tiny_model):
    config = EngineConfig(model="tiny", max_num_batched_tokens=STEP_TOKENS, max_prefills_in_flight=0)
    runner = EngineRunner(build_engine_args(config, tiny_model, "plain", "mixed", None))
    try:
        stream = asyncio.create_task(_answer(runner, "stream", random_prompt(40, seed=1), 120))
        while not runner._spans:  # the stream is decoding (a timed decode-only step)
            await asyncio.sleep(0.01)
        assert await _answer(runner, "long", random_prompt(PROMPT_TOKENS, seed=2), 2) == 2
        assert await stream == 120
        mixed = runner.take_mixed_steps()
        decode_only = runner.take_decode_steps()
        spans = runner.take_decode_spans()
    finally:
        runner.shutdown()
    # the stream decoded one token in each; the long prompt filled the rest of the step budget
    assert [m.num_seqs for m in mixed] == [1] * len(mixed)
    chunks = [m.chunks for m in mixed]
    assert all(len(c) == 1 for c in chunks)
    expected, done = [], 0
    while done < PROMPT_TOKENS:
        take = min(STEP_TOKENS - 1, PROMPT_TOKENS - done)
        expected.append((PromptChunk(done_tokens=done, num_tokens=take, cached_tokens=0),))
        done += take
    assert chunks == expected
    # the stream's context grew by one token a step while it decoded beside the chunks
    contexts = [m.context_tokens for m in mixed]
    assert contexts == list(range(contexts[0], contexts[0] + len(mixed)))
    # one count for both kinds, and the stream's span runs over both
    seqs = sorted([m.seq for m in mixed] + [d.seq for d in decode_only])
    assert seqs == list(range(len(seqs)))
    assert [(s.first_seq, s.last_seq) for s in spans][-1] == (0, len(seqs) - 1)
