"""The autoscaling planner: how many prefill and decode instances the load asks for.

A pure decision over a window of samples, like every other decision in this room: the caller
(``cluster.autoscale``) samples the conductor's view of both pools every ``interval_s``, keeps the
window, calls ``plan`` and applies what it returns through the pool manager (``baton scale``'s
own path, so a scale-down is always a drain).

Per pool, in this order (the first rule that applies decides):

1. **A change under way holds**: an instance still starting (waiting for a node from Ray's
   autoscaler, or for its engine) or draining.
2. **Min and max**: a pool outside ``[min_instances, max_instances]`` goes to the nearest bound.
3. **Cool-down**: no change within ``cooldown_s`` of the pool's last one.
4. **Enough evidence**: at least ``min_samples`` samples taken after the last change (samples
   from before it describe a pool that no longer exists) and within ``window_s``.
5. **Scale up** by one when the window's *mean* of a signal is over its up line: prefill when
   the predicted TTFT exceeds ``scale_up_frac`` x ``ttft_target_ms`` or the queued prefills per
   ready instance exceed ``scale_up_frac`` x ``max_queued_prefills_per_instance``; decode when
   the inter-token latency exceeds ``scale_up_frac`` x ``itl_target_ms`` or the KV cache use
   exceeds ``kv_usage_high_frac``. At ``max_instances`` it holds and says so.
6. **Scale down** by one when the window's *peak* of every signal, spread over one instance
   fewer (x n / (n - 1)), is under its down line (``scale_down_frac`` x the target; KV use:
   ``kv_usage_low_frac``). At ``min_instances`` it holds.
7. Otherwise hold: inside the band between the two lines (the hysteresis).

Up reacts to the mean, down needs the peak to be low all window long, and the lines are apart,
so a pool that just grew does not shrink straight back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import fmean

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from protos.wire import PoolDecision

POOLS = ("prefill", "decode")


class PoolLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    min_instances: int = Field(1, ge=1, description="Fewest instances the planner keeps.")
    max_instances: int = Field(4, ge=1, description="Most instances the planner asks for.")

    @model_validator(mode="after")
    def _ordered(self) -> PoolLimits:
        if self.max_instances < self.min_instances:
            raise ValueError(f"max_instances {self.max_instances} < min_instances "
                             f"{self.min_instances}")
        return self


class PlannerConfig(BaseModel):
    """The autoscaling planner and the loop that applies it (``autoscale`` in the cluster
    config). Off by default: the pools keep the size ``baton up``/``baton scale`` gave them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="Apply the planner's decisions (`baton up` clusters "
                          "only; `baton serve` cannot start workers).")
    interval_s: float = Field(5.0, gt=0, description="Seconds between samples (and decisions).")
    window_s: float = Field(60.0, gt=0, description="Samples older than this are forgotten (s).")
    min_samples: int = Field(3, ge=1, description="Samples since the pool's last change needed "
                             "before deciding.")
    cooldown_s: float = Field(60.0, ge=0, description="Least time between two changes of one "
                              "pool (s).")
    prefill: PoolLimits = Field(PoolLimits(), description="Bounds of the prefill pool.")
    decode: PoolLimits = Field(PoolLimits(), description="Bounds of the decode pool.")
    ttft_target_ms: float = Field(2000.0, gt=0, description="Prefill: the predicted TTFT the "
                                  "pool is sized for (ms).")
    max_queued_prefills_per_instance: float = Field(
        4.0, gt=0, description="Prefill: prefills placed and not finished, per ready instance, "
        "above which the pool grows.")
    itl_target_ms: float = Field(100.0, gt=0, description="Decode: the inter-token latency "
                                 "(median of busy instances) the pool is sized for (ms).")
    kv_usage_high_frac: float = Field(0.8, gt=0, le=1, description="Decode: mean KV cache use "
                                      "above which the pool grows (0..1).")
    kv_usage_low_frac: float = Field(0.3, ge=0, le=1, description="Decode: the peak KV use, "
                                     "spread over one instance fewer, must stay under this to "
                                     "shrink (0..1).")
    scale_up_frac: float = Field(1.0, gt=0, description="Grow when the window's mean is over "
                                 "this fraction of a target.")
    scale_down_frac: float = Field(0.4, gt=0, description="Shrink when the window's peak, over "
                                   "one instance fewer, is under this fraction of every target.")
    start_timeout_s: float = Field(600.0, gt=0, description="How long the loop waits for a new "
                                   "worker (its node and engine) before deciding again (s).")
    drain_timeout_s: float = Field(600.0, gt=0, description="How long a leaving instance may "
                                   "take to finish its requests (s); it stays draining after.")

    @model_validator(mode="after")
    def _band(self) -> PlannerConfig:
        if self.scale_down_frac >= self.scale_up_frac:
            raise ValueError(f"scale_down_frac {self.scale_down_frac} must be below "
                             f"scale_up_frac {self.scale_up_frac} (the hysteresis band)")
        if self.kv_usage_low_frac >= self.kv_usage_high_frac:
            raise ValueError(f"kv_usage_low_frac {self.kv_usage_low_frac} must be below "
                             f"kv_usage_high_frac {self.kv_usage_high_frac}")
        return self

    def limits(self, pool: str) -> PoolLimits:
        return self.prefill if pool == "prefill" else self.decode


class PoolSample(msgspec.Struct, frozen=True):
    """One pool at one instant, as the planner reads it."""

    num_ready: int
    num_starting: int = 0
    num_draining: int = 0
    predicted_ttft_ms: float = 0.0
    """Prefill: what the next prompt would wait for its first token: the shortest priced queue
    of a ready instance plus the median recent TTFT of busy ones (ms; 0 when idle)."""
    num_queued_prefills: int = 0
    """Prefill: prefills placed on the pool and not finished (the conductor's book)."""
    itl_ms: float = 0.0
    """Decode: median recent inter-token latency of the instances running requests (ms)."""
    kv_usage_frac: float = 0.0
    """Decode: mean KV cache use of the ready instances (0..1)."""

    @property
    def size(self) -> int:
        """Instances that are not leaving."""
        return self.num_ready + self.num_starting

    @property
    def queued_per_instance(self) -> float:
        return self.num_queued_prefills / max(self.num_ready, 1)


class ClusterSample(msgspec.Struct, frozen=True):
    at_s: float
    """Monotonic time of the sample (s)."""
    prefill: PoolSample
    decode: PoolSample

    def pool(self, name: str) -> PoolSample:
        return self.prefill if name == "prefill" else self.decode


class _Signal(msgspec.Struct, frozen=True):
    name: str
    value: float
    up_line: float
    """Grow when the window's mean is over this."""
    down_line: float
    """Shrink only when the window's peak over one instance fewer is under this."""


def _signals(pool: str, samples: Sequence[PoolSample], config: PlannerConfig,
             peak: bool, spread: float = 1.0) -> list[_Signal]:
    """The pool's signals over ``samples``: their mean (``peak``: maximum) times ``spread``."""
    agg = max if peak else fmean
    up, down = config.scale_up_frac, config.scale_down_frac
    if pool == "prefill":
        ttft, queue = config.ttft_target_ms, config.max_queued_prefills_per_instance
        return [_Signal("TTFT ms", agg(s.predicted_ttft_ms for s in samples) * spread,
                        up * ttft, down * ttft),
                _Signal("queued prefills/instance",
                        agg(s.queued_per_instance for s in samples) * spread,
                        up * queue, down * queue)]
    itl = config.itl_target_ms
    return [_Signal("ITL ms", agg(s.itl_ms for s in samples) * spread, up * itl, down * itl),
            _Signal("KV use", agg(s.kv_usage_frac for s in samples) * spread,
                    config.kv_usage_high_frac, config.kv_usage_low_frac)]


def plan_pool(pool: str, window: Sequence[ClusterSample], last_change_s: float | None,
              now_s: float, config: PlannerConfig) -> PoolDecision:
    """The decision for ``pool`` (rules in the module docstring). ``window``: samples oldest
    first; ``last_change_s``: when the loop last changed this pool (monotonic s; None: never)."""
    assert pool in POOLS, pool
    if not window:
        return PoolDecision(pool, "hold", 0, 0, "no samples yet")
    latest = window[-1].pool(pool)
    size = latest.size
    limits = config.limits(pool)

    def hold(reason: str) -> PoolDecision:
        return PoolDecision(pool, "hold", size, size, reason)

    if latest.num_starting or latest.num_draining:
        return hold(f"change under way: {latest.num_starting} starting, "
                    f"{latest.num_draining} draining")
    if size < limits.min_instances:
        return PoolDecision(pool, "up", size, limits.min_instances,
                            f"below min_instances {limits.min_instances}")
    if size > limits.max_instances:
        return PoolDecision(pool, "down", size, limits.max_instances,
                            f"above max_instances {limits.max_instances}")
    if last_change_s is not None and now_s - last_change_s < config.cooldown_s:
        left = config.cooldown_s - (now_s - last_change_s)
        return hold(f"cool-down: {left:.0f} s of {config.cooldown_s:.0f} s left")
    since = now_s - config.window_s
    if last_change_s is not None:
        since = max(since, last_change_s)
    samples = [s.pool(pool) for s in window if s.at_s > since]
    if len(samples) < config.min_samples:
        return hold(f"collecting: {len(samples)} of {config.min_samples} samples")

    over = [sig for sig in _signals(pool, samples, config, peak=False) if sig.value > sig.up_line]
    if over:
        why = f"mean {over[0].name} {over[0].value:.2f} > {over[0].up_line:.2f}"
        if size >= limits.max_instances:
            return hold(f"at max_instances {limits.max_instances}: {why}")
        return PoolDecision(pool, "up", size, size + 1, why)

    if size <= limits.min_instances:
        return hold(f"at min_instances {limits.min_instances}")
    projected = _signals(pool, samples, config, peak=True, spread=size / (size - 1))
    high = [sig for sig in projected if sig.value >= sig.down_line]
    if high:
        return hold(f"within band: peak {high[0].name} over {size - 1} instances "
                    f"{high[0].value:.2f} >= {high[0].down_line:.2f}")
    described = ", ".join(f"{sig.name} {sig.value:.2f} < {sig.down_line:.2f}" for sig in projected)
    return PoolDecision(pool, "down", size, size - 1,
                        f"peak over {size - 1} instances: {described}")


def plan(window: Sequence[ClusterSample], last_change_s: Mapping[str, float], now_s: float,
         config: PlannerConfig) -> list[PoolDecision]:
    """Both pools' decisions, prefill first (``plan_pool`` for each)."""
    return [plan_pool(pool, window, last_change_s.get(pool), now_s, config) for pool in POOLS]
