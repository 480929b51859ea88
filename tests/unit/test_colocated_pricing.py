"""Baton's priced colocation: every ready decode instance is a prefill candidate, priced like the
prefill pool plus the steps its running batch adds, against the disaggregated option plus its KV
hand-off. Exact choices and reasons for small fleets; the decode-pool scan held to the slow
reference (``tests.unit.policy_oracles.baton_priced_choice``); the older rule behind
``short_prefill_tokens``; a burst of warm agents through ``ConductorState``."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor import policy_config
from conductor.cost_model import DecodeCostModel, LinkCost, PrefillCostModel, TransferModel
from conductor.policy import ClusterSnapshot, InstanceView, PolicyConfig, PrefixHit, baton
from conductor.pricing import handoff_ms
from conductor.state import ConductorState
from kvstore.keys import KeyExtras, block_keys
from protos.errors import NoWorkerReady
from protos.wire import PlacementRequest
from tests.unit.policy_oracles import baton_priced_choice
from tests.unit.test_policy import scenarios, with_makers_fields

REPO = Path(__file__).resolve().parents[2]

# 16-token blocks of 1,000 bytes a token: 16,000 bytes a block, 0.5 ms a block same-node, 1 ms a
# block remote. Prefill costs 1 ms an uncached token; a decode step 10 ms + 1 ms a sequence.
UNIT_PREFILL = PrefillCostModel(intercept_ms=0, per_token_ms=1.0, per_token_sq_ms=0, per_token_cached_ms=0)
UNIT_DECODE = DecodeCostModel(step_ms_base=10.0, step_ms_per_seq=1.0, step_ms_per_kv_token=0.0)


def unit_config(**overrides) -> PolicyConfig:
    transfer = TransferModel(same_node=LinkCost(bytes_per_s=32e6, setup_ms=0),
                             remote_host=LinkCost(bytes_per_s=16e6, setup_ms=0),
                             remote_disk=LinkCost(bytes_per_s=8e6, setup_ms=0))
    return PolicyConfig(kv_bytes_per_token=1000, prefill_cost=UNIT_PREFILL, transfer=transfer,
                        decode_cost=UNIT_DECODE, **overrides)


COLD = PlacementRequest("cold", 640)  # 40 blocks, nothing cached anywhere


def one_p_one_d(prefill_queue_ms: float, decode: InstanceView = InstanceView("d0")) -> ClusterSnapshot:
    return ClusterSnapshot((InstanceView("p0", queued_prefill_ms=prefill_queue_ms),), (decode,))


# --- 1 prefill + 1 decode ------------------------------------------------------------------------


def test_a_cold_long_prompt_prefills_on_the_idle_decode_instance_when_the_prefill_queue_is_long():
    # disaggregated: 300 queue + 640 prefill + 40 blocks handed off remotely (40 ms) = 980;
    # co-located on d0: 640.
    placement = baton(one_p_one_d(300.0), COLD, unit_config())
    assert (placement.prefill_instance, placement.decode_instance) == ("d0", "d0")
    assert (placement.transfer_ms, placement.queue_ms, placement.prefill_ms) == (0.0, 0.0, 640.0)
    assert placement.reason == (
        "colocated: 640.0 ms <= disaggregated 980.0 ms; "
        "d0: T=transfer 0.0 + queue 0.0 + prefill 640.0 = 640.0 ms (local prefix 0 blocks); "
        "disaggregated: p0: T=transfer 0.0 + queue 300.0 + prefill 640.0 = 940.0 ms (local prefix 0 "
        "blocks) + hand-off 40.0 ms to d0 = 980.0 ms; decode d0: load 0, kv 0%")


def test_equal_totals_go_to_the_colocated_option():
    # p0 with no queue: 640 + 40 = 680; d0 with a 40 ms queue of its own: 680.
    s = one_p_one_d(0.0, InstanceView("d0", queued_prefill_ms=40.0))
    assert baton(s, COLD, unit_config()).prefill_instance == "d0"
    s = one_p_one_d(0.0, InstanceView("d0", queued_prefill_ms=40.5))
    assert baton(s, COLD, unit_config()).prefill_instance == "p0"


def test_a_busy_decode_batch_sends_the_prefill_to_the_prefill_instance():
    # d0 runs 8 sequences: a step is 18 ms, and a 640-token prompt in chunks of 64 takes 10 of
    # them: 180 ms of decode batch. Without it d0 wins by 780 - 640 = 140 ms; with it, p0 does.
    busy = InstanceView("d0", 8, 0)
    config = unit_config(baton_prefill_chunk_tokens=64)
    placement = baton(one_p_one_d(100.0, busy), COLD, config)
    assert (placement.prefill_instance, placement.decode_instance) == ("p0", "d0")
    assert placement.reason == (
        "disaggregated: 780.0 ms < colocated 820.0 ms; "
        "p0: T=transfer 0.0 + queue 100.0 + prefill 640.0 = 740.0 ms (local prefix 0 blocks) + "
        "hand-off 40.0 ms to d0 = 780.0 ms; decode d0: load 8, kv 0%")
    # a longer prefill queue (disaggregated 840) and the busy decode instance wins again
    placement = baton(one_p_one_d(160.0, busy), COLD, config)
    assert (placement.prefill_instance, placement.queue_ms) == ("d0", 180.0)
    assert placement.reason.startswith(
        "colocated: 820.0 ms <= disaggregated 840.0 ms; d0: T=transfer 0.0 + queue 180.0 (decode "
        "batch 180.0 of it) + prefill 640.0 = 820.0 ms (local prefix 0 blocks); decode batch 180.0 "
        "ms = 10 chunks x step 18.0 ms (8 running); disaggregated: p0:")
    # with the default chunk (2048 tokens) the prompt is one chunk: 18 ms of decode batch
    assert baton(one_p_one_d(100.0, busy), COLD, unit_config()).queue_ms == 18.0


def test_the_handoff_is_the_prompt_past_the_decode_instances_device_run_over_its_path():
    config = unit_config()
    p, d = InstanceView("p0", node_id="n0"), InstanceView("d0", node_id="n0")
    s = ClusterSnapshot((p,), (d,), 0, {"d0": PrefixHit(10, 20)})
    # 40 blocks, 10 on d0's device: 30 blocks over same_node (0.5 ms each); host blocks still move
    assert handoff_ms(s, COLD, config, p, d) == 15.0
    remote = InstanceView("d0", node_id="n1")
    assert handoff_ms(s, COLD, config, p, remote) == 30.0
    assert handoff_ms(s, COLD, config, InstanceView("p0"), InstanceView("d0")) == 30.0  # no node ids
    assert handoff_ms(ClusterSnapshot((p,), (d,), 0, {"d0": PrefixHit(40)}), COLD, config, p, d) == 0.0


def test_an_instance_whose_step_with_the_chunk_exceeds_the_tbt_slo_is_no_colocated_candidate():
    # d0 runs 8 (18 ms a step) and the first 64-token chunk costs 64 ms: 82 ms > 50.
    busy = InstanceView("d0", 8, 0)
    config = unit_config(baton_prefill_chunk_tokens=64, tbt_slo_ms=50.0)
    placement = baton(one_p_one_d(1000.0, busy), COLD, config)
    assert (placement.prefill_instance, placement.decode_instance) == ("p0", "d0")
    assert placement.reason.startswith("disaggregated: no decode instance within tbt_slo_ms to prefill on; p0:")
    assert baton(one_p_one_d(1000.0, busy), COLD, unit_config(baton_prefill_chunk_tokens=64,
                                                              tbt_slo_ms=90.0)).prefill_instance == "d0"
    # an idle decode instance has no batch to slow: it stays a candidate
    s = ClusterSnapshot((InstanceView("p0", queued_prefill_ms=1000.0),), (busy, InstanceView("d1", 0, 1)))
    assert baton(s, COLD, config).prefill_instance == "d1"
    # without a prefill pool nothing is left out (admission judges the TBT)
    assert baton(ClusterSnapshot((), (busy,)), COLD, config).prefill_instance == "d0"


# --- no prefill pool -----------------------------------------------------------------------------

WARM = PlacementRequest("warm", 800)  # 50 blocks


def test_without_a_prefill_pool_the_holder_of_the_prefix_wins_over_the_least_loaded():
    # d0 holds 40 of the 50 blocks and runs 3 (a 13 ms step, one chunk): 160 + 13 = 173; d1 idle
    # recomputes 800. By load alone (the old rule) d1 would take it.
    s = ClusterSnapshot((), (InstanceView("d0", 3, 0), InstanceView("d1")), 0, {"d0": PrefixHit(40)})
    placement = baton(s, WARM, unit_config())
    assert (placement.prefill_instance, placement.decode_instance) == ("d0", "d0")
    assert placement.reason == (
        "colocated: no prefill pool; d0: T=transfer 0.0 + queue 13.0 (decode batch 13.0 of it) + "
        "prefill 160.0 = 173.0 ms (local prefix 40 blocks); decode batch 13.0 ms = 1 chunks x step "
        "13.0 ms (3 running); decode d0: load 3, kv 0%; runner-up d1: T=transfer 0.0 + queue 0.0 + "
        "prefill 800.0 = 800.0 ms (local prefix 0 blocks)")
    assert baton(s, WARM, unit_config(short_prefill_tokens=0)).prefill_instance == "d1"


def test_without_a_prefill_pool_a_long_queue_on_the_holder_moves_the_prompt_even_to_reload_it():
    # d0's 1,000 ms queue: 1,173. d1 shares d0's node and holds the prefix in the host tier:
    # loading 40 blocks costs 20 ms, then 160 ms of prefill.
    s = ClusterSnapshot((), (InstanceView("d0", 3, 0, queued_prefill_ms=1000.0, node_id="n0"),
                             InstanceView("d1", node_id="n0")), 0,
                        {"d0": PrefixHit(40), "d1": PrefixHit(0, 40)})
    placement = baton(s, WARM, unit_config())
    assert (placement.prefill_instance, placement.transfer_ms, placement.prefill_ms) == ("d1", 20.0, 160.0)


def test_without_a_prefill_pool_equal_prices_go_to_the_least_loaded():
    # neither holds anything and neither runs a batch: equal prices, d1 has less KV in use
    s = ClusterSnapshot((), (InstanceView("d0", 0, 2, kv_usage_frac=0.5), InstanceView("d1", 0, 2, kv_usage_frac=0.1),
                             InstanceView("d2", 0, 3)))
    assert baton(s, WARM, unit_config()).prefill_instance == "d1"


def _agent_tokens(agent: int, num_blocks: int) -> list[int]:
    return list(range(100_000 * (agent + 1), 100_000 * (agent + 1) + num_blocks * 16))


@pytest.mark.parametrize("mode", ["priced", "short"])
def test_a_burst_of_warm_agent_steps_keeps_each_agent_on_its_holder(mode):
    """4 agents, 2 on each of 2 decode instances (no prefill pool), whose next steps arrive
    together: each placement books its prefill on its instance's queue, so the next agent's price
    there includes it, and each agent still stays on its holder. The old rule (by load) moves
    every second one."""
    extras = KeyExtras("m", "", "", "L")
    tuning = {} if mode == "priced" else {"short_prefill_tokens": 0}
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16, **tuning), clock=lambda: 10.0)
    for instance_id in ("d0", "d1"):
        state.register(instance_id, "decode", "n0", "m", "L")
        state.set_ready(instance_id, True)
    holders = {0: "d0", 1: "d0", 2: "d1", 3: "d1"}
    for agent, holder in holders.items():
        state.index.note_device_blocks(holder, tuple(block_keys(_agent_tokens(agent, 40), 16, extras)))
    placements = []
    for agent in holders:  # the steps arrive together: nothing finishes in between
        tokens = _agent_tokens(agent, 42)  # its history and two blocks of new tokens
        placements.append(state.place(PlacementRequest(f"a{agent}", len(tokens),
                                                       tuple(block_keys(tokens, 16, extras)), 16)))
    chosen = [(p.prefill_instance, p.decode_instance) for p in placements]
    if mode == "short":
        assert chosen == [("d0", "d0"), ("d1", "d1"), ("d0", "d0"), ("d1", "d1")]
        return
    assert chosen == [(h, h) for h in holders.values()]
    assert [p.expected_cached_blocks for p in placements] == [40] * 4
    # the second agent on each holder was priced behind the first one's booked prefill
    first, second = placements[0], placements[1]
    assert second.queue_ms > first.transfer_ms + first.prefill_ms > 0.0


# --- the older rule ------------------------------------------------------------------------------


def test_setting_short_prefill_tokens_keeps_the_old_rule_and_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(policy_config, "_warned_short_prefill_tokens", False)
    with caplog.at_level(logging.WARNING, logger="conductor.policy_config"):
        config = PolicyConfig(short_prefill_tokens=256)
        PolicyConfig(short_prefill_tokens=0)
    warnings = [r.getMessage() for r in caplog.records if "short_prefill_tokens" in r.getMessage()]
    assert len(warnings) == 1 and "baton_colocation" in warnings[0]
    assert config.baton_colocation_mode == "short"
    # the cluster fills in block size and cost models with model_copy: the key stays set
    assert config.model_copy(update={"block_size_tokens": 32}).baton_colocation_mode == "short"
    assert PolicyConfig().baton_colocation_mode == "priced"
    assert PolicyConfig().model_copy(update={"short_prefill_tokens": 0}).baton_colocation_mode == "short"
    assert PolicyConfig(baton_colocation="short").baton_colocation_mode == "short"
    # the old key wins over a file's baton_colocation: priced, and says nothing when asked for
    assert PolicyConfig(short_prefill_tokens=0, baton_colocation="priced").baton_colocation_mode == "short"
    caplog.clear()
    monkeypatch.setattr(policy_config, "_warned_short_prefill_tokens", False)
    with caplog.at_level(logging.WARNING, logger="conductor.policy_config"):
        PolicyConfig(short_prefill_tokens=0, baton_colocation="short")
    assert not caplog.records


def test_the_local_cluster_config_serves_with_priced_colocation():
    from cluster.config import load_config

    tuning = load_config(REPO / "deploy" / "local.yaml").conductor.tuning
    assert "short_prefill_tokens" not in tuning.model_fields_set
    assert tuning.baton_colocation_mode == "priced"
    overridden = load_config(REPO / "deploy" / "local.yaml", {"conductor.tuning.short_prefill_tokens": 0})
    assert overridden.conductor.tuning.baton_colocation_mode == "short"


@pytest.mark.parametrize("tuning", [{"short_prefill_tokens": 256}, {"baton_colocation": "short"}])
def test_short_mode_reproduces_the_old_choices(tuning):
    s = ClusterSnapshot((InstanceView("p0", queued_prefill_ms=300.0),),
                        (InstanceView("d0", 3, 0), InstanceView("d1", 1, 0)), 0, {"d1": PrefixHit(50)})
    # 800 cached on d1 of 1,000: a 200-token suffix, under 256: on d1; a cold prompt: p0
    placement = baton(s, PlacementRequest("r", 1000), unit_config(**tuning))
    assert (placement.prefill_instance, placement.decode_instance) == ("d1", "d1")
    assert placement.reason.startswith("colocated: uncached suffix 200 tokens < short_prefill_tokens 256; ")
    s = msgspec.structs.replace(s, prefix_hits={})
    placement = baton(s, COLD, unit_config(**tuning))
    assert (placement.prefill_instance, placement.decode_instance) == ("p0", "d1")
    assert placement.reason.startswith("p0: T=transfer 0.0 + queue 300.0 + prefill 640.0 = 940.0 ms")
    assert baton(s, COLD, unit_config()).prefill_instance == "d1"  # priced: 640 + 11 < 980


# --- the decode-pool scan against the slow reference --------------------------------------------

CONFIGS = [PolicyConfig(), PolicyConfig(tbt_slo_ms=60.0), PolicyConfig(baton_prefill_chunk_tokens=64, tbt_slo_ms=150.0),
           PolicyConfig(decode_cost=UNIT_DECODE, tbt_slo_ms=40.0), PolicyConfig(baton_decode_stall_weight=1.0),
           PolicyConfig(baton_decode_stall_weight=0.5, tbt_slo_ms=60.0)]


@pytest.mark.parametrize("config", CONFIGS, ids=["defaults", "tbt", "small-chunks", "other-decode-model",
                                                 "decode-stall", "decode-stall-tbt"])
@pytest.mark.parametrize("arrays", ["bare", "kept"])
@pytest.mark.parametrize("pool", ["prefill pool", "no prefill pool"])
@settings(max_examples=100, deadline=None)
@given(scenario=scenarios(),
       tie_prone=st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1e3]), st.sampled_from([0, 0, 1, 3])),
                          min_size=4, max_size=4))
def test_the_priced_choice_is_exactly_the_slow_references(config, arrays, pool, scenario, tie_prone):
    """Over bare snapshots and ones with the state's fields (the decode pool's ``LoadArrays``),
    with tie-prone decode queues and batches: the same instances, terms and cached blocks as
    pricing every option with ``price`` / ``colocated_price``."""
    snapshot, request = scenario
    decode = tuple(msgspec.structs.replace(v, queued_prefill_ms=q, num_running_reqs=r)
                   for v, (q, r) in zip(snapshot.decode, tie_prone))
    snapshot = msgspec.structs.replace(snapshot, decode=decode)
    if pool == "no prefill pool":
        hits = {i: h for i, h in snapshot.prefix_hits.items() if i.startswith("d")}
        snapshot = msgspec.structs.replace(snapshot, prefill=(), prefix_hits=hits)
    if arrays == "kept":
        snapshot = with_makers_fields(snapshot)
    try:
        placement = baton(snapshot, request, config)
    except NoWorkerReady:
        assert not any(v.ready for v in snapshot.decode) or (
            snapshot.prefill and not any(v.ready for v in snapshot.prefill))
        return
    chosen, decode_instance = baton_priced_choice(snapshot, request, config)
    assert (placement.prefill_instance, placement.decode_instance) == (chosen.instance_id, decode_instance)
    assert (placement.transfer_ms, placement.queue_ms, placement.prefill_ms) == (
        chosen.transfer_ms, chosen.queue_ms, chosen.prefill_ms)
    assert (placement.expected_cached_blocks, placement.pulled_from) == (
        chosen.num_cached_blocks, chosen.pulled_from)


def test_a_colocated_option_that_cannot_win_is_bounded_not_scanned():
    # p0 holds the whole prompt: 0 ms of prefill + 40 ms of hand-off. Recomputing on d0 costs
    # 640 ms before any queue or batch: the reason gives that floor.
    s = ClusterSnapshot((InstanceView("p0"),), (InstanceView("d0", 8, 0, queued_prefill_ms=50.0),), 0,
                        {"p0": PrefixHit(40)})
    placement = baton(s, COLD, unit_config())
    assert (placement.prefill_instance, placement.decode_instance) == ("p0", "d0")
    assert placement.reason.startswith("disaggregated: 40.0 ms < colocated >= 640.0 ms; p0: T=transfer 0.0 + "
                                       "queue 0.0 + prefill 0.0 = 0.0 ms (local prefix 40 blocks) + hand-off "
                                       "40.0 ms to d0 = 40.0 ms")


def test_the_decode_stall_weight_sends_a_prompt_where_fewer_streams_wait_for_it():
    # d0: no queue, 3 sequences; d1: 100 ms queued, none running. The prompt's prefill is 640 ms.
    # TTFT alone picks d0 (640 against 740); priced with the stall of d0's 3 streams (3 x 640 ms
    # at weight 1) it goes to d1.
    s = ClusterSnapshot((), (InstanceView("d0", 3, 0), InstanceView("d1", 0, 0, queued_prefill_ms=100.0)),
                        0, {})
    assert baton(s, COLD, unit_config()).prefill_instance == "d0"
    placement = baton(s, COLD, unit_config(baton_decode_stall_weight=1.0))
    assert placement.prefill_instance == "d1"
    assert (placement.queue_ms, placement.prefill_ms) == (100.0, 640.0)  # the terms stay TTFT's
    assert "runner-up d0: " in placement.reason and "+ decode stall 1920.0 ms" in placement.reason


# --- a request computed where it is decoded ------------------------------------------------------


@pytest.mark.parametrize("policy", ["baton", "round_robin", "mooncake"])
def test_a_request_that_must_be_colocated_prefills_on_its_decode_instance_whatever_the_policy(
        policy):
    """A request for its prompt's log-probabilities (``colocate``) is computed on the decode
    instance the policy chose, priced there as a cold prompt; the same request without the flag
    goes to the idle prefill instance (the decode instance's queue is long)."""
    state = ConductorState(policy, unit_config(), clock=lambda: 10.0)
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)
    # d0 already computes a long prompt: 900 ms booked on its queue
    state.place(PlacementRequest("busy", 900, colocate=True))

    apart = state.place(PlacementRequest("apart", 640))
    together = state.place(PlacementRequest("together", 640, colocate=True))

    assert (apart.prefill_instance, apart.decode_instance) == ("p0", "d0")
    assert (together.prefill_instance, together.decode_instance) == ("d0", "d0")
    assert (together.transfer_ms, together.prefill_ms, together.expected_cached_blocks) == (
        0.0, 640.0, 0)
    assert together.queue_ms >= 900.0  # behind the booked prompt
    assert together.reason.startswith(
        "colocated: its prompt's log-probabilities are computed where it is decoded; d0: T=")
