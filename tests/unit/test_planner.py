"""The autoscaling planner (``conductor.planner``): exact decisions on synthetic windows."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from conductor.planner import (
    ClusterSample,
    PlannerConfig,
    PoolLimits,
    PoolSample,
    plan,
    plan_pool,
)
from protos.wire import PoolDecision

CONFIG = PlannerConfig(
    enabled=True, interval_s=1.0, window_s=10.0, min_samples=3, cooldown_s=20.0,
    prefill=PoolLimits(min_instances=1, max_instances=3),
    decode=PoolLimits(min_instances=1, max_instances=3),
    ttft_target_ms=1000.0, max_queued_prefills_per_instance=4.0, itl_target_ms=50.0,
    kv_usage_high_frac=0.8, kv_usage_low_frac=0.3, scale_up_frac=1.0, scale_down_frac=0.4)


def prefill(ttft_ms: float = 0.0, queued: int = 0, ready: int = 1, **kw) -> PoolSample:
    return PoolSample(num_ready=ready, predicted_ttft_ms=ttft_ms, num_queued_prefills=queued, **kw)


def decode(itl_ms: float = 0.0, kv: float = 0.0, ready: int = 1, **kw) -> PoolSample:
    return PoolSample(num_ready=ready, itl_ms=itl_ms, kv_usage_frac=kv, **kw)


def window(pools: list[tuple[PoolSample, PoolSample]],
           start_s: float = 100.0) -> list[ClusterSample]:
    """One sample a second from ``start_s`` on."""
    return [ClusterSample(start_s + i, p, d) for i, (p, d) in enumerate(pools)]


def decide(pool: str, samples: list[ClusterSample], last_change_s: float | None = None,
           config: PlannerConfig = CONFIG) -> PoolDecision:
    return plan_pool(pool, samples, last_change_s, samples[-1].at_s if samples else 0.0, config)


def test_ttft_breach_grows_prefill():
    samples = window([(prefill(ttft_ms=1400), decode())] * 3)
    assert decide("prefill", samples) == PoolDecision(
        "prefill", "up", 1, 2, "mean TTFT ms 1400.00 > 1000.00")


def test_prefill_queue_grows_prefill():
    samples = window([(prefill(ttft_ms=100, queued=10, ready=2), decode())] * 3)
    assert decide("prefill", samples) == PoolDecision(
        "prefill", "up", 2, 3, "mean queued prefills/instance 5.00 > 4.00")


def test_the_mean_decides_up_not_one_spike():
    spike = [(prefill(ttft_ms=2500), decode()), (prefill(ttft_ms=200), decode()),
             (prefill(ttft_ms=200), decode())]
    assert decide("prefill", window(spike)) == PoolDecision(
        "prefill", "hold", 1, 1, "at min_instances 1")  # mean 966.67 ms, under the line


def test_hysteresis_band_holds():
    # 2 instances at 300 ms: over 1 instance the peak would be 600 ms >= 0.4 x 1000 ms
    samples = window([(prefill(ttft_ms=300, ready=2), decode())] * 5)
    assert decide("prefill", samples) == PoolDecision(
        "prefill", "hold", 2, 2, "within band: peak TTFT ms over 1 instances 600.00 >= 400.00")
    # one sample inside the band keeps a calm window from shrinking
    calm = [(prefill(ttft_ms=100, ready=2), decode())] * 4
    bump = [(prefill(ttft_ms=250, ready=2), decode())]
    assert decide("prefill", window(calm + bump)).action == "hold"
    assert decide("prefill", window(calm)) == PoolDecision(
        "prefill", "down", 2, 1,
        "peak over 1 instances: TTFT ms 200.00 < 400.00, queued prefills/instance 0.00 < 1.60")


def test_collecting_until_min_samples():
    samples = window([(prefill(ttft_ms=5000), decode())] * 2)
    assert decide("prefill", samples) == PoolDecision(
        "prefill", "hold", 1, 1, "collecting: 2 of 3 samples")
    assert decide("prefill", []) == PoolDecision("prefill", "hold", 0, 0, "no samples yet")


def test_cool_down_holds_then_only_fresh_samples_count():
    samples = window([(prefill(ttft_ms=3000, ready=2), decode())] * 30)  # t = 100 .. 129
    assert decide("prefill", samples[:15], last_change_s=100.0) == PoolDecision(
        "prefill", "hold", 2, 2, "cool-down: 6 s of 20 s left")
    # a change at t=120 cools the pool until 140; one at t=102 cooled it until 122, and the
    # samples after the change (within window_s) are the evidence
    cooling = decide("prefill", samples[:22], last_change_s=120.0)
    assert cooling.reason == "cool-down: 19 s of 20 s left"
    fresh = decide("prefill", samples[:23], last_change_s=102.0)
    assert fresh == PoolDecision("prefill", "up", 2, 3, "mean TTFT ms 3000.00 > 1000.00")
    # the window forgets what is older than window_s
    config = CONFIG.model_copy(update={"cooldown_s": 0.0})
    old_breach = window([(prefill(ttft_ms=9000), decode())] * 3
                        + [(prefill(ttft_ms=0), decode())] * 12)
    assert decide("prefill", old_breach, config=config).reason == "at min_instances 1"


def test_min_and_max_bound_the_pool():
    at_max = window([(prefill(ttft_ms=5000, ready=3), decode())] * 3)
    assert decide("prefill", at_max) == PoolDecision(
        "prefill", "hold", 3, 3, "at max_instances 3: mean TTFT ms 5000.00 > 1000.00")
    at_min = window([(prefill(ready=1), decode())] * 3)
    assert decide("prefill", at_min) == PoolDecision("prefill", "hold", 1, 1, "at min_instances 1")
    config = CONFIG.model_copy(update={"decode": PoolLimits(min_instances=2, max_instances=2)})
    below = window([(prefill(), decode(ready=1))])
    assert decide("decode", below, config=config) == PoolDecision(
        "decode", "up", 1, 2, "below min_instances 2")
    above = window([(prefill(), decode(ready=4))])
    assert decide("decode", above, config=config) == PoolDecision(
        "decode", "down", 4, 2, "above max_instances 2")


def test_a_change_under_way_holds():
    starting = window([(prefill(ttft_ms=5000, num_starting=1), decode())] * 3)
    assert decide("prefill", starting) == PoolDecision(
        "prefill", "hold", 2, 2, "change under way: 1 starting, 0 draining")
    # a draining instance is not counted in the size, and nothing more happens until it left
    draining = window([(prefill(ready=2), decode(ready=1, num_draining=1))] * 3)
    assert decide("decode", draining) == PoolDecision(
        "decode", "hold", 1, 1, "change under way: 0 starting, 1 draining")


@pytest.mark.parametrize("itl_ms, kv, expected", [
    (80.0, 0.1, PoolDecision("decode", "up", 2, 3, "mean ITL ms 80.00 > 50.00")),
    (10.0, 0.9, PoolDecision("decode", "up", 2, 3, "mean KV use 0.90 > 0.80")),
    # down: the peak spread over one instance fewer (x 2) is under both down lines
    (7.5, 0.1, PoolDecision("decode", "down", 2, 1,
                            "peak over 1 instances: ITL ms 15.00 < 20.00, KV use 0.20 < 0.30")),
    (7.5, 0.2, PoolDecision("decode", "hold", 2, 2,
                            "within band: peak KV use over 1 instances 0.40 >= 0.30")),
    (15.0, 0.1, PoolDecision("decode", "hold", 2, 2,
                             "within band: peak ITL ms over 1 instances 30.00 >= 20.00")),
])
def test_decode_on_itl_and_kv(itl_ms, kv, expected):
    samples = window([(prefill(), decode(itl_ms=itl_ms, kv=kv, ready=2))] * 3)
    assert decide("decode", samples) == expected


def test_plan_decides_both_pools_prefill_first():
    samples = window([(prefill(ttft_ms=2000), decode(itl_ms=10, kv=0.95))] * 3)
    assert [(d.pool, d.action, d.size_after) for d in plan(samples, {}, 102.0, CONFIG)] == [
        ("prefill", "up", 2), ("decode", "up", 2)]
    # a change of one pool does not cool the other down
    assert [d.action for d in plan(samples, {"prefill": 101.0}, 102.0, CONFIG)] == ["hold", "up"]


def test_config_keeps_the_band_open():
    with pytest.raises(ValidationError, match="scale_down_frac 1.0 must be below scale_up_frac"):
        PlannerConfig(scale_down_frac=1.0, scale_up_frac=1.0)
    with pytest.raises(ValidationError, match="kv_usage_low_frac 0.9 must be below"):
        PlannerConfig(kv_usage_low_frac=0.9)
    with pytest.raises(ValidationError, match="max_instances 1 < min_instances 2"):
        PoolLimits(min_instances=2, max_instances=1)
    assert PlannerConfig().enabled is False
