"""What every policy picks with: the ready instances of a pool, the decode choice by load, and
the per-request seeded generator.

All pure: the same snapshot and request give the same answer. The one rule about an empty pool
lives here too: only the policies in ``SERVES_WITHOUT_PREFILL_POOL`` serve without a prefill pool,
every other one is told ``NoWorkerReady`` with what to change.
"""

from __future__ import annotations

import hashlib
import random as _random

from conductor import _scan
from conductor.snapshot import ClusterSnapshot, InstanceView, load
from protos.errors import NoWorkerReady
from protos.wire import PlacementRequest

SERVES_WITHOUT_PREFILL_POOL = frozenset({"baton"})
"""Policies that can prefill every request on its decode instance, so a cluster with an empty
prefill pool (``prefill.num_instances: 0``) serves fully co-located with them."""


def ready(snapshot: ClusterSnapshot, role: str) -> tuple[InstanceView, ...]:
    """The ready instances of one pool, in pool order (the pool itself when all are ready)."""
    pool = snapshot.prefill if role == "prefill" else snapshot.decode
    if not pool and role == "prefill":
        raise NoWorkerReady(
            "the prefill pool has no instances; only the policies "
            f"{sorted(SERVES_WITHOUT_PREFILL_POOL)} serve co-located without one: set "
            "prefill.num_instances >= 1 or conductor.policy=baton"
        )
    views = snapshot.ready_prefill if role == "prefill" else snapshot.ready_decode
    if views is None:
        views = [view for view in pool if view.ready]
        views = pool if len(views) == len(pool) else tuple(views)
    if not views:
        raise NoWorkerReady(f"no {role} instance is ready; retry in a few seconds")
    return views


def seeded_rng(snapshot: ClusterSnapshot, request: PlacementRequest) -> _random.Random:
    """A generator seeded from the request id and the placement count: same inputs, same draws."""
    digest = hashlib.blake2b(f"{request.request_id}\0{snapshot.num_placed}".encode(), digest_size=8)
    return _random.Random(int.from_bytes(digest.digest(), "little"))


def decode_by_load(snapshot: ClusterSnapshot) -> InstanceView:
    """Fewest running + waiting sequences, then lowest KV use, then fewest active blocks; the
    first listed on ties."""
    views = ready(snapshot, "decode")
    arrays = snapshot.decode_arrays
    if arrays is not None:  # one C pass over the pool's load columns
        pool = snapshot.decode
        mask = None if views is pool else bytes([v.ready for v in pool])
        return pool[_scan.least_loaded(arrays.load, arrays.kv_usage_frac, arrays.active_blocks, mask)]
    # the load alone usually decides: the full key is built only for the instances tied on it
    least = min([v.num_running_reqs + v.num_waiting_reqs for v in views])
    tied = [v for v in views if v.num_running_reqs + v.num_waiting_reqs == least]
    if len(tied) == 1:
        return tied[0]
    return min(tied, key=lambda v: (v.kv_usage_frac, v.num_active_decode_blocks))


def decode_terms(view: InstanceView) -> str:
    """The decode choice's numbers, for a placement's reason."""
    return f"decode {view.instance_id}: load {load(view)}, kv {view.kv_usage_frac:.0%}"
