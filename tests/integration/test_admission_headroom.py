"""A decode that joins a decode engine while it computes a prompt in chunks (a hand-off: its
prompt's KV was loaded, a few tokens are left to compute) is scheduled at the next step, not
after the prompt's last chunk (``engine.admission_headroom_tokens``). A real tiny engine."""

from __future__ import annotations

import asyncio

import pytest

from engine.builder import build_engine_args
from engine.config import EngineConfig
from engine.runner import EngineRunner
from protos.wire import EngineRequest, SamplingOptions
from tests.integration.engines import random_prompt

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

STEP_TOKENS = 128
HEADROOM = 32
LONG_PROMPT = 1000  # 8 chunks of 128


async def _first_token_order(runner: EngineRunner) -> list[str]:
    """Start a long gated prompt; once it is computing in chunks, add a short decode that skips
    the gate (as a hand-off does); the order in which the two got their first token."""
    order: list[str] = []

    async def answer(request_id: str, prompt: list[int], computes_prompt: bool) -> None:
        request = EngineRequest(request_id, tuple(prompt),
                                SamplingOptions(max_tokens=1, temperature=0.0, ignore_eos=True))
        async for output in runner.generate(request, computes_prompt=computes_prompt):
            if output.outputs[0].token_ids and request_id not in order:
                order.append(request_id)

    long = asyncio.create_task(answer("long", random_prompt(LONG_PROMPT, seed=11), True))
    schedules = runner._tap.num_schedules
    while runner._tap.num_schedules < schedules + 2:  # two chunks in: mid-way through it
        await asyncio.sleep(0.001)
    await asyncio.gather(answer("handoff", random_prompt(8, seed=12), False), long)
    return order


async def test_a_handoff_joins_at_the_next_step_with_headroom_and_waits_the_prompt_without(tiny_model):
    config = EngineConfig(model="tiny", max_num_batched_tokens=STEP_TOKENS)
    args = build_engine_args(config, tiny_model, "plain", "headroom", None)  # no store: no loads
    assert config.admission_headroom("decode") == 64 and config.admission_headroom("prefill") == 0
    with_room = EngineRunner(args, max_prefills=1, admission_headroom=HEADROOM)
    try:
        assert await _first_token_order(with_room) == ["handoff", "long"]
        # lifted again once nothing waits: a prompt alone gets whole-budget chunks
        assert with_room._scheduler().scheduler_config.long_prefill_token_threshold == 0
    finally:
        with_room.shutdown()
    without = EngineRunner(args, max_prefills=1, admission_headroom=0)
    try:  # the control: vLLM's chunk takes the whole budget until the prompt is done
        assert await _first_token_order(without) == ["long", "handoff"]
    finally:
        without.shutdown()
