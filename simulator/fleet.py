"""The simulated fleet's shape and the SLOs it is judged by."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from simulator.cache import UNLIMITED
from simulator.profile import ANALYTIC_DEVICE_KV_BYTES

GIB = 1 << 30


class FleetConfig(BaseModel):
    """Pools, node layout, KV capacities and SLOs of one simulated fleet.

    Prefill and decode instances sit on separate nodes, ``instances_per_node`` to a node (the
    pools scale independently). A capacity of ``None`` is unlimited.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_prefill_instances: int = Field(ge=1, description="Prefill instances.")
    num_decode_instances: int = Field(ge=1, description="Decode instances.")
    instances_per_node: int = Field(8, ge=1, description="Instances (GPUs) sharing one node's store.")
    device_kv_bytes: float | None = Field(
        ANALYTIC_DEVICE_KV_BYTES, gt=0, description="KV cache of one instance's device (bytes).")
    host_kv_bytes_per_node: float | None = Field(
        256 * GIB, ge=0, description="Host DRAM tier of one node's store (bytes).")
    disk_kv_bytes_per_node: float | None = Field(
        1024 * GIB, ge=0, description="Disk tier of one node's store (bytes).")
    ttft_slo_ms: float = Field(5_000.0, gt=0, description="A request meets the TTFT SLO at or under this (ms).")
    tbt_slo_ms: float = Field(
        100.0, gt=0, description="A request meets the TBT SLO when its worst inter-token gap is at or "
        "under this (ms).")
    stats_interval_ms: float = Field(
        500.0, ge=0, description="Worker stats (waiting requests, KV use) reach the conductor this "
        "often, as its poll does (conductor stats_interval_s); 0: the moment they change (ms).")
    admission: bool = Field(
        True, description="Give the policies the TTFT SLO, so those that admit (mooncake, baton) "
        "reject requests predicted to miss it.")
    prediction_error: float = Field(
        0.0, ge=0, lt=2, description="Mean absolute relative error of the cost model: each "
        "request's actual prefill and prefix-transfer times are its priced ones times a "
        "median-1 lognormal factor with this mean |factor - 1| (0: the model is exact).")
    error_seed: int = Field(0, description="Seed of the per-request error factors (the same draws "
                            "for every policy and rate scale).")
    coalesce_policies: tuple[str, ...] = Field(
        ("baton",), description="Policies whose conductor holds a request while an in-flight "
        "prefill computes its next blocks (the live conductor's coalescing; the baselines as "
        "their authors ship them do not).")
    coalesce_min_blocks: int = Field(
        4, ge=1, description="Hold only for at least this many blocks of one in-flight prefill "
        "(conductor coalesce_min_blocks) (blocks).")
    coalesce_max_wait_ms: float = Field(
        10_000.0, gt=0, description="Longest hold before placing anyway (conductor "
        "coalesce_max_wait_ms) (ms).")
    warm_rejected_policies: tuple[str, ...] = Field(
        (), description="EXPERIMENTAL, not what the live conductor does: policies whose rejected "
        "requests are still prefilled, last in the queue of the prefill instance with the "
        "shortest queue, for their KV only (no decode), so the session's next requests hit.")
    warm_max_busy_frac: float = Field(
        1.0, ge=0, le=1, description="EXPERIMENTAL: warm (and go on warming) only while at most this "
        "share of the prefill instances is busy; 1: always.")
    policy_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Other PolicyConfig fields, by name (e.g. short_prefill_tokens).")

    def capacity_blocks(self, num_bytes: float | None, block_bytes: int) -> int:
        return UNLIMITED if num_bytes is None else int(num_bytes // block_bytes)
