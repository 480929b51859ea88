"""Placement policies: pure functions from a cluster snapshot and a request to a placement.

``select(snapshot, request, config) -> Placement``. The live conductor and the trace simulator
call the same functions, so what the simulator measures is the code that serves. A policy never
does I/O and never mutates its inputs; state it needs (a round-robin cursor) is in the snapshot.
"""

from __future__ import annotations

from typing import Callable

import msgspec

from conductor.errors import NoWorkerReady
from engine.messages import Placement


class InstanceView(msgspec.Struct, frozen=True):
    """What a policy may know about one instance."""

    instance_id: str
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    ready: bool = True


class ClusterSnapshot(msgspec.Struct, frozen=True):
    """The pools at one instant, plus the count of placements made so far (the RR cursor)."""

    prefill: tuple[InstanceView, ...]
    decode: tuple[InstanceView, ...]
    num_placed: int = 0


class PlacementRequest(msgspec.Struct, frozen=True):
    request_id: str
    num_prompt_tokens: int


class PolicyConfig(msgspec.Struct, frozen=True):
    """Knobs shared by the simple policies (the cost-aware ones add their own)."""


Policy = Callable[[ClusterSnapshot, PlacementRequest, PolicyConfig], Placement]


def _ready(pool: tuple[InstanceView, ...], role: str) -> tuple[InstanceView, ...]:
    ready = tuple(view for view in pool if view.ready)
    if not ready:
        raise NoWorkerReady(f"no {role} instance is ready; retry in a few seconds")
    return ready


def round_robin(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """The n-th placement goes to instance n mod size of each pool (ready instances only)."""
    prefill = _ready(snapshot.prefill, "prefill")
    decode = _ready(snapshot.decode, "decode")
    p = prefill[snapshot.num_placed % len(prefill)]
    d = decode[snapshot.num_placed % len(decode)]
    return Placement(p.instance_id, d.instance_id, "round_robin", f"cursor={snapshot.num_placed}")


def _load(view: InstanceView) -> int:
    return view.num_running_reqs + view.num_waiting_reqs


def least_loaded(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Fewest running + waiting requests in each pool; ties go to the first instance listed."""
    p = min(_ready(snapshot.prefill, "prefill"), key=_load)
    d = min(_ready(snapshot.decode, "decode"), key=_load)
    return Placement(
        p.instance_id, d.instance_id, "least_loaded", f"prefill_load={_load(p)} decode_load={_load(d)}"
    )


POLICIES: dict[str, Policy] = {"round_robin": round_robin, "least_loaded": least_loaded}
