"""The simulator checked against what must be true whatever the policy: the trace's analytic
hit ceiling, and a fleet with no choice to make giving the same answer for every policy."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conductor.policy import POLICIES
from simulator.fleet import FleetConfig
from simulator.metrics import summarize
from simulator.profile import load_profile
from simulator.sim import Simulation, Workload
from simulator.trace import TraceRequest, ceiling_hit_ratio, load_trace

TRACE = Path(__file__).parents[1] / "data" / "mooncake_synthetic_trace.jsonl"
PROFILE = load_profile("analytic")
IDLE = 1e-4
"""A rate scale that spaces arrivals ~2.5 hours apart: every request finishes before the next."""


@pytest.fixture(scope="module")
def shared_trace() -> list[TraceRequest]:
    return load_trace(TRACE)


def unlimited(num_prefill: int, num_decode: int, **fields) -> FleetConfig:
    return FleetConfig(num_prefill_instances=num_prefill, num_decode_instances=num_decode,
                       device_kv_bytes=None, host_kv_bytes_per_node=None, disk_kv_bytes_per_node=None,
                       admission=False, **fields)


def test_the_shared_trace_matches_its_published_figures(shared_trace):
    assert len(shared_trace) == 3993
    assert sum(len(r.hash_ids) for r in shared_trace) == 121_877
    assert len({k for r in shared_trace for k in r.hash_ids}) == 43_924
    assert round(ceiling_hit_ratio(shared_trace), 3) == 0.640


def test_ceiling_of_a_small_trace():
    requests = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1536, 1, (1, 2, 3)),
                TraceRequest(2, 100, 1, (9,))]
    assert ceiling_hit_ratio(requests) == 2 / 6


@pytest.mark.parametrize("num_instances", [1, 16])
def test_an_idle_fleet_with_unlimited_caches_hits_the_ceiling(shared_trace, num_instances):
    """One prefill instance holds everything; sixteen hold it between them, and baton pulls it."""
    workload = Workload(shared_trace)
    sim = Simulation(workload, unlimited(num_instances, num_instances), PROFILE, "baton", IDLE).run()
    result = summarize(sim)
    assert result.num_served == 3993
    assert round(result.hit_ratio, 3) == round(workload.ceiling_hit_ratio, 3) == 0.640
    assert result.hit_ratio == pytest.approx(workload.ceiling_hit_ratio, abs=1e-12)


def test_without_pulls_an_idle_fleet_hits_only_what_each_node_holds(shared_trace):
    """round_robin over two nodes cannot reach the ceiling: its misses are other nodes' hits."""
    workload = Workload(shared_trace[:800])
    sim = Simulation(workload, unlimited(16, 2), PROFILE, "round_robin", IDLE).run()
    assert summarize(sim).hit_ratio < workload.ceiling_hit_ratio - 0.05


def test_a_one_instance_fleet_gives_every_policy_the_same_results(shared_trace):
    """1 prefill + 1 decode instance leave no placement to choose. Conditional disaggregation
    (baton's option to prefill on the decode instance) is turned off: it is a second place; so
    is in-flight coalescing (a hold before placement, not a placement)."""
    workload = Workload(shared_trace[:600])
    fleet = FleetConfig(num_prefill_instances=1, num_decode_instances=1, admission=True,
                        host_kv_bytes_per_node=64 * 2**30, policy_overrides={"short_prefill_tokens": 0},
                        coalesce_policies=())
    reference = None
    for policy in POLICIES:
        sim = Simulation(workload, fleet, PROFILE, policy, rate_scale=4.0).run()
        records = (sim.ttft_ms, sim.max_gap_ms, sim.num_cached_blocks, sim.rejected, sim.prefill_ms)
        if reference is None:
            reference = records
            assert sim.rejected.sum() > 0 and np.nanmax(sim.ttft_ms) > 1000  # a loaded fleet
            continue
        for got, want in zip(records, reference):
            np.testing.assert_array_equal(got, want, err_msg=policy)


def test_leading_runs_agree_with_walking_every_instance_after_a_replay(shared_trace):
    workload = Workload(shared_trace[:1500])
    fleet = FleetConfig(num_prefill_instances=8, num_decode_instances=8, instances_per_node=4,
                        host_kv_bytes_per_node=32 * 2**30, disk_kv_bytes_per_node=64 * 2**30)
    sim = Simulation(workload, fleet, PROFILE, "baton", rate_scale=2.0).run()
    sim.check_invariants()
    for keys in workload.keys[::7]:
        runs = sim.index.leading_runs(keys)
        for inst in sim.instances:
            assert tuple(runs.get(inst.idx, (0, 0, 0))) == sim.index.leading_run(inst.idx, keys)


def test_a_thousand_instances_run(shared_trace):
    workload = Workload(shared_trace[:400])
    fleet = FleetConfig(num_prefill_instances=512, num_decode_instances=512)
    sim = Simulation(workload, fleet, PROFILE, "baton", rate_scale=50.0).run()
    result = summarize(sim)
    assert len(sim.instances) == 1024 and math.isclose(result.hit_ratio, result.hit_ratio)
    assert result.num_served + result.num_rejected == 400
