"""ConductorState: the queue book, coalescing targets, index feedback, admission, profiles."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.cost_model import CostProfile, DecodeCostModel, PrefillCostModel, TransferModel
from conductor.policy import LoadArrays, Overloaded, PolicyConfig, PoolArrays, PrefixHit
from conductor.state import CoalesceWait, ConductorState
from kvstore.events import MEDIUM_HOST, BlockStored
from kvstore.keys import KeyExtras, block_keys
from protos.errors import NoWorkerReady
from protos.wire import PlacementRequest

BS = 16
COST = PrefillCostModel(intercept_ms=0.0, per_token_ms=1.0, per_token_sq_ms=0.0, per_token_cached_ms=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(policy="baton", **tuning) -> tuple[ConductorState, Clock]:
    clock = Clock()
    config = PolicyConfig(block_size_tokens=BS, prefill_cost=COST, short_prefill_tokens=0, **tuning)
    state = ConductorState(policy, config, clock=clock)
    for instance_id, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)
    return state, clock


def request(request_id: str, tokens: list[int], max_tokens: int = 8) -> PlacementRequest:
    keys = tuple(block_keys(tokens, BS, KeyExtras("m", "", "", "L")))
    return PlacementRequest(request_id, len(tokens), keys, max_tokens)


PROMPT = list(range(1000, 1000 + 8 * BS))  # 8 blocks


def decode_pool_only() -> ConductorState:
    """Two ready decode instances and no prefill pool (co-located serving)."""
    state = ConductorState("baton", PolicyConfig(block_size_tokens=BS, prefill_cost=COST,
                                                 short_prefill_tokens=0))
    for instance_id in ("d0", "d1"):
        state.register(instance_id, "decode", "n0", "m", "L")
        state.set_ready(instance_id, True)
    return state


def test_the_queue_book_prices_booked_work_and_decays_with_time():
    state, clock = make()
    first = state.place(request("a", PROMPT))
    assert (first.prefill_instance, first.queue_ms, first.prefill_ms) == ("p0", 0.0, 128.0)
    # p0 now has 128 ms of predicted work queued, so an unrelated request goes to p1
    second = state.place(request("b", list(range(5000, 5000 + 8 * BS))))
    assert (second.prefill_instance, second.queue_ms) == ("p1", 0.0)
    clock.now += 0.1  # p0 has worked 100 ms on it: 28 ms left
    view = state.snapshot().prefill[0]
    assert view.queued_prefill_ms == pytest.approx(28.0)
    assert view.num_queued_prefill_tokens == 128
    clock.now += 0.1  # 200 ms in: past its prediction, a tenth of it is left until it is done
    view = state.snapshot().prefill[0]
    assert view.queued_prefill_ms == pytest.approx(12.8)
    assert state.place(request("c", list(range(9000, 9000 + 8 * BS)))).queue_ms == pytest.approx(12.8)  # not 128
    state.finished("c")
    state.prefill_done("a", 0)
    assert state.snapshot().prefill[0].queued_prefill_ms == 0.0
    assert state.num_in_flight() == (1, 2)
    state.finished("a")
    state.finished("b")
    assert state.num_in_flight() == (0, 0)
    assert state.snapshot().decode[0].num_active_decode_blocks == 0


def test_a_completed_prefill_is_indexed_on_its_instance_and_followed():
    state, _ = make()
    state.place(request("a", PROMPT))
    state.prefill_done("a", 0)
    state.finished("a")
    again = state.place(request("b", PROMPT + list(range(7, 7 + BS))))
    assert again.prefill_instance == "p0"
    assert again.expected_cached_blocks == 8
    assert again.prefill_ms == pytest.approx(16.0)  # only the new block is computed
    assert again.priority == -8  # longest matched prefix first in p0's queue


def test_a_stale_index_entry_is_dropped_when_the_engine_found_less():
    state, _ = make()
    keys = request("x", PROMPT).block_keys
    state.index.note_device_blocks("p1", keys)
    placed = state.place(request("a", PROMPT))
    assert (placed.prefill_instance, placed.expected_cached_blocks) == ("p1", 8)
    state.prefill_done("a", 2 * BS)  # the engine had only 2 blocks
    assert state.counters.index_corrections == 1
    # what the engine computed is now held: the whole prompt, once more
    assert state.index.prefix_hits(keys)["p1"] == PrefixHit(8, 0, 0)


def test_coalescing_targets_the_prefill_computing_the_same_blocks():
    state, _ = make()
    state.place(request("a", PROMPT))
    follower = request("b", PROMPT + list(range(3, 3 + BS)))
    assert state.coalesce_wait(follower, min_blocks=4).owner == "a"
    assert state.coalesce_wait(follower, min_blocks=9) is None  # only 8 blocks are shared
    assert state.coalesce_wait(request("c", list(range(9000, 9000 + 8 * BS))), 1) is None
    state.prefill_done("a", 0)
    assert state.coalesce_wait(follower, min_blocks=1) is None  # its blocks are indexed now


def test_waiting_to_coalesce_is_priced_against_placing_now():
    state, clock = make()
    state.place(request("a", PROMPT))  # p0: 128 ms
    state.place(request("z", list(range(5000, 5000 + 16 * BS))))  # p1: 256 ms
    follower = request("b", PROMPT + list(range(3, 3 + BS)))
    wait = state.coalesce_wait(follower, min_blocks=4)
    # now: behind a on p0 (128 + 144) beats behind z on p1 (256 + 144); waiting: a's 128 ms,
    # then only the new block (16 ms)
    assert wait == CoalesceWait("a", "p0", 128.0, 0.0, 16.0, 272.0, "p0", follower.block_keys[:8], 8)
    assert wait.wins and wait.total_ms == 144.0
    clock.now += 0.05  # p0 has worked 50 ms on a
    assert state.coalesce_wait(follower, min_blocks=4).wait_ms == pytest.approx(78.0)
    assert state.counters.placed == 2  # pricing books nothing


def test_an_idle_instance_beats_waiting_behind_a_long_queue():
    state, _ = make()
    state.place(request("big", list(range(20000, 21000))))  # p0: 1000 ms
    state.place(request("big2", list(range(30000, 31000))))  # p1: 1000 ms
    owner = state.place(request("a", PROMPT))
    assert owner.prefill_instance == "p0"
    state.prefill_done("big2", 0)  # p1 is idle now
    follower = request("b", PROMPT + list(range(3, 3 + BS)))
    wait = state.coalesce_wait(follower, min_blocks=4)
    assert wait == CoalesceWait("a", "p0", 1128.0, 0.0, 16.0, 144.0, "p1", follower.block_keys[:8], 8)
    assert not wait.wins


def saving_pool(saves: bool = True) -> tuple[ConductorState, Clock]:
    """Two co-located decode instances on one store node, their engines saving (or not) the
    prompts they compute."""
    clock = Clock()
    state = ConductorState("baton", PolicyConfig(block_size_tokens=BS, prefill_cost=COST), clock=clock)
    for instance_id in ("d0", "d1"):
        state.register(instance_id, "decode", "n0", "m", "L", saves_prompts=saves)
        state.set_ready(instance_id, True)
    return state, clock


def host_event(keys) -> list:
    """What a store node publishes once it holds ``keys`` in host memory."""
    return [BlockStored(block_hashes=list(keys), parent_block_hash=None, token_ids=[], block_size=BS,
                        lora_id=None, medium=MEDIUM_HOST, lora_name=None)]


def test_a_waiter_behind_another_waiter_waits_for_the_store_at_most_the_owners_queue():
    state, clock = saving_pool()
    owner = state.place(request("a", PROMPT))
    waiters = [request(name, PROMPT + list(range(i, i + BS))) for i, name in ((3, "b"), (7, "c"))]
    first, second = (state.coalesce_wait(w, min_blocks=4) for w in waiters)
    assert first.run_keys == waiters[0].block_keys[:8] and first.instance_id == owner.prefill_instance
    clock.now += 0.128
    state.prefill_done("a", 0)
    # the first waiter is placed at once: the owner's instance holds the blocks, no prompt queued
    # (its queue is the owner's decode batch stepping beside its chunk)
    assert state.pool_wait_ms(first) == 0.0
    placed = state.place(waiters[0])
    assert placed.prefill_instance == owner.prefill_instance
    assert placed.queue_ms == placed.decode_batch_ms > 0.0
    # the second would queue behind it there (16 ms): it may wait that long for the store
    assert state.pool_wait_ms(second) == 16.0
    assert not state.pool_holds(second)
    state.index.apply_store_events("n0", host_event(first.run_keys))
    assert state.pool_holds(second) and state.pool_wait_ms(second) == 0.0
    # ... and once the store holds them, the other instance loads them rather than queue
    moved = state.place(waiters[1])
    assert moved.prefill_instance != owner.prefill_instance
    assert moved.expected_cached_blocks == 8 and moved.queue_ms == 0.0


def test_no_wait_for_the_store_where_it_cannot_get_the_blocks():
    state, clock = saving_pool(saves=False)  # engines that only load (decode_saves: none)
    state.place(request("a", PROMPT))
    waiters = [request(name, PROMPT + list(range(i, i + BS))) for i, name in ((3, "b"), (7, "c"))]
    second = state.coalesce_wait(waiters[1], min_blocks=4)
    state.prefill_done("a", 0)
    state.place(waiters[0])
    assert state.pool_wait_ms(second) == 0.0
    state, clock = saving_pool()
    state.set_ready("d1", False)  # no other instance to load them on
    state.place(request("a", PROMPT))
    second = state.coalesce_wait(waiters[1], min_blocks=4)
    state.prefill_done("a", 0)
    state.place(waiters[0])
    assert state.pool_wait_ms(second) == 0.0


def test_requests_waiting_on_one_prefill_queue_behind_each_other():
    state, _ = make()
    state.place(request("a", PROMPT))
    first = state.coalesce_wait(request("b", PROMPT + list(range(3, 3 + BS))), min_blocks=4)
    state.hold(first)
    second = state.coalesce_wait(request("c", PROMPT + list(range(7, 7 + 2 * BS))), min_blocks=4)
    assert (second.wait_ms, second.behind_ms, second.rest_ms) == (128.0, 16.0, 32.0)
    state.release(first)
    assert state.coalesce_wait(request("c", PROMPT + list(range(7, 7 + 2 * BS))), 4).behind_ms == 0.0


def test_a_request_that_placing_now_would_reject_waits():
    state, _ = make(ttft_slo_ms=150.0)
    state.place(request("a", PROMPT))  # 128 ms on p0
    # now: 160 ms on p1, over the SLO; after a: only the 2 new blocks (32 ms)
    wait = state.coalesce_wait(request("b", PROMPT + list(range(3, 3 + 2 * BS))), min_blocks=4)
    assert (wait.now_ms, wait.now_instance, wait.total_ms) == (float("inf"), "", 160.0)
    assert wait.wins
    assert state.counters.rejected == 0  # the priced alternative is not a rejection


def test_admission_rejects_before_booking_anything():
    state, _ = make(ttft_slo_ms=100.0)
    with pytest.raises(Overloaded) as info:
        state.place(request("a", PROMPT))  # 128 ms predicted
    assert info.value.retry_after_s == 1.0
    assert state.counters.rejected == 1 and state.counters.placed == 0
    assert state.num_in_flight() == (0, 0)


def test_tbt_admission_uses_the_decode_model_with_the_request_added():
    state, _ = make(tbt_slo_ms=10.0, decode_cost=DecodeCostModel(step_ms_base=4.0, step_ms_per_seq=2.0,
                                                                  step_ms_per_kv_token=0.0))
    state.place(request("a", PROMPT))  # 4 + 2*1 = 6 ms
    state.place(request("b", PROMPT))  # 4 + 2*2 = 8 ms
    state.place(request("c", PROMPT))  # 10 ms: at the SLO, admitted
    with pytest.raises(Overloaded, match="inter-token time 12.0 ms"):
        state.place(request("d", PROMPT))


def test_tbt_admission_widens_the_prediction_by_the_decode_models_error():
    state, _ = make(tbt_slo_ms=10.0, tbt_error_frac=0.25,
                    decode_cost=DecodeCostModel(step_ms_base=4.0, step_ms_per_seq=2.0,
                                                step_ms_per_kv_token=0.0))
    state.place(request("a", PROMPT))  # 6 ms, 7.5 with the margin
    state.place(request("b", PROMPT))  # 8 ms, 10.0: at the SLO, admitted
    with pytest.raises(Overloaded, match=r"inter-token time 10.0 ms \(\+25%, the decode model's "
                                         r"p90 error\)"):
        state.place(request("c", PROMPT))  # 10 ms, 12.5: rejected (admitted without a margin)


def test_every_policy_runs_on_the_live_state_and_reports_priced_terms():
    for name in ("random", "round_robin", "least_loaded", "sglang_cache_aware", "dynamo_kv", "mooncake"):
        state, _ = make(name)
        placed = state.place(request("a", PROMPT))
        assert placed.prefill_ms == pytest.approx(128.0), name


def test_an_instance_that_stops_answering_leaves_the_pool_and_its_entries_go():
    state, _ = make()
    state.index.note_device_blocks("p0", request("x", PROMPT).block_keys)
    state.set_ready("p0", False)
    assert state.index.prefix_hits(request("x", PROMPT).block_keys) == {}
    assert state.place(request("a", PROMPT)).prefill_instance == "p1"
    state.set_ready("p1", False)
    with pytest.raises(NoWorkerReady):
        state.place(request("b", PROMPT))


def test_a_profile_round_trips_through_json():
    profile = CostProfile(model="m", device="cpu", block_size_tokens=BS, kv_bytes_per_token=1024,
                          prefill=COST, decode=DecodeCostModel(), transfer=TransferModel(),
                          prefill_error_pct={"median": 3.0, "p90": 9.0})
    assert CostProfile.model_validate_json(profile.model_dump_json()) == profile


def test_decode_cost_model_fit_recovers_known_coefficients():
    truth = DecodeCostModel(step_ms_base=5.0, step_ms_per_seq=0.5, step_ms_per_kv_token=1e-3)
    samples = [(b, c, truth.t_step_ms(b, c)) for b, c in ((1, 300), (4, 1000), (8, 2600), (16, 4000))]
    fitted = DecodeCostModel.fit(samples)
    for b, c, t in samples:
        assert fitted.t_step_ms(b, c) == pytest.approx(t, rel=1e-6)


def test_work_done_before_the_last_completion_does_not_shrink_the_queue():
    state, clock = make("round_robin")
    assert state.place(request("a", PROMPT)).prefill_instance == "p0"            # 128 ms
    assert state.place(request("b", PROMPT)).prefill_instance == "p1"
    clock.now += 0.05
    assert state.place(request("c", list(range(7000, 7000 + 4 * BS)))).prefill_instance == "p0"  # 64 ms
    clock.now += 0.2
    state.prefill_done("a", 0)  # p0 worked on "a" until now, not on "c"
    assert state.snapshot().prefill[0].queued_prefill_ms == pytest.approx(64.0)
    clock.now += 0.016
    assert state.snapshot().prefill[0].queued_prefill_ms == pytest.approx(48.0)


@pytest.mark.parametrize("policy,prefill_ids,ready", [
    ("baton", (), True),               # no prefill pool: baton serves co-located
    ("round_robin", (), False),        # other policies need a prefill instance
    ("baton", ("p0",), False),         # a prefill pool that is not ready yet: wait for it
])
def test_readiness_without_a_ready_prefill_instance(policy, prefill_ids, ready):
    state = ConductorState(policy, PolicyConfig(block_size_tokens=BS, prefill_cost=COST))
    for instance_id in prefill_ids:
        state.register(instance_id, "prefill", "n0", "m", "L")
    for instance_id in ("d0", "d1"):
        state.register(instance_id, "decode", "n0", "m", "L")
    assert not state.is_ready()  # no decode instance ready yet
    for instance_id in ("d0", "d1"):
        state.set_ready(instance_id, True)
    assert state.is_ready() is ready


def test_a_cluster_without_prefill_instances_places_every_request_on_a_decode_instance():
    state = decode_pool_only()
    first = state.place(request("a", PROMPT))
    second = state.place(request("b", list(range(5000, 5000 + 8 * BS))))
    assert [(p.prefill_instance, p.decode_instance) for p in (first, second)] == [("d0", "d0"), ("d1", "d1")]
    assert state.counters.colocated == 2
    state.set_ready("d0", False)
    state.set_ready("d1", False)
    assert not state.is_ready()
    with pytest.raises(NoWorkerReady, match="no decode instance is ready"):
        state.place(request("c", PROMPT))


def test_a_colocated_request_counts_once_among_its_instances_running_requests():
    state = decode_pool_only()
    state.place(request("a", PROMPT))  # prefill and decode both booked on d0
    state.place(request("b", list(range(5000, 5000 + 8 * BS))))  # on d1
    state.place(request("c", list(range(9000, 9000 + 8 * BS))))  # back on d0
    running = {v.instance_id: v.num_running_reqs for v in state.snapshot().decode}
    assert running == {"d0": 2, "d1": 1}
    assert state.in_flight_on("d0") == (2, 2)
    state.prefill_done("a", 0)  # a decodes on; only c still prefills
    assert {v.instance_id: v.num_running_reqs for v in state.snapshot().decode} == {"d0": 2, "d1": 1}
    state.finished("a")
    assert {v.instance_id: v.num_running_reqs for v in state.snapshot().decode} == {"d0": 1, "d1": 1}


def test_measured_load_bandwidth_moves_the_priced_same_node_link():
    state, _ = make()
    assert state.config.transfer.same_node.bytes_per_s == 3e9
    state.observe_loads("d0", 1 << 19, 0.001)  # under 1 MiB: too little to judge
    assert state.config.transfer.same_node.bytes_per_s == 3e9
    state.observe_loads("d0", (1 << 19) + 10**9, 1.001)  # 1 GB more in 1 s
    assert state.config.transfer.same_node.bytes_per_s == pytest.approx(0.7 * 3e9 + 0.3 * 1e9)


def test_the_cluster_prices_with_the_model_facts_and_the_configured_profile(tmp_path):
    from cluster.config import load_config
    from cluster.local import policy_config_for
    from engine.models import PreparedModel
    from protos.errors import ConfigError

    model = PreparedModel(name="m", path=tmp_path, num_layers=30, num_kv_heads=3, head_dim=64,
                          max_model_len=8192, dtype_bytes=4)
    plain = policy_config_for(load_config(None, {"engine.dtype": "float32"}), model)
    assert (plain.block_size_tokens, plain.kv_bytes_per_token) == (32, 46_080)  # a CPU engine's default
    assert policy_config_for(load_config(None, {"engine.block_size_tokens": 64}), model).block_size_tokens == 64
    assert plain.prefill_cost == PrefillCostModel()  # no profile: the placeholders
    # the engines' prefill gate: one prompt at a time on a CPU, as configured otherwise
    assert plain.prompts_at_once == 1
    assert policy_config_for(load_config(None, {"engine.max_prefills_in_flight": 0}), model).prompts_at_once == 0

    profile = CostProfile(model="m", device="cpu", block_size_tokens=128, kv_bytes_per_token=46_080,
                          prefill=COST, decode=DecodeCostModel(step_ms_base=9.0), transfer=TransferModel())
    path = tmp_path / "profile.json"
    path.write_text(profile.model_dump_json())
    tuned = policy_config_for(load_config(None, {"conductor.profile_path": str(path),
                                                 "conductor.tuning.ttft_slo_ms": 800}), model)
    assert (tuned.prefill_cost, tuned.decode_cost.step_ms_base, tuned.ttft_slo_ms) == (COST, 9.0, 800)

    with pytest.raises(ConfigError, match="does not exist; run `baton profile"):
        policy_config_for(load_config(None, {"conductor.profile_path": str(tmp_path / "nope.json")}), model)
    path.write_text("{}")
    with pytest.raises(ConfigError, match="is not a Baton cost profile"):
        policy_config_for(load_config(None, {"conductor.profile_path": str(path)}), model)


def test_a_kept_snapshot_is_not_changed_by_later_decisions_or_membership():
    state, clock = make()
    kept = state.snapshot()
    queues = kept.prefill_arrays.queued_prefill_ms.copy()
    loads = kept.decode_arrays.load.copy()
    index = dict(kept.pool_index)
    state.place(request("a", PROMPT))  # books work on p0 and d0: the live arrays change
    state.register("p2", "prefill", "n0", "m", "L")
    state.snapshot()
    assert list(kept.prefill_arrays.queued_prefill_ms) == list(queues) == [0.0, 0.0]
    assert list(kept.decode_arrays.load) == list(loads) == [0]
    assert dict(kept.pool_index) == index == {"p0": (0, 0), "p1": (0, 1), "d0": (1, 0)}
    now = state.snapshot()
    assert now.prefill_arrays.queued_prefill_ms[0] == 128.0 and now.decode_arrays.load[0] == 1
    assert now.pool_index["p2"] == (0, 2)


def test_placing_a_session_step_records_its_placement_prefix_and_pause():
    state, clock = make()
    step = PlacementRequest("a", len(PROMPT), request("a", PROMPT).block_keys, 8,
                            session_id="s-x", session_ttl_s=30.0)
    placed = state.place(step)
    view = state.sessions.view("s-x")
    assert (view.num_steps, view.prefill_instance, view.decode_instance, view.num_prefix_blocks,
            view.ttl_s) == (1, placed.prefill_instance, placed.decode_instance, 8, 30.0)
    state.finished("a")
    clock.now += 4.0
    longer = PROMPT + list(range(9000, 9000 + 2 * BS))
    state.place(PlacementRequest("b", len(longer), request("b", longer).block_keys, 8,
                                 session_id="s-x"))
    assert state.sessions.view("s-x").num_steps == 2
    assert list(state.sessions._sessions["s-x"].gaps) == [4.0]
    state.finished("b")
    assert state.sessions.view("s-x").idle_s == 0.0  # just finished
    # a request without a session leaves the table alone
    state.place(request("c", PROMPT))
    state.finished("c")
    assert len(state.sessions) == 1 and state.sessions.counters.steps == 2


@pytest.mark.parametrize("segmented", [False, True])
def test_a_finished_prefill_makes_its_keys_device_blocks_unless_they_are_segmented(segmented):
    state, _ = make()
    keys = request("a", PROMPT).block_keys
    state.place(PlacementRequest("a", len(PROMPT), keys, 8, segmented_salt=segmented))
    state.prefill_done("a", 0)
    state.finished("a")
    again = state.place(PlacementRequest("b", len(PROMPT), keys, 8, segmented_salt=segmented))
    # the engine holds a segmented request's blocks under its whole-prompt-salted keys only
    # (vLLM salts from the first block): its KV events, not these keys, say what it has
    assert again.expected_cached_blocks == (0 if segmented else 8)


def test_placing_a_request_again_before_its_end_arrived_closes_the_earlier_books():
    """A stream moved to another decode instance is placed again under its own id; an async
    actor may run that placement before the router's ``finished`` for the failed one."""
    state = decode_pool_only()
    first = state.place(request("a", PROMPT))
    state.set_ready(first.decode_instance, False)  # its worker died mid-stream
    again = state.place(request("a", PROMPT))
    assert again.decode_instance != first.decode_instance
    assert state.in_flight_on(first.decode_instance) == (0, 0)
    assert state.in_flight_on(again.decode_instance) == (1, 1)
    assert state.num_in_flight() == (1, 1)
    state.finished("a")  # the late end of the first placement, then the stream's own end
    state.finished("a")
    assert state.num_in_flight() == (0, 0)
    assert state.in_flight_on(again.decode_instance) == (0, 0)


def _columns(arrays) -> dict:
    return {name: (sorted(value) if isinstance(value, set) else list(value))
            for name, value in msgspec.structs.asdict(arrays).items() if name in arrays._patched}


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["place", "prefill_done", "finished", "load", "unready", "ready"]),
                              st.integers(0, 5), st.floats(0, 1)), max_size=30))
def test_the_patched_arrays_are_the_arrays_of_the_views(ops):
    """Whatever the state's calls, its patched arrays are what ``PoolArrays.of`` /
    ``LoadArrays.of`` build from the views it hands out, column for column."""
    state, clock = make()
    instance_ids = ["p0", "p1", "d0"]
    for op, n, frac in ops:
        clock.now += frac
        request_id = f"r{n}"
        if op == "place":
            try:
                state.place(request(request_id, PROMPT[:BS * (1 + n)] + [n] * BS))
            except (NoWorkerReady, Overloaded):
                pass
        elif op == "prefill_done":
            state.prefill_done(request_id, n * BS)
        elif op == "finished":
            state.finished(request_id)
        elif op == "load":
            state.update_load(instance_ids[n % 3], n, frac)
        else:
            state.set_ready(instance_ids[n % 3], op == "ready")
        snapshot = state.snapshot()
        assert _columns(snapshot.prefill_arrays) == _columns(PoolArrays.of(snapshot.prefill))
        assert _columns(snapshot.decode_arrays) == _columns(LoadArrays.of(snapshot.decode))


def test_a_colocated_placement_names_the_runner_ups_price():
    state = ConductorState("baton", PolicyConfig(block_size_tokens=BS, prefill_cost=COST))  # priced
    for instance_id in ("d0", "d1"):
        state.register(instance_id, "decode", "n0", "m", "L")
        state.set_ready(instance_id, True)
    first = state.place(request("a", PROMPT))  # d0 takes it: 128 ms, d1 the same, ties to d0
    assert first.reason.endswith(
        "; runner-up d1: T=transfer 0.0 + queue 0.0 + prefill 128.0 = 128.0 ms (local prefix 0 blocks)")
    second = state.place(request("b", list(range(5000, 5000 + 8 * BS))))  # d0 has a's 128 ms queued
    assert second.prefill_instance == "d1"
    # d0's queue: a's 128 ms prefill booked, plus a's decode step for each chunk of b's prompt
    assert second.reason.endswith("; runner-up d0: T=transfer 0.0 + queue 150.0 (decode batch 22.0 of it) "
                                  "+ prefill 128.0 = 278.0 ms (local prefix 0 blocks)")


def test_the_conductor_prices_prefill_chunks_of_the_engines_step_budget(tmp_path):
    from cluster.config import load_config
    from cluster.local import policy_config_for
    from engine.models import PreparedModel

    model = PreparedModel(name="m", path=tmp_path, num_layers=30, num_kv_heads=3, head_dim=64,
                          max_model_len=8192, dtype_bytes=4)
    assert policy_config_for(load_config(None, {}), model).baton_prefill_chunk_tokens == 512  # CPU
    cuda = load_config(None, {"engine.device": "cuda"})
    assert policy_config_for(cuda, model).baton_prefill_chunk_tokens == 2048  # vLLM's
    chunked = load_config(None, {"engine.max_num_batched_tokens": 256})
    assert policy_config_for(chunked, model).baton_prefill_chunk_tokens == 256
    named = load_config(None, {"engine.max_num_batched_tokens": 256,
                               "conductor.tuning.baton_prefill_chunk_tokens": 1024})
    assert policy_config_for(named, model).baton_prefill_chunk_tokens == 1024


def test_a_colocated_placement_says_how_much_of_its_run_is_on_the_engines_device():
    from gateway.live_router import needs_store_lookup

    state = decode_pool_only()
    keys = request("x", PROMPT).block_keys
    state.index.note_device_blocks("d0", keys[:5])
    warm = state.place(request("warm", PROMPT))
    assert (warm.prefill_instance, warm.expected_cached_blocks, warm.device_blocks) == ("d0", 5, 5)
    assert not needs_store_lookup(warm)  # the store holds nothing past the device's 5 blocks
    state.finished("warm")
    state.index.apply_store_events("n0", host_event(keys[:7]))  # the node's store holds 7
    longer = state.place(request("longer", PROMPT))
    assert (longer.expected_cached_blocks, longer.device_blocks) == (7, 5)
    assert needs_store_lookup(longer)
    state.finished("longer")
    cold = state.place(request("cold", list(range(7000, 7000 + 8 * BS))))
    # nothing reusable known: the store is asked (it may hold what the index missed)
    assert (cold.expected_cached_blocks, cold.device_blocks) == (0, 0) and needs_store_lookup(cold)
    # a disaggregated placement does not say: its decode side loads what the prefill computed
    assert needs_store_lookup(msgspec.structs.replace(warm, device_blocks=-1))
