"""Helpers for integration tests that run real engines."""

from __future__ import annotations

import contextlib
import random
from typing import AsyncIterator

from cluster.config import load_config
from cluster.serve import BatonServer
from engine.builder import build_engine_args
from engine.config import EngineConfig
from engine.models import PreparedModel
from engine.runner import EngineRunner
from protos.wire import EngineRequest, SamplingOptions


def plain_runner(model: PreparedModel) -> EngineRunner:
    """One ordinary vLLM engine (no connector, no disaggregation): the reference output."""
    return EngineRunner(build_engine_args(EngineConfig(model=model.name), model, "plain", "plain", None))


async def plain_generate(runner: EngineRunner, token_ids: list[int], max_tokens: int,
                         request_id: str) -> list[int]:
    request = EngineRequest(request_id, tuple(token_ids), SamplingOptions(max_tokens=max_tokens, temperature=0.0))
    out: list[int] = []
    async for output in runner.generate(request):
        out.extend(output.outputs[0].token_ids)
    return out


def random_prompt(num_tokens: int, seed: int, vocab_low: int = 100, vocab_high: int = 40000) -> list[int]:
    """A reproducible prompt of token ids (distinct seeds give prompts sharing no block)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_low, vocab_high) for _ in range(num_tokens)]


@contextlib.asynccontextmanager
async def running_server(overrides: dict) -> AsyncIterator[BatonServer]:
    """A whole local cluster with both fronts on free ports (unless ``overrides`` say otherwise)."""
    server = BatonServer(load_config(None, {"gateway.port": 0, "http.port": 0, **overrides}))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
