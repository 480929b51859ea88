"""Coalescing on engines that compute one prompt at a time: a request whose next blocks a
prefill on a co-located (decode) instance is computing is placed at once on that instance,
queued right behind it, priced as waiting was; the engine's prefill gate starts it once the
owner's blocks are computed. The real conductor; the engines' side is played by calls."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from conductor.conductor import Conductor
from conductor.config import ConductorConfig
from conductor.cost_model import PrefillCostModel
from conductor.policy import PolicyConfig
from kvstore.keys import KeyExtras, block_keys
from protos.wire import PlacementRequest, Registration

pytestmark = pytest.mark.asyncio(loop_scope="session")

BS = 4
SHARED_BLOCKS = 250
SHARED = list(range(1000, 1000 + SHARED_BLOCKS * BS))  # 1,000 ms at 1 ms a token
OWN_TOKENS = 50 * BS  # each request's own: 200 ms
COST = PrefillCostModel(intercept_ms=0.0, per_token_ms=1.0, per_token_sq_ms=0.0, per_token_cached_ms=0.0)


@pytest_asyncio.fixture(loop_scope="session")
async def conductor(request):
    prompts_at_once, in_queue, weight, saves = getattr(request, "param", (1, True, 0.0, False))
    conductor = Conductor(ConductorConfig(stats_interval_s=3600, coalesce_in_queue=in_queue,
                                          coalesce_duplicate_weight=weight), "t",
                          PolicyConfig(block_size_tokens=BS, prefill_cost=COST,
                                       prompts_at_once=prompts_at_once))
    for instance_id in ("d0", "d1"):
        await conductor.register(Registration(instance_id, "decode", "node0", "m", "L",
                                              saves_prompts=saves))
        await conductor.mark_ready(instance_id)
    yield conductor
    for task in conductor._tasks:
        task.cancel()
    await asyncio.gather(*conductor._tasks, return_exceptions=True)
    conductor._ctx.destroy(linger=0)


def request(request_id: str, private: int) -> PlacementRequest:
    tokens = SHARED + list(range(private * 1000, private * 1000 + OWN_TOKENS))
    return PlacementRequest(request_id, len(tokens), tuple(block_keys(tokens, BS, KeyExtras("m"))), 8)


async def test_a_follower_is_queued_at_once_behind_the_prefill_of_its_blocks(conductor):
    placed_at = time.monotonic()
    owner = await conductor.place(request("owner", 1))
    booked_by = time.monotonic()
    # waiting (~600 ms of the owner left + 200 of its own; the second ~600 + 200 + 200) now
    # beats recomputing the whole prompt on the idle instance (1,200)
    await asyncio.sleep(0.6)
    asked_at = time.monotonic()
    first = await asyncio.wait_for(conductor.place(request("first", 2)), 0.5)
    answered_at = time.monotonic()
    second = await asyncio.wait_for(conductor.place(request("second", 3)), 0.5)
    for placed in (first, second):
        assert (placed.prefill_instance, placed.decode_instance) == (owner.prefill_instance,) * 2
        assert placed.reason.startswith("queued behind owner: coalesce on owner at "), placed.reason
        assert " < now " in placed.reason
        assert placed.expected_cached_blocks == SHARED_BLOCKS
        assert placed.prefill_ms == pytest.approx(OWN_TOKENS * 1.0)  # the rest, the shared part cached
        assert placed.transfer_ms == 0.0
    # the owner's time left (its 1,200 ms less what it has worked since it was booked), then
    # (for the second) the first's rest booked behind it
    worked_ms = ((asked_at - booked_by) * 1000, (answered_at - placed_at) * 1000)  # least, most
    assert owner.prefill_ms - worked_ms[1] <= first.queue_ms <= owner.prefill_ms - worked_ms[0]
    assert second.queue_ms - first.queue_ms == pytest.approx(OWN_TOKENS * 1.0, abs=20.0)
    status = await conductor.status()
    assert (status.counters.coalesced, status.counters.queued_behind) == (2, 2)
    assert conductor.state.in_flight_on(owner.prefill_instance)[0] == 3
    # the owner's end does not release anything: nobody waits in the conductor
    await conductor.prefill_done("owner", 0)
    assert conductor.state.in_flight_on(owner.prefill_instance)[0] == 2


@pytest.mark.parametrize("conductor", [(0, True, 0.0, False), (1, False, 0.0, False)], indirect=True)
async def test_where_the_engine_packs_prompts_or_the_switch_is_off_the_follower_waits(conductor):
    owner = await conductor.place(request("owner", 1))
    await asyncio.sleep(0.25)
    follower = asyncio.create_task(conductor.place(request("first", 2)))
    await asyncio.sleep(0.05)
    assert not follower.done()  # it waits in the conductor for the owner's prefill
    await conductor.prefill_done("owner", 0)
    placed = await asyncio.wait_for(follower, 5)
    assert placed.reason.startswith("coalesced after"), placed.reason
    assert placed.prefill_instance == owner.prefill_instance
    assert (await conductor.status()).counters.queued_behind == 0


@pytest.mark.parametrize("conductor", [(1, True, 0.0, False), (1, True, 1.0, False)], indirect=True)
async def test_the_duplicate_weight_counts_recomputed_work_against_placing_now(conductor):
    weight = conductor._config.coalesce_duplicate_weight
    owner = await conductor.place(request("owner", 1))
    # at once: waiting (1,200 + 200 ms) loses to recomputing on the idle instance (1,200 ms)
    # unless the 1,000 ms it would compute twice count against it
    placed = await asyncio.wait_for(conductor.place(request("first", 2)), 0.5)
    if weight == 0.0:
        assert placed.reason.startswith("not coalesced (coalesce on owner"), placed.reason
        assert placed.prefill_instance != owner.prefill_instance
        assert " >= now 1200.0 ms at " in placed.reason
    else:
        assert placed.reason.startswith("queued behind owner"), placed.reason
        assert placed.prefill_instance == owner.prefill_instance
        assert " < now 1200.0 + duplicate 1000.0 ms at " in placed.reason


@pytest.mark.parametrize("conductor", [(1, True, 0.0, True)], indirect=True)
async def test_a_follower_that_would_load_the_blocks_sooner_elsewhere_waits_for_them(conductor):
    # the engines save their prompts: once the owner is done, its blocks can be loaded on the
    # other, idle instance (~8 ms for 250 blocks), so a second follower, which would queue
    # behind the first there, waits in the conductor instead
    owner = await conductor.place(request("owner", 1))
    await asyncio.sleep(0.6)  # the second: ~600 + 200 + 200 ms behind, ~600 + 8 + 200 on d1
    first = await asyncio.wait_for(conductor.place(request("first", 2)), 0.5)
    assert first.reason.startswith("queued behind owner"), first.reason
    second = asyncio.create_task(conductor.place(request("second", 3)))
    await asyncio.sleep(0.05)
    assert not second.done()
    await conductor.prefill_done("owner", 0)
    placed = await asyncio.wait_for(second, 5)
    assert placed.reason.startswith("coalesced after"), placed.reason
    assert (await conductor.status()).counters.queued_behind == 1
    assert first.prefill_instance == owner.prefill_instance
