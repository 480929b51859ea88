"""The fronts report a request's cached tokens by tier beside ``cached_tokens``: gRPC in
``Usage.cached_tokens_by_tier`` (and ``baton generate --json`` through the client), HTTP in
``usage.prompt_tokens_details.cached_tokens_by_tier``, streamed or not, the engine contract in
its handoff JSON. The breakdown comes from the side whose ``cached_tokens`` is reported (the
prefill's, or the decode engine's when it prefilled itself) and adds up to it exactly."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import pytest_asyncio

from engine.models import prepare_model
from gateway import client
from gateway.engine_replies import placement_json
from gateway.inference import InferenceServicer, start_gateway
from gateway.openai_http import build_app, start_http
from gateway.router import Placed, cached_by_tier, fit_tiers, num_cached_tokens
from gateway.tokenization import PromptTokenizer
from protos.wire import CachedByTier, Placement, PrefillResult, TokenChunk

SERVED = "tiny"
MAX_MODEL_LEN = 100
APART = Placement(prefill_instance="prefill-0", decode_instance="decode-1", policy="kv-aware",
                  reason="r")
TOGETHER = Placement(prefill_instance="decode-1", decode_instance="decode-1", policy="kv-aware",
                     reason="r")
PREFILL_TIERS = CachedByTier(device=1536, host=256, disk=128, pulled=0)
DECODE_TIERS = CachedByTier(device=0, host=1920, disk=0, pulled=0)  # a hand-off's loads


def prefill_result(tiers: CachedByTier | None, num_cached_tokens: int = 1920) -> PrefillResult:
    return PrefillResult(request_id="r", instance_id="prefill-0", num_prompt_tokens=2000,
                         num_cached_tokens=num_cached_tokens, num_stored_blocks=1,
                         prefill_ms=3.0, cached_by_tier=tiers)


def last_chunk(tiers: CachedByTier | None, num_cached_tokens: int = 1920) -> TokenChunk:
    return TokenChunk(token_ids=(8,), text="d", finish_reason="stop", num_loaded_tokens=1920,
                      num_cached_tokens=num_cached_tokens, cached_by_tier=tiers)


def test_the_breakdown_comes_from_the_side_whose_cached_tokens_are_reported():
    apart = Placed(APART, prefill_result(PREFILL_TIERS))
    assert cached_by_tier(apart, last_chunk(DECODE_TIERS)) == PREFILL_TIERS
    together = Placed(TOGETHER, prefill_result(None, 0))
    assert cached_by_tier(together, last_chunk(PREFILL_TIERS)) == PREFILL_TIERS
    assert cached_by_tier(together, last_chunk(None)) is None
    assert cached_by_tier(Placed(APART, prefill_result(None)), last_chunk(DECODE_TIERS)) is None


@pytest.mark.parametrize("tiers, total, expected", [
    (PREFILL_TIERS, 1920, PREFILL_TIERS),
    (PREFILL_TIERS, 300, CachedByTier(host=172, disk=128)),  # capped: device gives way first
    (CachedByTier(device=10, host=20, disk=30, pulled=40), 50, CachedByTier(disk=10, pulled=40)),
    (CachedByTier(host=20), 64, CachedByTier(device=44, host=20)),  # short: device is the rest
    (CachedByTier(host=20), 0, CachedByTier()),
])
def test_fit_tiers_adds_up_to_the_reported_count(tiers, total, expected):
    fitted = fit_tiers(tiers, total)
    assert fitted == expected and fitted.total == total


def test_a_capped_count_caps_its_breakdown():
    chunk = last_chunk(CachedByTier(device=1000, host=1000), num_cached_tokens=1500)
    placed = Placed(TOGETHER, prefill_result(None, 0))
    assert num_cached_tokens(placed, chunk) == 1500
    assert cached_by_tier(placed, chunk) == CachedByTier(device=500, host=1000)


def test_the_engine_contracts_handoff_carries_the_breakdown():
    handoff = json.loads(placement_json(Placed(APART, prefill_result(PREFILL_TIERS)),
                                        last_chunk(DECODE_TIERS)))["baton"]
    assert (handoff["cached_tokens"], handoff["cached_tokens_by_tier"]) == (
        1920, {"device": 1536, "host": 256, "disk": 128, "pulled": 0})
    handoff = json.loads(placement_json(Placed(APART, prefill_result(None)), last_chunk(None)))
    assert handoff["baton"]["cached_tokens_by_tier"] is None


class TieredRouter:
    """One ``Placed`` whose prefill broke its cached tokens down (or not), then two chunks."""

    def __init__(self, tiers: CachedByTier | None) -> None:
        self.tiers = tiers

    def is_ready(self) -> bool:
        return True

    async def stream(self, request):
        yield Placed(APART, prefill_result(self.tiers))
        await asyncio.sleep(0.001)
        yield TokenChunk(token_ids=(5, 6), text="ab")
        yield last_chunk(DECODE_TIERS)


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


@pytest_asyncio.fixture
async def grpc_target(request, tokenizer):
    servicer = InferenceServicer(TieredRouter(request.param), tokenizer, SERVED, MAX_MODEL_LEN)
    running = await start_gateway(servicer, "127.0.0.1", 0)
    yield f"127.0.0.1:{running.port}"
    await running.stop(None)


@pytest.mark.parametrize("grpc_target", [PREFILL_TIERS], indirect=True)
async def test_grpc_usage_and_the_clients_result_carry_the_breakdown(grpc_target):
    result = await client.generate(grpc_target, text="hi", max_tokens=4)

    usage = result["usage"]
    assert (usage["cached_tokens"], usage["cache_read_input_tokens"]) == (1920, 1920)
    assert usage["cached_tokens_by_tier"] == {"device": 1536, "host": 256, "disk": 128,
                                              "pulled": 0}


@pytest.mark.parametrize("grpc_target", [None], indirect=True)
async def test_grpc_usage_leaves_the_breakdown_unset_when_there_is_none(grpc_target):
    result = await client.generate(grpc_target, text="hi", max_tokens=4)

    assert result["usage"]["cached_tokens"] == 1920
    assert "cached_tokens_by_tier" not in result["usage"]


@pytest_asyncio.fixture
async def http(tokenizer):
    running = await start_http(build_app(TieredRouter(PREFILL_TIERS), tokenizer, SERVED,
                                         MAX_MODEL_LEN), "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}", timeout=10) as http:
        yield http
    await running.stop(grace_s=1.0)


EXPECTED_DETAILS = {"cached_tokens": 1920, "cached_tokens_by_tier": {
    "device": 1536, "host": 256, "disk": 128, "pulled": 0}}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
async def test_http_usage_carries_the_breakdown_beside_cached_tokens(http, path, body):
    answer = await http.post(path, json={"model": SERVED, "max_tokens": 4, **body})

    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens_details"] == EXPECTED_DETAILS


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
async def test_streamed_http_usage_carries_the_breakdown(http, path, body):
    request = {"model": SERVED, "max_tokens": 4, "stream": True,
               "stream_options": {"include_usage": True}, **body}
    async with http.stream("POST", path, json=request) as answer:
        events = [line[len("data: "):] async for line in answer.aiter_lines()
                  if line.startswith("data: ")]

    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens_details"] == EXPECTED_DETAILS
