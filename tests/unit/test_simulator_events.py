"""The simulator's event loop on hand-checkable fleets: every time below is worked out by hand
from a profile with round numbers (prefill 10 ms + 0.01 ms/token, a 5 ms decode step, 1 GB/s
links with 1 ms setup across nodes, 1,000 KV bytes per token)."""

from __future__ import annotations

import pytest

from conductor.cost_model import CostProfile, DecodeCostModel, LinkCost, PrefillCostModel, TransferModel
from simulator.fleet import FleetConfig
from simulator.metrics import summarize, weighted_percentile
from simulator.sim import Simulation, SimulationError, Workload
from simulator.trace import TraceRequest

PROFILE = CostProfile(
    model="test", device="test", block_size_tokens=512, kv_bytes_per_token=1000,
    prefill=PrefillCostModel(intercept_ms=10.0, per_token_ms=0.01, per_token_sq_ms=0.0, per_token_cached_ms=0.0),
    decode=DecodeCostModel(step_ms_base=5.0, step_ms_per_seq=0.0, step_ms_per_kv_token=0.0),
    transfer=TransferModel(same_node=LinkCost(bytes_per_s=1e9, setup_ms=0.0),
                           remote_host=LinkCost(bytes_per_s=1e9, setup_ms=1.0),
                           remote_disk=LinkCost(bytes_per_s=1e9, setup_ms=2.0)),
)


def fleet(**overrides) -> FleetConfig:
    fields = dict(num_prefill_instances=1, num_decode_instances=1, device_kv_bytes=None,
                  host_kv_bytes_per_node=None, disk_kv_bytes_per_node=None, admission=False)
    fields.update(overrides)
    return FleetConfig(**fields)


def workload(*requests: tuple[float, int, int, list[int]]) -> Workload:
    return Workload([TraceRequest(t, n_in, n_out, tuple(ids)) for t, n_in, n_out, ids in requests])


def test_disaggregated_requests_follow_prefill_handoff_and_batch_steps():
    w = workload((0.0, 1000, 3, [1, 2]), (30.0, 1000, 2, [1, 3]))
    sim = Simulation(w, fleet(), PROFILE, "round_robin").run()
    # A: prefill 10 + 1000 x 0.01 = 20 ms; hand-off 1 + 1e6 B / 1 GB/s = 2 ms; joins at 22,
    # tokens at 27, 32, 37.
    # B: block 1 cached on the prefill instance: 10 + 488 x 0.01 = 14.88 ms, 30 -> 44.88; the
    # decode instance holds block 1 too, so 488 tokens move: 1 + 0.488 ms -> 46.368; tokens at
    # 51.368 and 56.368.
    assert sim.ttft_ms.tolist() == pytest.approx([27.0, 21.368])
    assert sim.max_gap_ms.tolist() == pytest.approx([5.0, 5.0])
    assert sim.num_cached_blocks.tolist() == [0, 1]
    assert sim.num_computed_tokens.tolist() == [1000, 488]
    assert sim.prefill_ms.tolist() == pytest.approx([20.0, 14.88])
    result = summarize(sim)
    assert result.hit_ratio == 0.25 and result.hit_ceiling_fraction == 1.0
    assert result.tbt_p99_ms == 5.0
    assert result.slo_attainment.both == 1.0
    assert result.prefill_tokens_computed == 1488
    sim.check_invariants()


def test_a_colocated_prefill_runs_as_mixed_steps_with_the_running_batch():
    """Every request prefills on its decode instance (short_prefill_tokens above any prompt);
    a prefill on a decoding instance is chunked as pricing assumes: each chunk one mixed step."""
    w = workload((0.0, 1000, 4, [1, 2]), (27.0, 1000, 2, [1, 3]))
    f = fleet(policy_overrides={"short_prefill_tokens": 10_000})
    sim = Simulation(w, f, PROFILE, "baton").run()
    assert sim.colocated.tolist() == [True, True]
    # A: prefill on the decode instance 0 -> 20, tokens at 25, 30, ...; B arrives at 27, so the
    # next step boundary is 30; B's prefill (block 1 cached: 14.88 ms, one chunk) is one mixed
    # step with A's batch, 30 -> 49.88 (14.88 + A's 5 ms step; A's token at 49.88); then both
    # step together: tokens at 54.88 and, B's second, 59.88.
    assert sim.ttft_ms.tolist() == pytest.approx([25.0, 54.88 - 27.0])
    assert sim.max_gap_ms.tolist() == pytest.approx([19.88, 5.0])
    samples = sorted(zip(sim.tbt_values, sim.tbt_weights))
    assert [value for value, _ in samples] == pytest.approx([5.0, 5.0, 5.0, 19.88])
    assert [weight for _, weight in samples] == [1, 1, 1, 1]  # A: 25->30, 49.88->54.88; B; A's mixed step
    assert sim.transfer_ms.tolist() == [0.0, 0.0]


def test_a_multi_chunk_colocated_prefill_steps_the_batch_once_per_chunk():
    """Chunks of 256 tokens: B computes 512 uncached tokens (block 1 cached) in 2 mixed steps
    of 14.88 / 2 + 5 = 12.44 ms each, and A gains a token at each."""
    w = workload((0.0, 1000, 6, [1, 2]), (27.0, 1000, 2, [1, 3]))
    f = fleet(policy_overrides={"short_prefill_tokens": 10_000, "baton_prefill_chunk_tokens": 256})
    sim = Simulation(w, f, PROFILE, "baton").run()
    assert sim.colocated.tolist() == [True, True]
    # A: tokens at 25, 30; B's prefill 30 -> 54.88 in two mixed steps (A's tokens at 42.44 and
    # 54.88); then both at 59.88.
    assert sim.ttft_ms.tolist() == pytest.approx([25.0, 59.88 - 27.0])
    assert sim.max_gap_ms.tolist() == pytest.approx([12.44, 5.0])


def test_decode_admission_waits_for_memory():
    """Device KV of 4 blocks: A holds 3 (2 prompt blocks + 1 for 100 output tokens), so B (3 too)
    waits for A to finish."""
    block_bytes = 512 * 1000
    w = workload((0.0, 1000, 100, [1, 2]), (0.0, 1000, 100, [3, 4]))
    f = fleet(num_prefill_instances=2, device_kv_bytes=4 * block_bytes)
    sim = Simulation(w, f, PROFILE, "round_robin").run()
    # Both prefill in parallel (20 ms) and arrive at 22; A joins, B waits until A's 100th token at
    # 22 + 500 = 522, then takes 5 ms to its first token.
    assert sim.ttft_ms.tolist() == pytest.approx([27.0, 527.0])
    assert sim.num_private_blocks == [1, 1]


def test_a_request_larger_than_any_device_is_unservable():
    block_bytes = 512 * 1000
    w = workload((0.0, 3000, 1, [1, 2, 3, 4, 5, 6]))
    sim = Simulation(w, fleet(device_kv_bytes=4 * block_bytes), PROFILE, "round_robin").run()
    result = summarize(sim)
    assert (result.num_unservable, result.num_served, result.slo_attainment.both) == (1, 0, 0.0)


def test_admission_rejects_what_would_miss_the_ttft_slo():
    w = workload((0.0, 1000, 1, [1, 2]), (0.0, 5000, 1, list(range(10, 20))))
    sim = Simulation(w, fleet(admission=True, ttft_slo_ms=40.0), PROFILE, "least_loaded").run()
    # the second prompt prices at 10 + 50 = 60 ms > 40 ms
    assert sim.rejected.tolist() == [False, True]
    assert summarize(sim).slo_attainment.both == 0.5


def test_the_wrong_policy_name_is_an_error():
    with pytest.raises(SimulationError, match="unknown policy"):
        Simulation(workload((0.0, 10, 1, [1])), fleet(), PROFILE, "nope")


def test_weighted_percentile():
    assert weighted_percentile([5.0, 19.0, 1.0], [98, 1, 1], 99) == 5.0
    assert weighted_percentile([5.0, 19.0, 1.0], [97, 2, 1], 99) == 19.0
    assert weighted_percentile([], [], 99) == 0.0
