"""What makes the policy race honest: blocks exist only once computed, coalescing is an explicit
wait, actual times stray from the prediction by a seeded error, rejected requests are charged
the SLO bound, and the oracle bounds every policy. Times are worked out by hand from the round
profile of test_simulator_events (prefill 10 ms + 0.01 ms/token, 5 ms decode step, 1 GB/s links,
1,000 KV bytes per token)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conductor.policy import POLICIES
from simulator.cache import BlockIndex, DeviceCache
from simulator.fleet import FleetConfig
from simulator.metrics import summarize
from simulator.oracle import oracle_bound
from simulator.prediction_error import error_factors, sigma_for_mean_abs_error
from simulator.profile import load_profile
from simulator.sim import Simulation, Workload
from simulator.trace import load_trace
from tests.unit.test_simulator_events import PROFILE, fleet, workload

TRACE = Path(__file__).parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


def test_a_prefills_blocks_are_invisible_until_it_ends():
    """A prefills [1, 2] on p0 from 0 to 20 ms. B, the same prompt at 5 ms, goes to p1
    (round robin) and finds nothing: A's blocks do not exist yet. C at 25 ms, on p0 again,
    finds both."""
    w = workload((0.0, 1000, 1, [1, 2]), (5.0, 1000, 1, [1, 2]), (25.0, 1000, 1, [1, 2]))
    sim = Simulation(w, fleet(num_prefill_instances=2), PROFILE, "round_robin").run()
    assert sim.num_cached_blocks.tolist() == [0, 0, 2]
    assert sim.prefill_ms.tolist() == pytest.approx([20.0, 20.0, 10.0])
    sim.check_invariants()


def test_a_pulling_policy_cannot_pull_what_is_still_being_computed():
    """mooncake would pull A's prefix to the idle instance if it existed; at 5 ms it does not."""
    w = workload((0.0, 2048, 1, [1, 2, 3, 4]), (5.0, 2560, 1, [1, 2, 3, 4, 5]))
    sim = Simulation(w, fleet(num_prefill_instances=2, coalesce_policies=()), PROFILE, "mooncake").run()
    assert sim.num_cached_blocks.tolist() == [0, 0] and sim.num_pulled_blocks.tolist() == [0, 0]


def test_pending_device_blocks_enter_the_index_on_publish():
    index = BlockIndex([0], [[0]])
    cache = DeviceCache(8, 0, index)
    cache.acquire(["a"], 0)
    cache.acquire(["a", "b", "c"], 1, visible=False)  # "a" was held; "b", "c" are being computed
    assert set(index.device) == {"a"} and "b" not in cache and cache.num_used_blocks == 4
    cache.check_invariants()
    cache.publish(["a", "b", "c"])
    assert set(index.device) == {"a", "b", "c"} and "c" in cache
    cache.release(["a", "b", "c"], 1)
    cache.check_invariants()


def coalescing_pair():
    # A: 4 blocks, 2,048 tokens; B at 5 ms: the same 4 blocks and a fifth
    return workload((0.0, 2048, 1, [1, 2, 3, 4]), (5.0, 2560, 1, [1, 2, 3, 4, 5]))


def test_coalescing_holds_a_request_until_the_prefill_of_its_prefix_ends():
    """One prefill instance. A prefills 0 -> 10 + 20.48 = 30.48 ms; B waits 25.48 ms for it
    (priced 25.48 + 15.12 = 40.6 ms against 25.48 + 35.6 = 61.08 ms behind A), then runs with
    the 4 blocks local: 10 + 512 x 0.01 = 15.12 ms."""
    f = fleet(num_prefill_instances=1, policy_overrides={"short_prefill_tokens": 0})
    sim = Simulation(coalescing_pair(), f, PROFILE, "baton").run()
    assert sim.coalesced.tolist() == [False, True]
    assert sim.coalesce_wait_ms.tolist() == pytest.approx([0.0, 25.48])
    assert sim.num_cached_blocks.tolist() == [0, 4]
    assert sim.prefill_ms.tolist() == pytest.approx([30.48, 15.12])
    assert summarize(sim).num_coalesced == 1
    # the switch: without coalescing B is queued behind A at once, and A's blocks are visible
    # when its prefill starts (one instance: the queue does what the wait did)
    off = Simulation(coalescing_pair(), f.model_copy(update={"coalesce_policies": ()}), PROFILE, "baton").run()
    assert off.coalesced.tolist() == [False, False] and off.coalesce_wait_ms.tolist() == [0.0, 0.0]
    assert off.num_cached_blocks.tolist() == [0, 4]


def test_an_idle_instance_priced_faster_than_waiting_takes_the_request_at_once():
    """Two prefill instances: waiting (40.6 ms) loses to the idle one (35.6 ms), as live."""
    f = fleet(num_prefill_instances=2, policy_overrides={"short_prefill_tokens": 0})
    sim = Simulation(coalescing_pair(), f, PROFILE, "baton").run()
    assert sim.coalesced.tolist() == [False, False] and sim.coalesce_wait_ms.tolist() == [0.0, 0.0]
    assert sim.num_cached_blocks.tolist() == [0, 0]
    assert sim.prefill_ms.tolist() == pytest.approx([30.48, 35.6])


def test_coalescing_gives_up_after_its_longest_wait():
    f = fleet(num_prefill_instances=1, coalesce_max_wait_ms=10.0, policy_overrides={"short_prefill_tokens": 0})
    sim = Simulation(coalescing_pair(), f, PROFILE, "baton").run()
    assert sim.coalesced.tolist() == [False, False] and sim.coalesce_wait_ms[1] == pytest.approx(10.0)
    # placed at 15 ms, while A still computes, behind A: its blocks are there when B starts
    assert sim.num_cached_blocks.tolist() == [0, 4]


@pytest.mark.parametrize("mean_abs_error", [0.058, 0.1, 0.276, 0.3])
def test_the_error_factors_have_the_stated_mean_error_median_one_and_a_seed(mean_abs_error):
    prefill, transfer = error_factors(200_000, mean_abs_error, seed=3)
    assert np.mean(np.abs(prefill - 1)) == pytest.approx(mean_abs_error, rel=0.01)
    assert np.median(transfer) == pytest.approx(1.0, abs=0.01)
    assert abs(np.corrcoef(prefill, transfer)[0, 1]) < 0.01
    again, _ = error_factors(200_000, mean_abs_error, seed=3)
    other, _ = error_factors(200_000, mean_abs_error, seed=4)
    assert np.array_equal(prefill, again) and not np.array_equal(prefill, other)


def test_no_error_means_exact_times():
    assert sigma_for_mean_abs_error(0.0) == 0.0
    prefill, transfer = error_factors(5, 0.0, seed=1)
    assert prefill.tolist() == transfer.tolist() == [1.0] * 5


def test_actual_prefill_times_are_the_priced_ones_times_the_requests_factor():
    w = workload((0.0, 1000, 1, [1, 2]), (100.0, 1000, 1, [1, 3]))
    sim = Simulation(w, fleet(prediction_error=0.3, error_seed=7), PROFILE, "round_robin").run()
    factors, _ = error_factors(2, 0.3, seed=7)
    assert sim.prefill_ms.tolist() == pytest.approx([20.0 * factors[0], 14.88 * factors[1]])
    assert sim.ttft_ms[0] == pytest.approx(20.0 * factors[0] + 2.0 + 5.0)  # + hand-off + one step


def test_rejected_requests_count_at_the_slo_bound_in_ttft():
    w = workload((0.0, 1000, 1, [1, 2]), (0.0, 5000, 1, list(range(10, 20))))
    sim = Simulation(w, fleet(admission=True, ttft_slo_ms=40.0), PROFILE, "least_loaded").run()
    result = summarize(sim)
    assert sim.rejected.tolist() == [False, True]
    assert result.ttft_ms.mean == pytest.approx((27.0 + 40.0) / 2) and result.ttft_ms.p99 == pytest.approx(
        np.percentile([27.0, 40.0], 99))


def test_the_oracle_of_a_small_trace_by_hand():
    """A: nothing cached, 20 ms + a 5 ms step; B: block 1 was A's, 14.88 + 5; C's 3,000 tokens
    (40.0 ms) are capped at the 30 ms SLO."""
    w = workload((0.0, 1000, 1, [1, 2]), (10.0, 1000, 1, [1, 3]), (20.0, 3000, 1, [7, 8, 9, 10, 11, 12]))
    oracle = oracle_bound(w, fleet(ttft_slo_ms=30.0), PROFILE)
    assert oracle.ttft_ms.mean == pytest.approx((25.0 + 19.88 + 30.0) / 3)
    assert oracle.slo_attainment_ttft == pytest.approx(2 / 3)
    assert oracle.goodput_rate_scale == 0.0  # only 2 of 3 can meet the SLO, fewer than 90%


@pytest.mark.parametrize("error", [0.0, 0.3])
def test_the_oracle_bounds_every_policys_ttft(error):
    shared = load_trace(TRACE)[:600]
    w = Workload(shared)
    f = FleetConfig(num_prefill_instances=4, num_decode_instances=4, prediction_error=error,
                    host_kv_bytes_per_node=64 * 2**30)
    profile = load_profile("analytic")
    oracle = oracle_bound(w, f, profile)
    for policy in POLICIES:
        result = summarize(Simulation(w, f, profile, policy, rate_scale=2.0).run())
        for q in ("mean", "p50", "p90", "p99"):
            assert getattr(oracle.ttft_ms, q) <= getattr(result.ttft_ms, q), (policy, q)
        assert result.goodput_rate_scale is None and math.isfinite(oracle.goodput_rate_scale)


def test_warming_a_rejected_prompt_prefills_it_in_chunks_for_the_next_request():
    """EXPERIMENTAL switch. A (10 blocks, 60 ms priced) is rejected at a 40 ms SLO; warmed, it
    computes 8 blocks (10 + 40.96 ms) then the last 2 over them (10 + 9.04 ms), so B, its
    follow-up, finds all 10 and prefills 80 tokens (10.8 ms): admitted."""
    w = workload((0.0, 5000, 1, list(range(10, 20))), (1000.0, 5200, 1, [*range(10, 20), 99]))
    f = fleet(admission=True, ttft_slo_ms=40.0)
    plain = Simulation(w, f, PROFILE, "least_loaded").run()
    assert plain.rejected.tolist() == [True, True]
    warm = Simulation(w, f.model_copy(update={"warm_rejected_policies": ("least_loaded",)}), PROFILE,
                      "least_loaded").run()
    assert warm.rejected.tolist() == [True, False] and warm.num_cached_blocks[1] == 10
    assert warm.prefill_ms.tolist() == pytest.approx([50.96 + 19.04, 10.8])
    assert summarize(warm).prefill_compute_s == pytest.approx((70.0 + 10.8) / 1000)
    assert warm.num_computed_tokens.tolist() == [4096 + 904, 80]


def test_sglang_reaches_at_least_half_of_least_loadeds_goodput():
    """The faithful router's sanity floor (the old stand-in scored 0.05x least_loaded's)."""
    from simulator.replay import run_policy

    w = Workload(load_trace(TRACE)[:600])
    f = FleetConfig(num_prefill_instances=4, num_decode_instances=4)
    profile = load_profile("analytic")
    goodput = {p: run_policy(w, f, profile, "analytic", p, 1.0, True).result.goodput_rate_scale
               for p in ("least_loaded", "sglang_cache_aware")}
    assert goodput["sglang_cache_aware"] >= 0.5 * goodput["least_loaded"] > 0, goodput


@pytest.mark.parametrize("max_busy_frac, warmed", [(0.0, False), (0.5, True)])
def test_warming_waits_for_room_in_the_prefill_pool(max_busy_frac, warmed):
    """A keeps p0 busy from 0 to 30 ms; R, rejected at 1 ms, is warmed on p1 only if one busy
    instance of two is room enough; B, R's follow-up, is admitted only if R was warmed."""
    w = workload((0.0, 2000, 1, [1, 2, 3, 4]), (1.0, 5000, 1, list(range(10, 20))),
                 (1000.0, 5200, 1, [*range(10, 20), 99]))
    f = fleet(num_prefill_instances=2, admission=True, ttft_slo_ms=40.0,
              warm_rejected_policies=("least_loaded",), warm_max_busy_frac=max_busy_frac)
    sim = Simulation(w, f, PROFILE, "least_loaded").run()
    assert sim.rejected.tolist() == [False, True, not warmed]
    assert sim.num_computed_tokens[1] == (5000 if warmed else 0)
    if warmed:
        assert sim.num_cached_blocks[2] == 10
