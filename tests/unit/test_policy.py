"""Placement policies are pure functions: exact choices for given snapshots."""

from __future__ import annotations

import pytest

from conductor.errors import NoWorkerReady
from conductor.policy import (
    POLICIES,
    ClusterSnapshot,
    InstanceView,
    PlacementRequest,
    PolicyConfig,
    least_loaded,
    round_robin,
)

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
