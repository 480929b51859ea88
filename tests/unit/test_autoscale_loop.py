"""The autoscaling loop (``cluster.autoscale``): what it samples from the conductor, how it
applies the planner's decisions through the pool manager's ``scale`` (one change per pool at a
time, the cool-down from when a change finished, nothing applied while disabled), and how
``baton status`` carries and shows them."""

from __future__ import annotations

import asyncio

import pytest

from cli.operate import autoscale_lines
from cluster.autoscale import Autoscaler, sample_pools
from conductor.cost_model import PrefillCostModel
from conductor.planner import ClusterSample, PlannerConfig, PoolLimits, PoolSample
from conductor.policy import PolicyConfig
from conductor.state import ConductorState
from gateway.admin_wire import StatusView, status_from_pb, status_to_pb
from protos.wire import (
    AutoscaleStatus,
    InstanceStats,
    PlacementRequest,
    PoolDecision,
    PoolStatus,
    ScaleResult,
)

CONFIG = PlannerConfig(enabled=True, interval_s=1.0, window_s=30.0, min_samples=2, cooldown_s=5.0,
                       prefill=PoolLimits(min_instances=1, max_instances=2),
                       decode=PoolLimits(min_instances=1, max_instances=2),
                       ttft_target_ms=1000.0, itl_target_ms=50.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakePools:
    """``PoolManager.scale`` that resizes at once (or when ``release`` is set), recording calls."""

    def __init__(self) -> None:
        self.sizes = {"prefill": 1, "decode": 1}
        self.calls: list[tuple[str, int, str]] = []
        self.release: asyncio.Event | None = None

    async def scale(self, role, size, timeout_s, reason):
        self.calls.append((role, size, reason))
        if self.release is not None:
            await self.release.wait()
        before, self.sizes[role] = self.sizes[role], size
        return ScaleResult(role, before, size, [], [], [], [])


def loaded(pools: FakePools, ttft_ms: float, itl_ms: float = 0.0):
    def sample(at_s: float) -> ClusterSample:
        return ClusterSample(at_s, PoolSample(pools.sizes["prefill"], predicted_ttft_ms=ttft_ms),
                             PoolSample(pools.sizes["decode"], itl_ms=itl_ms))
    return sample


async def run_steps(scaler: Autoscaler, clock: Clock, num_steps: int) -> list[list[str]]:
    actions = []
    for _ in range(num_steps):
        clock.now += 1.0
        actions.append([d.action for d in await scaler.step()])
        await asyncio.sleep(0)  # let a started change run
    return actions


async def test_the_loop_applies_up_then_cools_down_then_holds_at_max():
    pools, clock = FakePools(), Clock()
    scaler = Autoscaler(CONFIG, pools, loaded(pools, ttft_ms=3000), clock)
    actions = await run_steps(scaler, clock, 10)
    assert actions[:3] == [["hold", "hold"], ["up", "hold"], ["hold", "hold"]]
    assert pools.calls == [("prefill", 2, "autoscale: mean TTFT ms 3000.00 > 1000.00")]
    assert scaler.status().last[0].reason == "at max_instances 2: mean TTFT ms 3000.00 > 1000.00"
    # the cool-down ran from t=2 (the change finished at once) to t=7
    assert [(d.reason, d.outcome) for d in scaler.status().changes] == [
        ("mean TTFT ms 3000.00 > 1000.00", "done")]
    assert scaler.status().decisions_total == {
        "prefill/hold": 9, "prefill/up": 1, "decode/hold": 10}


async def test_one_change_per_pool_at_a_time_and_the_cool_down_starts_when_it_finished():
    pools, clock = FakePools(), Clock()
    pools.release = asyncio.Event()
    config = CONFIG.model_copy(update={"prefill": PoolLimits(min_instances=1, max_instances=4)})
    scaler = Autoscaler(config, pools, loaded(pools, ttft_ms=3000, itl_ms=200), clock)
    await run_steps(scaler, clock, 2)  # t=2: both pools grow; both changes hang
    assert [c[:2] for c in pools.calls] == [("prefill", 2), ("decode", 2)]
    await run_steps(scaler, clock, 10)  # t=12: still under way, and 10 s > the cool-down
    assert [c[:2] for c in pools.calls] == [("prefill", 2), ("decode", 2)]
    assert [(d.pool, d.outcome) for d in scaler.status().changes] == [
        ("prefill", "under way"), ("decode", "under way")]
    pools.release.set()
    await scaler.wait_applied()  # finished at t=12: cool-down to 17, evidence after 12
    assert [d.outcome for d in scaler.status().changes] == ["done", "done"]
    await run_steps(scaler, clock, 4)
    assert [c[:2] for c in pools.calls] == [("prefill", 2), ("decode", 2)]
    await run_steps(scaler, clock, 2)  # t=18: two samples since 12, cool-down over
    assert [c[:2] for c in pools.calls] == [("prefill", 2), ("decode", 2), ("prefill", 3)]


async def test_scale_down_is_a_drain_and_nothing_else_happens_to_the_pool_until_it_left():
    pools, clock = FakePools(), Clock()
    pools.sizes["decode"] = 2
    pools.release = asyncio.Event()  # the drain: requests still running on the leaving instance
    draining = {"decode": 0}

    async def drain_then_leave(role, size, timeout_s, reason):
        draining[role] = pools.sizes[role] - size
        pools.sizes[role] = size
        pools.calls.append((role, size, reason))
        await pools.release.wait()
        draining[role] = 0
        return ScaleResult(role, size + 1, size, [], [f"c-{role}-1"], [], [])

    pools.scale = drain_then_leave

    def sample(at_s):
        return ClusterSample(at_s, PoolSample(1),
                             PoolSample(pools.sizes["decode"], num_draining=draining["decode"]))

    scaler = Autoscaler(CONFIG, pools, sample, clock)
    await run_steps(scaler, clock, 2)  # idle: decode 2 -> 1 at t=2
    why = "autoscale: peak over 1 instances: ITL ms 0.00 < 20.00, KV use 0.00 < 0.30"
    assert pools.calls == [("decode", 1, why)]
    await run_steps(scaler, clock, 8)
    assert scaler.status().last[1].reason == "change under way: 0 starting, 1 draining"
    pools.release.set()
    await scaler.wait_applied()
    await run_steps(scaler, clock, 1)  # the cool-down runs from when the drain finished (t=10)
    assert scaler.status().last[1].reason == "cool-down: 4 s of 5 s left"
    await run_steps(scaler, clock, 6)
    assert scaler.status().last[1].reason == "at min_instances 1"
    assert len(pools.calls) == 1


async def test_disabled_it_decides_and_shows_but_applies_nothing_until_enabled():
    pools, clock = FakePools(), Clock()
    scaler = Autoscaler(CONFIG.model_copy(update={"enabled": False}), pools,
                        loaded(pools, ttft_ms=3000), clock)
    assert await run_steps(scaler, clock, 3) == [["hold", "hold"], ["up", "hold"], ["up", "hold"]]
    assert pools.calls == [] and scaler.status().changes == [] and not scaler.status().enabled
    scaler.set_enabled(True)
    await run_steps(scaler, clock, 1)
    assert pools.calls == [("prefill", 2, "autoscale: mean TTFT ms 3000.00 > 1000.00")]


async def test_a_failed_scale_is_reported_and_tried_again_after_the_cool_down(caplog):
    pools, clock = FakePools(), Clock()

    async def refuse(role, size, timeout_s, reason):
        pools.calls.append((role, size, reason))
        raise RuntimeError("no launch spec")

    pools.scale = refuse
    scaler = Autoscaler(CONFIG, pools, loaded(pools, ttft_ms=3000), clock)
    await run_steps(scaler, clock, 9)
    assert [c[:2] for c in pools.calls] == [("prefill", 2), ("prefill", 2)]  # t=2, t=7+
    assert "autoscale prefill -> 2 failed: no launch spec" in caplog.text
    assert [d.outcome for d in scaler.status().changes] == ["failed: no launch spec"] * 2


@pytest.mark.parametrize("result, outcome", [
    (ScaleResult("prefill", 1, 1, ["c-prefill-1"], [], [], ["c-prefill-1: engine died"]),
     "failed: c-prefill-1: engine died"),
    (ScaleResult("prefill", 1, 2, ["c-prefill-1"], [], ["c-prefill-1"], []),
     "pending: c-prefill-1"),
])
async def test_a_change_says_how_it_ended_when_the_pool_did_not_reach_its_size(result, outcome):
    pools, clock = FakePools(), Clock()

    async def scale(role, size, timeout_s, reason):
        pools.calls.append((role, size, reason))
        return result

    pools.scale = scale
    config = CONFIG.model_copy(update={"prefill": PoolLimits(min_instances=1, max_instances=4)})
    scaler = Autoscaler(config, pools, loaded(pools, ttft_ms=3000), clock)
    await run_steps(scaler, clock, 2)
    await scaler.wait_applied()
    assert [d.outcome for d in scaler.status().changes] == [outcome]
    assert autoscale_lines(scaler.status())[-1].endswith(f"1 -> 2 ({outcome}): mean TTFT ms "
                                                         f"3000.00 > 1000.00")


class FakeMembers:
    def __init__(self, phases: dict[str, str]) -> None:
        self._phases = phases

    def phase(self, instance_id):
        return self._phases.get(instance_id)

    def member_ids(self, role=None):
        return sorted(i for i in self._phases if role is None or f"-{role}-" in i)


def test_sample_pools_reads_the_conductors_book_stats_and_phases():
    cost = PrefillCostModel(intercept_ms=0.0, per_token_ms=1.0, per_token_sq_ms=0.0,
                            per_token_cached_ms=0.0)
    state = ConductorState("least_loaded", PolicyConfig(block_size_tokens=16, prefill_cost=cost,
                                                        short_prefill_tokens=0),
                           clock=lambda: 100.0)
    for instance_id, role in (("c-prefill-0", "prefill"), ("c-decode-0", "decode"),
                              ("c-decode-1", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)
    state.update_load("c-decode-0", 0, 0.5)
    state.update_load("c-decode-1", 0, 0.1)
    state.place(PlacementRequest("r1", 300, (), 8))  # 300 ms of prefill booked on c-prefill-0
    stats = {
        "c-prefill-0": InstanceStats("c-prefill-0", "prefill", 1, 0, 5, True, recent_ttft_ms=400.0),
        "c-decode-0": InstanceStats("c-decode-0", "decode", 2, 0, 5, True, recent_itl_ms=30.0),
        "c-decode-1": InstanceStats("c-decode-1", "decode", 0, 0, 5, True, recent_itl_ms=90.0),
    }
    members = FakeMembers({"c-prefill-0": "ready", "c-prefill-1": "starting",
                           "c-decode-0": "ready", "c-decode-1": "ready"})
    sample = sample_pools(state, stats, members, 7.0)
    # TTFT: the shortest priced queue (300 ms) + the median recent TTFT of busy instances;
    # ITL: only c-decode-0 runs requests (c-decode-1's 90 ms is from before it went idle)
    assert sample == ClusterSample(
        7.0, PoolSample(1, 1, 0, predicted_ttft_ms=700.0, num_queued_prefills=1),
        PoolSample(2, 0, 0, itl_ms=30.0, kv_usage_frac=pytest.approx(0.3)))
    state.prefill_done("r1", 0)
    state.finished("r1")
    idle = {i: InstanceStats(i, s.role, 0, 0, 6, True, recent_ttft_ms=400.0, recent_itl_ms=90.0)
            for i, s in stats.items()}
    sample = sample_pools(state, idle, members, 8.0)
    assert (sample.prefill.predicted_ttft_ms, sample.decode.itl_ms) == (0.0, 0.0)  # idle: no signal


def test_status_carries_the_planner_through_the_admin_service_and_prints_it():
    from conductor.state import PlacementCounters

    decisions = AutoscaleStatus(
        True, [PoolDecision("prefill", "up", 1, 2, "mean TTFT ms 3000.00 > 1000.00", 1.7e9),
               PoolDecision("decode", "hold", 1, 1, "at min_instances 1", 1.7e9)],
        [PoolDecision("prefill", "up", 1, 2, "mean TTFT ms 3000.00 > 1000.00", 1.7e9, "done")],
        {"prefill/up": 1, "decode/hold": 1})
    pools = PoolStatus("baton", {"prefill": {"ready": 1}}, [], [], PlacementCounters(), [],
                       decisions)
    for status in (pools, PoolStatus("baton", {}, [], [], PlacementCounters(), [])):
        view = StatusView(status, None, "c")
        assert status_from_pb(status_to_pb(view)) == view
    lines = autoscale_lines(decisions)
    assert lines[:3] == ["autoscale: on",
                         "  prefill: up 1 -> 2: mean TTFT ms 3000.00 > 1000.00",
                         "  decode: hold 1 -> 1: at min_instances 1"]
    assert lines[3].startswith("  changed ") and lines[3].endswith(
        " prefill 1 -> 2: mean TTFT ms 3000.00 > 1000.00")
    assert autoscale_lines(None) == []
    off = msgspec_replace(decisions, enabled=False)
    assert autoscale_lines(off)[0] == "autoscale: off (decides, does not apply)"


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


def test_the_planners_decisions_become_prometheus_series():
    from prometheus_client import REGISTRY

    from conductor.state import PlacementCounters
    from gateway.metrics import set_pool_gauges

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = value("baton_autoscale_decisions_total", pool="prefill", action="up")
    status = AutoscaleStatus(True, [PoolDecision("prefill", "up", 1, 2, "r"),
                                    PoolDecision("decode", "hold", 3, 3, "r")], [],
                             {"prefill/up": 2, "decode/hold": 5})
    set_pool_gauges(PoolStatus("baton", {}, [], [], PlacementCounters(), [], status))
    set_pool_gauges(PoolStatus("baton", {}, [], [], PlacementCounters(), [], msgspec_replace(
        status, enabled=False, decisions_total={"prefill/up": 3, "decode/hold": 5})))
    assert value("baton_autoscale_decisions_total", pool="prefill", action="up") == before + 3
    assert value("baton_autoscale_target_instances", pool="decode") == 3.0
    assert value("baton_autoscale_enabled") == 0.0
