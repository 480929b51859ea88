"""PoolManager's drain and victim choice over a real ConductorState, with stand-in worker actors
(no Ray, no engines): a draining instance gets no new work, leaves only once its booked requests
and its engine queue are empty, and the operator's mistakes are refused with clear errors."""

from __future__ import annotations

import asyncio

import pytest

from cluster.pools import PoolManager, ScaleRefused, UnknownInstance, _Member
from conductor.policy import PolicyConfig
from conductor.state import ConductorState
from protos.wire import InstanceStats, PlacementRequest


class _Method:
    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args):
        async def call():
            return self._fn(*args)
        return call()


class FakeWorker:
    """Answers ``stats`` and ``shutdown`` like a worker actor handle."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.num_running_reqs = 0
        self.shut_down = False
        self.stats = _Method(lambda: InstanceStats(instance_id, "decode", self.num_running_reqs, 0, 0, True))
        self.shutdown = _Method(self._shutdown)

    def _shutdown(self) -> None:
        self.shut_down = True


def _fleet(decodes: int = 2) -> tuple[ConductorState, PoolManager, dict[str, FakeWorker]]:
    state = ConductorState("least_loaded", PolicyConfig())
    pools = PoolManager(state, "test")
    workers = {}
    for role, instance_id in [("prefill", "c-prefill-0")] + [("decode", f"c-decode-{i}") for i in range(decodes)]:
        state.register(instance_id, role, "node0", "m", "layout")
        state.set_ready(instance_id, True)
        workers[instance_id] = FakeWorker(instance_id)
        pools._members[instance_id] = _Member(role, "ready", workers[instance_id])
    return state, pools, workers


def _request(request_id: str) -> PlacementRequest:
    return PlacementRequest(request_id, 100, (), 16)


async def test_drain_waits_for_booked_requests_and_the_engine_queue():
    state, pools, workers = _fleet()
    victim = state.place(_request("r1")).decode_instance
    other = next(i for i in ("c-decode-0", "c-decode-1") if i != victim)
    state.prefill_done("r1", 0)
    drain = asyncio.create_task(pools.drain(victim, timeout_s=30))
    await asyncio.sleep(0.2)
    assert not drain.done() and pools.phase(victim) == "draining"
    for n in range(4):  # while draining every new request goes elsewhere
        assert state.place(_request(f"new{n}")).decode_instance == other
    workers[victim].num_running_reqs = 1  # books closed, but the engine still runs it
    state.finished("r1")
    await asyncio.sleep(0.2)
    assert not drain.done()
    workers[victim].num_running_reqs = 0
    result = await asyncio.wait_for(drain, 5)
    assert result.instance_id == victim and result.drained_requests == 1
    assert workers[victim].shut_down
    assert state.instance_ids("decode") == [other] and pools.member_ids("decode") == [other]


async def test_drain_refuses_unknown_and_last_ready_instances():
    state, pools, _ = _fleet(decodes=1)
    with pytest.raises(UnknownInstance, match="no instance 'c-decode-9'.*c-decode-0"):
        await pools.drain("c-decode-9", timeout_s=1)
    with pytest.raises(ScaleRefused, match="last ready decode instance"):
        await pools.drain("c-decode-0", timeout_s=1)
    with pytest.raises(ScaleRefused, match="not started with `baton up`"):
        await pools.scale("decode", 2, timeout_s=1, reason="test")


async def test_scale_down_victims_are_starting_then_least_busy_newest():
    state, pools, workers = _fleet(decodes=3)
    pools._members["c-decode-3"] = _Member("decode", "starting", FakeWorker("c-decode-3"))
    state.place(_request("busy"))  # least_loaded: the first decode instance
    busy = state._decodes["busy"]
    order = pools._victims("decode", 4)
    assert order[0] == "c-decode-3"
    assert order[-1] == busy
    assert order[1:3] == sorted(set(order[1:3]), key=lambda i: -int(i.rsplit("-", 1)[1]))
