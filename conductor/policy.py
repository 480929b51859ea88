"""The placement policies by name, and the names policies are built from.

A policy is ``select(snapshot, request, config) -> Placement``: a pure function (no I/O, inputs
untouched, the same placement for the same inputs) from a ``ClusterSnapshot`` and a
``PlacementRequest`` to a ``Placement`` whose ``reason`` carries the numbers it chose on. Whatever
state a choice depends on (the round-robin cursor and seed, the queues the conductor booked, the
KV index) comes in the snapshot and the request, so the live conductor and the trace simulator,
which call the same functions through ``ConductorState``, make the same choices.

Where things live: the inputs in ``conductor.snapshot``, the knobs in ``conductor.policy_config``,
the prefill price and the pool scan in ``conductor.pricing``, admission in
``conductor.admission``, the baselines in ``conductor.baselines``, Baton's policy in
``conductor.baton_policy``. The names below are re-exported so that ``conductor.policy`` remains
the one place to import them from.
"""

from __future__ import annotations

from typing import Callable

from conductor.admission import Overloaded, admit
from conductor.baselines import (
    dynamo_kv,
    least_loaded,
    mooncake,
    random,
    round_robin,
    sglang_cache_aware,
    sglang_trees,
)
from conductor.baton_policy import baton
from conductor.picking import SERVES_WITHOUT_PREFILL_POOL
from conductor.policy_config import PolicyConfig
from conductor.pricing import PrefillPrice, price, with_prices
from conductor.snapshot import (
    NO_HIT,
    ClusterSnapshot,
    InstanceView,
    LoadArrays,
    PoolArrays,
    PrefixHit,
)
from protos.wire import Placement, PlacementRequest

__all__ = [
    "NO_HIT", "POLICIES", "ROUTER_STATES", "SERVES_WITHOUT_PREFILL_POOL", "ClusterSnapshot", "InstanceView",
    "LoadArrays", "Overloaded", "Placement", "PlacementRequest", "Policy", "PolicyConfig",
    "PoolArrays", "PrefillPrice", "PrefixHit", "admit", "baton", "dynamo_kv", "least_loaded",
    "mooncake", "price", "random", "round_robin", "sglang_cache_aware", "with_prices",
]

Policy = Callable[[ClusterSnapshot, PlacementRequest, PolicyConfig], Placement]

POLICIES: dict[str, Policy] = {
    "random": random,
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "sglang_cache_aware": sglang_cache_aware,
    "dynamo_kv": dynamo_kv,
    "mooncake": mooncake,
    "baton": baton,
}
"""Every policy by the name ``conductor.policy`` takes in the cluster config."""

ROUTER_STATES: dict[str, Callable[[PolicyConfig], object]] = {"sglang_cache_aware": sglang_trees}
"""Policies that learn from their own routing history: the state ``ConductorState`` keeps for
them (passed as ``ClusterSnapshot.router_state``), with ``maintain(now_s)`` before each
decision, ``record(block_keys, prefill_instance)`` after each placement and
``remove_worker(instance_id)`` when an instance leaves."""
