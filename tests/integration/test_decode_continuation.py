"""A decode worker dies mid-stream while another decode instance is ready: the stream continues
there from the tokens already delivered. The client sees every token once, in order, and under
greedy decoding the whole answer is exactly a plain engine's."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import ray

from gateway import client, metrics
from tests.integration.engines import plain_generate, plain_runner, random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({"engine.model": "tiny", "http.enabled": False, "name": "movetest",
                               "prefill.num_instances": 1, "decode.num_instances": 2,
                               "kvstore.host_capacity_bytes": 64 << 20,
                               "conductor.tuning.short_prefill_tokens": 0}) as srv:
        yield srv


async def test_the_stream_continues_on_the_other_decode_instance_token_for_token(server, tiny_model):
    prompt = random_prompt(300, seed=21)
    max_tokens = 600
    runner = plain_runner(tiny_model)
    try:
        expected = await plain_generate(runner, prompt, max_tokens, "ref-move")
    finally:
        runner.shutdown()
    moves = metrics.RETRIES.labels("decode_worker_died")
    moves_before = moves._value.get()

    delivered: list[int] = []
    stream = asyncio.create_task(client.generate(
        server.target, token_ids=prompt, max_tokens=max_tokens,
        on_delta=lambda _text, ids: delivered.extend(ids)))
    while len(delivered) < 8:
        assert not stream.done(), "the stream ended before the kill"
        await asyncio.sleep(0.005)
    rows = (await server.cluster.conductor.pool_status.remote()).instances
    [streaming] = [r.instance_id for r in rows if r.role == "decode" and r.num_booked_reqs]
    ray.kill(server.cluster.actor(streaming), no_restart=True)
    killed_at = len(delivered)

    result = await asyncio.wait_for(stream, timeout=120)

    assert 8 <= killed_at < max_tokens
    assert result["token_ids"] == expected  # no token lost, none repeated, same greedy answer
    assert delivered == expected
    assert result["usage"]["completion_tokens"] == len(expected)
    assert result["usage"]["prompt_tokens"] == len(prompt)
    assert moves._value.get() == moves_before + 1
    deadline = time.monotonic() + 5  # the router closes the books as the stream ends
    while True:
        rows = {r.instance_id: r for r in (await server.cluster.conductor.pool_status.remote()).instances}
        booked = sum(r.num_booked_reqs for r in rows.values())
        if booked == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert booked == 0
    assert rows[streaming].phase == "not_ready"
