"""The prefill gate on a real engine (``engine.max_prefills_in_flight``): with a gate of one, a
burst of prompts reaches vLLM one at a time, each added only once no other prompt is still
being computed; with no gate vLLM gets them all at once and packs them. The answers are the
same either way."""

from __future__ import annotations

import asyncio

import pytest

from engine.builder import build_engine_args
from engine.config import EngineConfig
from engine.runner import EngineRunner
from protos.wire import EngineRequest, SamplingOptions
from tests.integration.engines import random_prompt

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


def _watch_adds(runner: EngineRunner) -> list[int]:
    """Before each add: how many requests in vLLM's scheduler are still in their prompt."""
    in_prompt: list[int] = []
    add = runner.engine.add_request

    def watched(*args, **kwargs):
        scheduler = runner._scheduler()
        in_prompt.append(sum(1 for r in (*scheduler.waiting, *scheduler.running)
                             if r.num_computed_tokens < r.num_prompt_tokens))
        return add(*args, **kwargs)

    runner.engine.add_request = watched
    return in_prompt


async def _answer(runner: EngineRunner, request_id: str, seed: int, max_tokens: int) -> list[int]:
    request = EngineRequest(request_id, tuple(random_prompt(300, seed=seed)),
                            SamplingOptions(max_tokens=max_tokens, temperature=0.0,
                                            ignore_eos=True))
    out: list[int] = []
    async for output in runner.generate(request):
        out.extend(output.outputs[0].token_ids)
    return out


async def _burst(runner: EngineRunner, tag: str) -> list[list[int]]:
    """Six prompts at once while a long answer keeps the engine stepping (so they arrive
    during a step, as a burst does on a busy engine)."""
    stream = asyncio.create_task(_answer(runner, f"{tag}-stream", 99, 400))
    await asyncio.sleep(0.5)
    answers = await asyncio.gather(*(_answer(runner, f"{tag}-{i}", i, 4) for i in range(6)))
    stream.cancel()
    await asyncio.gather(stream, return_exceptions=True)
    return answers


async def test_a_burst_goes_into_the_engine_one_prompt_at_a_time_with_the_same_answers(tiny_model):
    config = EngineConfig(model="tiny", max_prefills_in_flight=1)
    runner = EngineRunner(build_engine_args(config, tiny_model, "plain", "gate", None),
                          max_prefills=config.prefill_gate)
    try:
        in_prompt = _watch_adds(runner)
        gated = await _burst(runner, "gated")
        assert in_prompt == [0] * 7  # each went in when no other prompt was being computed
        assert runner._held == [] and runner._prefilling == set()
        runner.max_prefills = 0  # the same engine, no gate: vLLM gets the burst at once
        in_prompt.clear()
        packed = await _burst(runner, "packed")
        assert max(in_prompt) >= 2
        # the same answers either way (vLLM's prefix cache now holds the prompts), each its own
        assert packed == gated
        assert len({tuple(answer) for answer in gated}) > 1
    finally:
        runner.shutdown()
