"""Workers die. A prefill worker that dies before answering: the request is placed again on the
other prefill instance and completes with the right output, and the dead one gets no more work.
A decode worker that dies mid-stream: the stream ends with a clean UNAVAILABLE that says how many
tokens were delivered (no hang), and later requests get UNAVAILABLE at once."""

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
    # stats polls every 30 s: only the router's own report can tell the conductor of a death
    async with running_server({"engine.model": "tiny", "http.enabled": False, "name": "deadtest",
                               "prefill.num_instances": 2,
                               "kvstore.host_capacity_bytes": 64 << 20,
                               "conductor.stats_interval_s": 30.0,
                               "conductor.tuning.short_prefill_tokens": 0}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model):
    runner = plain_runner(tiny_model)
    yield runner
    runner.shutdown()


async def test_a_dead_prefill_worker_is_replaced_by_the_other_and_the_answer_is_right(server, reference):
    prefix = random_prompt(4 * 128, seed=10)
    first = await client.generate(server.target, token_ids=prefix + [7, 8, 9], max_tokens=4)
    holder = first["placement"]["prefill"]
    [other] = [i for i in server.cluster.prefill_ids if i != holder]
    ray.kill(server.cluster.actor(holder), no_restart=True)
    # the conductor still believes in the holder, which holds the prefix: it is placed there
    prompt = prefix + [11, 12, 13]
    expected = await plain_generate(reference, prompt, 8, "ref-dead-prefill")
    retries = metrics.RETRIES.labels("prefill_worker_died")
    retried_before = retries._value.get()

    result = await asyncio.wait_for(
        client.generate(server.target, token_ids=prompt, max_tokens=8), timeout=60)

    assert result["token_ids"] == expected
    assert result["placement"]["prefill"] == other
    assert retries._value.get() == retried_before + 1  # placed on the dead holder, then again
    rows = {r.instance_id: r for r in (await server.cluster.conductor.pool_status.remote()).instances}
    assert rows[holder].phase == "not_ready" and rows[other].phase == "ready"
    again = await client.generate(server.target, token_ids=prefix + [14], max_tokens=2)
    assert again["placement"]["prefill"] == other


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
    assert f"died after {len(delivered)} tokens were delivered" in info.value.details

    started = time.monotonic()
    with pytest.raises(client.GenerateFailed) as later:
        await asyncio.wait_for(
            client.generate(server.target, token_ids=random_prompt(50, seed=3), max_tokens=4),
            timeout=30)
    assert later.value.status == "UNAVAILABLE"
    assert time.monotonic() - started < 10
