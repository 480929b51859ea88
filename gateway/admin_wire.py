"""``baton.v1.Admin`` messages to and from the structs the conductor returns.

The Admin service sends what the conductor actor's ``pool_status``, ``scale``, ``drain`` and
``pin_prefix`` return; the CLI turns the replies back into those same structs, so ``baton
status`` prints one table (and one ``--json`` object) whichever way it reached the cluster.
"""

from __future__ import annotations

import msgspec

from conductor.state import PlacementCounters
from protos.baton.v1 import admin_pb2 as apb
from protos.wire import (
    AutoscaleStatus,
    CostModelStatus,
    DrainResult,
    FrontAddresses,
    InstanceRow,
    PoolDecision,
    PoolStatus,
    PredictionError,
    ScaleResult,
    SoftPin,
    StoreRow,
    TierCounters,
)

INSTANCE_FIELDS = tuple(f for f in InstanceRow.__struct_fields__
                        if f not in ("recent_ttft_ms", "recent_itl_ms"))
STORE_FIELDS = tuple(f for f in StoreRow.__struct_fields__ if f != "counters")


class StatusView(msgspec.Struct, frozen=True):
    """What ``baton status`` shows: the conductor's pools, where the fronts serve, the name."""

    pools: PoolStatus
    fronts: FrontAddresses | None
    cluster_name: str


_COST_MODEL_ERRORS = ("prefill", "decode", "handoff", "decode_per_request", "mixed_step",
                      "decode_per_request_all_steps")
"""The ``PredictionError`` fields ``CostModelStatus`` shares with its proto, by name."""


def status_to_pb(view: StatusView) -> apb.StatusResponse:
    pools = view.pools
    reply = apb.StatusResponse(cluster_name=view.cluster_name, policy=pools.policy,
                               recent_events=pools.recent_events)
    for pool, phases in pools.pool_sizes.items():
        reply.pool_sizes[pool].instances_by_phase.update(phases)
    for row in pools.instances:
        message = reply.instances.add(**{f: getattr(row, f) for f in INSTANCE_FIELDS})
        if row.recent_ttft_ms is not None:
            message.recent_ttft_ms = row.recent_ttft_ms
        if row.recent_itl_ms is not None:
            message.recent_itl_ms = row.recent_itl_ms
    for store in pools.stores:
        reply.stores.add(counters=store.counters.as_dict(),
                         **{f: getattr(store, f) for f in STORE_FIELDS})
    counters = msgspec.structs.asdict(pools.counters)
    reply.placements_by_prefill_instance.update(counters.pop("by_prefill_instance"))
    reply.placement_counters.update({k: v for k, v in counters.items() if isinstance(v, int)})
    if view.fronts is not None:
        fronts = reply.fronts
        fronts.host_ip, fronts.http_tls = view.fronts.host_ip, view.fronts.http_tls
        fronts.grpc_host, fronts.http_host = view.fronts.grpc_host, view.fronts.http_host
        if view.fronts.grpc_port is not None:
            fronts.grpc_port = view.fronts.grpc_port
        if view.fronts.http_port is not None:
            fronts.http_port = view.fronts.http_port
    if pools.autoscale is not None:
        reply.autoscale.CopyFrom(autoscale_to_pb(pools.autoscale))
    if pools.cost_model is not None:
        reply.cost_model.calibrating = pools.cost_model.calibrating
        reply.cost_model.prefill_source = pools.cost_model.prefill_source
        reply.cost_model.handoff_overhead_ms = pools.cost_model.handoff_overhead_ms
        for name in _COST_MODEL_ERRORS:
            error = getattr(pools.cost_model, name)
            if error is not None:
                getattr(reply.cost_model, name).CopyFrom(
                    apb.PredictionError(**msgspec.structs.asdict(error)))
    return reply


def _cost_model(m: apb.CostModelStatus) -> CostModelStatus:
    def error(name: str) -> PredictionError | None:
        if not m.HasField(name):
            return None
        e = getattr(m, name)
        return PredictionError(e.median_pct, e.p90_pct, e.num_predictions)

    return CostModelStatus(m.calibrating, prefill_source=m.prefill_source,
                           handoff_overhead_ms=m.handoff_overhead_ms,
                           **{name: error(name) for name in _COST_MODEL_ERRORS})


def autoscale_to_pb(a: AutoscaleStatus) -> apb.AutoscaleStatus:
    return apb.AutoscaleStatus(
        enabled=a.enabled, last=[apb.PoolDecision(**msgspec.structs.asdict(d)) for d in a.last],
        changes=[apb.PoolDecision(**msgspec.structs.asdict(d)) for d in a.changes],
        decisions_total=a.decisions_total)


def autoscale_from_pb(m: apb.AutoscaleStatus) -> AutoscaleStatus:
    return AutoscaleStatus(m.enabled, [_decision(d) for d in m.last],
                           [_decision(d) for d in m.changes], dict(m.decisions_total))


def _decision(m: apb.PoolDecision) -> PoolDecision:
    return PoolDecision(m.pool, m.action, m.size_before, m.size_after, m.reason, m.at_s, m.outcome)


def _optional(message, field: str):
    return getattr(message, field) if message.HasField(field) else None


def status_from_pb(reply: apb.StatusResponse) -> StatusView:
    instances = [
        InstanceRow(**{f: getattr(m, f) for f in INSTANCE_FIELDS},
                    recent_ttft_ms=_optional(m, "recent_ttft_ms"),
                    recent_itl_ms=_optional(m, "recent_itl_ms"))
        for m in reply.instances
    ]
    stores = [StoreRow(**{f: getattr(m, f) for f in STORE_FIELDS},
                       counters=msgspec.convert(dict(m.counters), TierCounters))
              for m in reply.stores]
    counters = msgspec.convert({**reply.placement_counters,
                                "by_prefill_instance": dict(reply.placements_by_prefill_instance)},
                               PlacementCounters)
    pools = PoolStatus(
        policy=reply.policy,
        pool_sizes={pool: dict(p.instances_by_phase) for pool, p in reply.pool_sizes.items()},
        instances=instances, stores=stores, counters=counters,
        recent_events=list(reply.recent_events),
        autoscale=autoscale_from_pb(reply.autoscale) if reply.HasField("autoscale") else None,
        cost_model=_cost_model(reply.cost_model) if reply.HasField("cost_model") else None)
    fronts = None
    if reply.HasField("fronts"):
        f = reply.fronts
        fronts = FrontAddresses(f.host_ip, _optional(f, "grpc_port"), _optional(f, "http_port"),
                                f.http_tls, f.grpc_host, f.http_host)
    return StatusView(pools, fronts, reply.cluster_name)


def scale_to_pb(results: list[ScaleResult]) -> apb.ScaleResponse:
    return apb.ScaleResponse(pools=[apb.PoolChange(**msgspec.structs.asdict(r)) for r in results])


def scale_from_pb(reply: apb.ScaleResponse) -> list[ScaleResult]:
    return [ScaleResult(p.role, p.size_before, p.size_after, list(p.added), list(p.removed),
                        list(p.pending), list(p.failed)) for p in reply.pools]


def drain_to_pb(result: DrainResult) -> apb.DrainResponse:
    return apb.DrainResponse(**msgspec.structs.asdict(result))


def drain_from_pb(reply: apb.DrainResponse) -> DrainResult:
    return DrainResult(reply.instance_id, reply.drained_requests, reply.drain_s)


def soft_pin_to_pb(pin: SoftPin) -> apb.SoftPin:
    return apb.SoftPin(name=pin.name, num_blocks=pin.num_blocks, num_tokens=pin.num_tokens,
                       present_blocks_by_node=pin.present_blocks_by_node)


def soft_pin_from_pb(reply: apb.SoftPin) -> SoftPin:
    return SoftPin(reply.name, reply.num_blocks, reply.num_tokens,
                   dict(reply.present_blocks_by_node))
