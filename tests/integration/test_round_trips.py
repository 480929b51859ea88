"""The remote round trips of one disaggregated request, counted and pinned.

A local cluster (tiny model, one prefill and one decode instance on one store node, every prompt
disaggregated). Each component counts the remote calls it makes on behalf of requests
(``protos.wire.CallCounts``): the router in the gateway's process, and each worker for itself
and its engine's connector (the process's store client), read back through ``call_counts``.
The conductor makes no remote call while placing. Background polling (readiness, stats) is not
counted.

A request's calls are pinned exactly, by component and kind: ``blocking`` (the caller waits for
the answer), ``deferred`` (sent without waiting, awaited later off that path) and ``sent``
(fire-and-forget).

Before this was pinned, one steady-state request made 8 blocking round trips (place, prefill,
decode stream; the prefill's store lookup, reserve and commit; the decode's acquire and
release) and sent 2 (prefill_done, finished); the first also fetched the key scheme. Then 4
blocking (the decode's acquire was still waited for on vLLM's scheduler step), 2 deferred, 3
sent. Now, with the connector's transfers off the engine's step (``engine.async_kv_transfers``):
3 blocking (place, prefill, decode stream: no engine waits on the store while it steps), 3
deferred (the prefill's reservation and commit, made by its saving thread after the forward
pass, one of each for all of a step's requests, the commit awaited once before the prefill
result returns; the decode's lookup, sent with the step's other lookups and read on a later
scheduler step), 3 sent (prefill_done, finished, the decode's unpin once its KV landed). The
prefill asks the store nothing when its placement expects nothing cached, saves nothing the
store held at its lookup, and the router fetches the key scheme while it polls readiness."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from gateway import client
from protos.wire import CallCounts
from tests.integration.engines import random_prompt, running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

BLOCK = 128  # vLLM's CPU block size
MAX_TOKENS = 8

ROUTER_STEADY = CallCounts(
    blocking={"conductor.place": 1, "prefill.prefill": 1},
    sent={"conductor.finished": 1, "conductor.prefill_done": 1, "decode.start": 1},
)
"""place → prefill → the decode started on the instance's outbox (its tokens come back on the
stream the router keeps open to that instance); the conductor's books are closed without
waiting."""
PREFILL_STEADY = CallCounts(deferred={"store.commit": 1, "store.reserve_many": 1})
"""The producer's connector saves the prompt (no lookup: the placement expects nothing cached):
its saving thread reserves, copies and commits after the forward pass; the commit is awaited
before the result returns."""
DECODE_STEADY = CallCounts(deferred={"store.acquire_many": 1}, sent={"store.release": 1})
"""The decode engine's connector: the lookup pins the prompt's blocks (sent without waiting),
its loading thread copies them, and they are unpinned without waiting once landed. It saves
nothing: the store held every prompt block at its lookup."""
FIRST_REQUEST_ONLY = CallCounts(blocking={"gcs.get_actor": 2, "decode.outbox": 1})
"""The router's first request also looks up both workers' actors (then cached) and opens the
decode instance's outbox stream (then kept)."""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({"engine.model": "tiny", "http.enabled": False, "name": "roundtrips",
                               "prefill.num_instances": 1, "decode.num_instances": 1,
                               "kvstore.host_capacity_bytes": 64 << 20,
                               "conductor.tuning.short_prefill_tokens": 0}) as srv:
        yield srv


async def call_counts(server) -> dict[str, CallCounts]:
    cluster = server.cluster
    [prefill_id], [decode_id] = cluster.prefill_ids, cluster.decode_ids
    return {"router": server.router.call_counts(),
            "prefill": await cluster.actor(prefill_id).call_counts.remote(),
            "decode": await cluster.actor(decode_id).call_counts.remote()}


async def hashed_prompts(server) -> list[int]:
    """Prompts the prefill and the decode engine's connectors hashed themselves."""
    cluster = server.cluster
    return [(await cluster.actor(i).connector_counters.remote()).hashed_prompts
            for i in (*cluster.prefill_ids, *cluster.decode_ids)]


async def one_request(server, seed: int) -> dict[str, CallCounts]:
    """The calls one disaggregated request of three full blocks and a tail made."""
    prompt = random_prompt(3 * BLOCK + 20, seed=seed)
    return await request_calls(server, prompt)


async def request_calls(server, prompt: list[int],
                        num_loaded_tokens: int | None = None) -> dict[str, CallCounts]:
    """The calls a request for ``prompt`` made; its decode loaded ``num_loaded_tokens`` from the
    store (default: all of the prompt but the last token)."""
    hashed_before = await hashed_prompts(server)
    before = await call_counts(server)
    result = await client.generate(server.target, token_ids=prompt, max_tokens=MAX_TOKENS)
    # it went through the prefill engine and the store: the decode loaded all but the last token
    expected = len(prompt) - 1 if num_loaded_tokens is None else num_loaded_tokens
    assert result["usage"]["loaded_tokens"] == expected
    assert result["placement"]["prefill"] != result["placement"]["decode"]
    deadline = time.monotonic() + 5
    while True:  # the router closes the conductor's books as the stream ends
        after = await call_counts(server)
        if after["router"].sent.get("conductor.finished", 0) > before["router"].sent.get(
                "conductor.finished", 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    # the prompt was hashed once, at the gateway: neither engine's connector hashed it again
    assert await hashed_prompts(server) == hashed_before
    return {name: after[name].since(before[name]) for name in after}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def first_request(server) -> dict[str, CallCounts]:
    return await one_request(server, seed=1)


async def test_the_first_request_also_fetches_what_the_router_caches(first_request):
    assert first_request == {"router": ROUTER_STEADY.plus(FIRST_REQUEST_ONLY),
                             "prefill": PREFILL_STEADY, "decode": DECODE_STEADY}


async def test_a_steady_state_request_makes_exactly_these_round_trips(server, first_request):
    calls = await one_request(server, seed=2)

    assert calls == {"router": ROUTER_STEADY, "prefill": PREFILL_STEADY, "decode": DECODE_STEADY}
    assert sum(c.total("blocking") for c in calls.values()) == 2
    assert sum(c.total("deferred") for c in calls.values()) == 3
    assert sum(c.total("sent") for c in calls.values()) == 4


async def test_an_engine_driven_directly_hashes_the_prompt_itself(server, first_request):
    """The control for "hashed once": a request that carries no keys (sent to the decode worker
    directly, not through the gateway) is hashed by the engine's connector."""
    from protos.wire import EngineRequest, SamplingOptions

    decode = server.cluster.actor(server.cluster.decode_ids[0])
    before = await hashed_prompts(server)
    request = EngineRequest("direct", tuple(random_prompt(BLOCK + 5, seed=3)),
                            SamplingOptions(max_tokens=2, temperature=0.0))
    async for ref in decode.generate.options(num_returns="streaming").remote(request):
        await ref
    assert await hashed_prompts(server) == [before[0], before[1] + 1]


async def test_a_prefill_whose_placement_expects_a_cached_prefix_looks_it_up(server, first_request):
    """The same prompt again: the placement expects its three full blocks cached, so the
    prefill's connector asks the store; its engine's own prefix cache holds the full blocks,
    so it loads the tail, and saves nothing (the store held every block at its lookup)."""
    prompt = random_prompt(3 * BLOCK + 20, seed=4)
    await request_calls(server, prompt)

    # the decode engine's own prefix cache holds the full blocks now: it loads the tail
    calls = await request_calls(server, prompt, num_loaded_tokens=len(prompt) - 1 - 3 * BLOCK)

    assert calls == {"router": ROUTER_STEADY,
                     "prefill": CallCounts(deferred={"store.acquire_many": 1},
                                           sent={"store.release": 1}),
                     "decode": DECODE_STEADY}
