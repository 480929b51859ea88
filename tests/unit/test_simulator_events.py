"""The simulator's event loop on hand-checkable fleets: every time below is worked out by hand
from a profile with round numbers (prefill 10 ms + 0.01 ms/token, a 5 ms decode step, 1 GB/s
links with 1 ms setup across nodes, 1,000 KV bytes per token)."""

from __future__ import annotations

import math

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


def handoff_during_a_colocated_prefill(chunk_tokens: int) -> Simulation:
    """A (1,000 tokens, 6 out) and C (600, 1 out) prefill on the prefill instance; B (block 1
    cached on the decode instance: 488 new tokens, under the 500-token cut) on the decode
    instance, in 2 chunks of ``chunk_tokens``. A: 0 -> 20, hand-off 2 ms, joins at 22, tokens
    at 27, ... B arrives at 27, its prefill starts at that boundary: 14.88 ms in 2 mixed steps
    of 7.44 + 5 = 12.44 ms, 27 -> 39.44 -> 51.88. C arrives at 5, prefills after A, 20 -> 36,
    hand-off 1 + 0.6 ms: its KV is at the decode instance at 37.6, during B's first chunk."""
    w = workload((0.0, 1000, 6, [1, 2]), (5.0, 600, 1, [4, 5]), (27.0, 1000, 2, [1, 3]))
    f = fleet(policy_overrides={"short_prefill_tokens": 500, "baton_prefill_chunk_tokens": chunk_tokens})
    sim = Simulation(w, f, PROFILE, "baton").run()
    assert sim.colocated.tolist() == [False, False, True]
    return sim


def test_a_handed_off_sequence_joins_at_a_colocated_prefills_last_chunk_when_it_leaves_budget():
    """Chunks of 256: B's last chunk is 232 tokens, leaving 24 of the step's budget, so C joins
    at its start (39.44; vLLM schedules a waiting request while budget remains) and gets its
    first token at its end, 51.88; B's first token one step after its prefill, 56.88."""
    sim = handoff_during_a_colocated_prefill(256)
    assert sim.ttft_ms.tolist() == pytest.approx([27.0, 51.88 - 5.0, 56.88 - 27.0])
    assert sim.max_gap_ms[0] == pytest.approx(12.44)
    sim.check_invariants()


def test_a_handed_off_sequence_waits_out_a_colocated_prefills_full_chunks():
    """Chunks of 244: both of B's chunks are full, so the budget leaves C no room in either
    (vLLM's scheduler: the chunk takes what the running decodes leave); C joins when B's
    prefill ends, 51.88, with B, and their first tokens come one step later, 56.88."""
    sim = handoff_during_a_colocated_prefill(244)
    assert sim.ttft_ms.tolist() == pytest.approx([27.0, 56.88 - 5.0, 56.88 - 27.0])
    sim.check_invariants()


SLOW_HOST_PROFILE = PROFILE.model_copy(update={"transfer": PROFILE.transfer.model_copy(
    update={"same_node": LinkCost(bytes_per_s=1e8, setup_ms=0.0)})})
"""PROFILE with a 100 MB/s host tier: a 512-token block (512,000 bytes) loads in 5.12 ms."""


def host_tier_colocation(prediction_error: float = 0.0) -> Simulation:
    """One decode instance of 5 device blocks, every prompt prefilled on it in 256-token chunks.
    X ([1, 2]) at 0 leaves its blocks on device and in the node's host tier; Z at 30 evicts
    them from the device; A at 75 decodes 20 tokens; B ([1, 2, 9]) at 92 finds [1, 2] in the
    host tier only."""
    w = workload((0.0, 1000, 1, [1, 2]), (30.0, 2500, 1, [3, 4, 5, 6, 7]), (75.0, 500, 20, [8]),
                 (92.0, 1500, 2, [1, 2, 9]))
    f = fleet(device_kv_bytes=5 * 512 * 1000, prediction_error=prediction_error,
              policy_overrides={"short_prefill_tokens": 10_000, "baton_prefill_chunk_tokens": 256})
    return Simulation(w, f, SLOW_HOST_PROFILE, "baton").run()


def test_a_colocated_prefill_loads_its_host_tier_prefix_while_the_batch_decodes():
    """The prefix load does not stall the running batch (live, the connector loads it
    asynchronously); only the compute runs as mixed steps, from the first step boundary after
    the load lands."""
    sim = host_tier_colocation()
    assert sim.colocated.tolist() == [True] * 4
    # X: 0 -> 20 (4 chunks, no batch), token at 25. Z: 30 -> 65, token at 70; it evicts [1, 2].
    # A: 75 -> 90 (10 + 5 ms), tokens every 5 ms from 95. B arrives at 92; its prefill begins at
    # A's next step boundary, 95: the load of 2 host blocks, 1,024,000 B / 100 MB/s = 10.24 ms,
    # lands at 105.24 while A steps on at 5 ms (tokens at 100, 105, 110); from the boundary at
    # 110 B computes 1500 - 1024 = 476 tokens (10 + 4.76 = 14.76 ms) in 2 chunks of 7.38 ms,
    # each a mixed step of 7.38 + 5 = 12.38 ms (A's tokens at 122.38 and 134.76); B joins at
    # 134.76, its tokens at 139.76 and 144.76; A's last 12 follow, to 204.76.
    assert sim.ttft_ms.tolist() == pytest.approx([25.0, 40.0, 20.0, 139.76 - 92.0])
    assert sim.transfer_ms.tolist() == pytest.approx([0.0, 0.0, 0.0, 10.24])
    assert sim.prefill_ms.tolist() == pytest.approx([20.0, 35.0, 15.0, 14.76])
    assert sim.queue_wait_ms.tolist() == pytest.approx([0.0, 0.0, 0.0, 3.0])
    assert sim.max_gap_ms.tolist() == pytest.approx([0.0, 0.0, 12.38, 5.0])
    # A's 19 gaps: 3 plain during the load, 2 mixed, 14 plain after; B's one gap
    gaps: dict[float, int] = {}
    for value, weight in zip(sim.tbt_values, sim.tbt_weights):
        gaps[round(value, 9)] = gaps.get(round(value, 9), 0) + weight
    assert gaps == {5.0: 3 + 14 + 1, 12.38: 2}
    sim.check_invariants()


def test_a_colocated_prefills_load_and_chunks_take_their_own_drawn_errors():
    """With prediction error the load lasts its priced time times the request's transfer factor
    and the chunks share its prefill time times the prefill factor (the draws as before)."""
    sim = host_tier_colocation(prediction_error=0.3)
    transfer_factor, prefill_factor = sim.transfer_factor[3], sim.prefill_factor[3]
    assert sim.transfer_ms[3] == pytest.approx(10.24 * transfer_factor)
    assert sim.prefill_ms[3] == pytest.approx(14.76 * prefill_factor)
    # A's prefill runs alone from 75 and A joins at 75 + 15 ms x its factor; B's prefill begins
    # then if B arrived before (this seed: 93.89), else at A's first step boundary after 92;
    # its load lands, and its chunks start at A's next step boundary after that
    assert sim.queue_wait_ms[2] == 0.0
    a_join_ms = 75.0 + sim.prefill_ms[2]
    begin_ms = a_join_ms + 5.0 * max(0, math.ceil((92.0 - a_join_ms) / 5.0))
    chunks_ms = a_join_ms + 5.0 * math.ceil((begin_ms + sim.transfer_ms[3] - a_join_ms) / 5.0)
    mixed_ms = sim.prefill_ms[3] / 2 + 5.0
    assert sim.ttft_ms[3] == pytest.approx(chunks_ms + 2 * mixed_ms + 5.0 - 92.0)
    assert sim.max_gap_ms[2] == pytest.approx(mixed_ms)


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
