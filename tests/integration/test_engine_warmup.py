"""The engines' warm-up on real engines: it starts the conductor's cost model, leaves nothing in
the store and counts as no request."""

from __future__ import annotations

import pytest
import pytest_asyncio

from gateway import client
from tests.integration.engines import random_prompt, running_server

pytestmark = pytest.mark.engine

P0, D0 = "warmtest-prefill-0", "warmtest-decode-0"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({
        "name": "warmtest", "engine.model": "tiny", "http.enabled": False,
        "prefill.num_instances": 1, "decode.num_instances": 1,
        "conductor.tuning.short_prefill_tokens": 0,
    }) as srv:
        yield srv


async def test_the_warm_up_prices_the_first_request_and_stores_nothing(server, tiny_model):
    import ray

    from conductor.cost_model import PrefillCostModel, PrefillSample
    from engine.warmup import warmup_points

    actors = [ray.get_actor(i, namespace=server.cluster.namespace) for i in (P0, D0)]
    measured = [m for actor in actors for m in await actor.warmup.remote()]
    points = warmup_points(tiny_model.max_model_len, 128)
    assert [(m.uncached_tokens, m.cached_tokens) for m in measured] == points * 2  # cache hits as planned
    pools = await server.cluster.conductor.pool_status.remote()
    assert pools.cost_model.prefill_source == f"warm-up of {2 * len(points)} prefills"
    assert [(s.host_used_blocks, s.disk_used_blocks) for s in pools.stores] == [(0, 0)]
    for actor in actors:
        stats = await actor.stats.remote()
        assert (stats.num_finished_reqs, stats.num_prompt_tokens) == (0, 0)

    reply = await client.generate(server.target, token_ids=random_prompt(700, seed=5), max_tokens=2)
    fitted = PrefillCostModel.fit([PrefillSample(uncached_tokens=m.uncached_tokens, cached_tokens=m.cached_tokens,
                                                 prefill_ms=m.prefill_ms) for m in measured])
    assert reply["placement"]["prefill_ms"] == pytest.approx(fitted.t_prefill_ms(700, 0), rel=1e-6)
