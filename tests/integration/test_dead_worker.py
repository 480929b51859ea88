"""A decode worker dies: the stream it was serving ends with a clean UNAVAILABLE (no hang), and
later requests get UNAVAILABLE at once instead of waiting on a dead actor."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import ray

from conductor import client
from tests.integration.engines import random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({"engine.model": "tiny", "http.enabled": False, "name": "deadtest",
                               "kvstore.host_capacity_bytes": 64 << 20,
                               "conductor.stats_interval_s": 0.2,
                               "conductor.tuning.short_prefill_tokens": 0}) as srv:
        yield srv


async def test_killing_the_decode_worker_mid_stream_ends_cleanly_and_later_requests_fail_fast(server):
    ok = await client.generate(server.target, token_ids=random_prompt(200, seed=1), max_tokens=4)
    assert ok["usage"]["completion_tokens"] == 4

    delivered: list[int] = []
    stream = asyncio.create_task(client.generate(
        server.target, token_ids=random_prompt(200, seed=2), max_tokens=6000,
        on_delta=lambda _text, ids: delivered.extend(ids)))
    while len(delivered) < 5:
        await asyncio.sleep(0.01)
    ray.kill(server.cluster.actor(server.cluster.decode_ids[0]), no_restart=True)

    with pytest.raises(client.GenerateFailed) as info:
        await asyncio.wait_for(stream, timeout=30)
    assert info.value.status == "UNAVAILABLE"
    assert "decode" in info.value.details

    started = time.monotonic()
    with pytest.raises(client.GenerateFailed) as later:
        await asyncio.wait_for(
            client.generate(server.target, token_ids=random_prompt(50, seed=3), max_tokens=4),
            timeout=30)
    assert later.value.status == "UNAVAILABLE"
    assert time.monotonic() - started < 10
