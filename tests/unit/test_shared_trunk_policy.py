"""The agent case: a system prompt every instance holds. Holders are priced by run, not one by
one (``GroupedHits``, the C pool scan); the choice must be exactly the slow reference's.

States are built the way the conductor builds them (``ConductorState`` over a real ``KvIndex``,
fed block holdings, with booked work and instances that are not ready), so the snapshots carry
every field the state adds for speed; the reference prices every instance with ``price`` over a
bare snapshot of the same pools and the plain ``prefix_hits`` dict.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from conductor.admission import Overloaded
from conductor.policy import POLICIES, ClusterSnapshot, PolicyConfig
from conductor.snapshot import GroupedHits
from conductor.state import ConductorState
from kvstore.keys import KeyExtras, block_keys
from protos.errors import NoWorkerReady
from protos.wire import PlacementRequest
from tests.unit.policy_oracles import baton_priced_choice, reference_choice

BS = 16
EXTRAS = KeyExtras("m", "", "", "L")
TRUNK = list(range(1, 1 + 6 * BS))  # 6 blocks of system prompt


def keys_of(tokens: list[int]) -> tuple[bytes, ...]:
    return tuple(block_keys(tokens, BS, EXTRAS))


class Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


@st.composite
def trunk_states(draw):
    """A fleet where (nearly) every instance holds the trunk, some hold private tails past it,
    some nodes hold parts in their host tier, with booked work, and a request: a warm agent
    (trunk, part of a tail, new tokens) or a new one (trunk, new tokens)."""
    clock = Clock()
    colocation = draw(st.sampled_from([{"short_prefill_tokens": 0}, {"short_prefill_tokens": 256}, {},
                                       {"tbt_slo_ms": 40.0}]))  # old rule, priced, priced with an SLO
    config = PolicyConfig(block_size_tokens=BS, kv_bytes_per_token=draw(st.sampled_from([1024, 160 * 1024])),
                          **colocation)
    name = draw(st.sampled_from(["baton", "mooncake"]))
    state = ConductorState(name, config, clock=clock)
    num_prefill, num_decode = draw(st.integers(1, 24)), draw(st.integers(1, 6))
    num_nodes = draw(st.integers(1, 4))
    ids = [f"p{i:02d}" for i in range(num_prefill)] + [f"d{i}" for i in range(num_decode)]
    for n, instance_id in enumerate(ids):
        state.register(instance_id, "prefill" if instance_id[0] == "p" else "decode",
                       f"n{draw(st.integers(0, num_nodes - 1)) if n % 3 else n % num_nodes}", "m", "L")
        state.set_ready(instance_id, True)
    trunk_keys = keys_of(TRUNK)
    tails = [list(range(10_000 * (a + 1), 10_000 * (a + 1) + 8 * BS)) for a in range(3)]
    without_trunk = draw(st.sets(st.sampled_from(ids), max_size=2))
    for instance_id in ids:
        if instance_id not in without_trunk:
            state.index.note_device_blocks(instance_id, trunk_keys[:draw(st.sampled_from([6, 6, 6, 3]))])
    for _ in range(draw(st.integers(0, 4))):  # private tails of other agents' histories
        agent, holder = draw(st.integers(0, 2)), draw(st.sampled_from(ids))
        tail_keys = keys_of(TRUNK + tails[agent])
        state.index.note_device_blocks(holder, tail_keys[:6 + draw(st.integers(1, 8))])
    for node in draw(st.sets(st.integers(0, num_nodes - 1), max_size=2)):  # host tier on a node
        state.index.add_node(f"n{node}")
        host_keys = keys_of(TRUNK + tails[0])[draw(st.integers(0, 5)):draw(st.integers(6, 14))]
        assert state.index.ingest_store(f"n{node}", 0, _host_batch(host_keys)) is None
    for k in range(draw(st.integers(0, 8))):  # booked work: queues, some tie-prone
        tokens = draw(st.sampled_from([TRUNK + list(range(900_000 + 100 * k, 900_000 + 100 * k + 3 * BS)),
                                       list(range(800_000 + 100 * k, 800_000 + 100 * k + 4 * BS))]))
        try:
            state.place(PlacementRequest(f"booked{k}", len(tokens), keys_of(tokens), 16))
        except NoWorkerReady:
            pass
        clock.now += draw(st.sampled_from([0.0, 0.0, 0.003, 0.2]))
    for instance_id in draw(st.sets(st.sampled_from(ids), max_size=2)):
        if draw(st.booleans()):
            state.set_draining(instance_id)
        else:
            state.update_load(instance_id, draw(st.integers(0, 3)), draw(st.floats(0, 1)))
    agent = draw(st.integers(0, 2))
    tokens = TRUNK + (tails[agent][:draw(st.integers(0, 8)) * BS] if draw(st.booleans()) else [])
    tokens += list(range(700_000, 700_000 + draw(st.integers(0, 5 * BS))))
    return name, state, PlacementRequest("next", len(tokens), keys_of(tokens), 32)


def _host_batch(host_keys) -> bytes:
    from kvstore.events import MEDIUM_HOST, BlockStored, KVEventBatch

    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=list(host_keys), parent_block_hash=None, token_ids=[], block_size=BS,
        lora_id=None, medium=MEDIUM_HOST, lora_name=None)]))


@settings(max_examples=150, deadline=None)
@given(scenario=trunk_states())
def test_the_grouped_fast_path_picks_exactly_what_pricing_every_instance_picks(scenario):
    name, state, request = scenario
    for _ in range(len(state.instance_ids())):  # each snapshot refreshes the stalest queues
        state.snapshot()
    fast = state.snapshot(state._prefix_hits(request.block_keys))
    assert isinstance(fast.prefix_hits, GroupedHits) or not fast.prefix_hits
    plain_hits = state.index.prefix_hits(request.block_keys)
    assert dict(fast.prefix_hits) == plain_hits  # every index instance is in a pool
    bare = ClusterSnapshot(fast.prefill, fast.decode, fast.num_placed, plain_hits)
    config = state.config
    try:
        placement = POLICIES[name](fast, request, config)
    except NoWorkerReady as e:
        with pytest.raises(NoWorkerReady, match=str(e)):
            POLICIES[name](bare, request, config)
        return
    assert POLICIES[name](bare, request, config) == placement  # the plain-dict path agrees too
    if name == "baton" and config.baton_colocation_mode == "priced":  # both pools priced
        chosen, decode_instance = baton_priced_choice(bare, request, config)
        assert placement.decode_instance == decode_instance
    elif placement.prefill_instance == placement.decode_instance and placement.prefill_instance[0] == "d":
        return  # the old rule's colocated branch: the decode instance by load, no scan
    else:
        chosen = reference_choice(name, bare, request, config)
    assert placement.prefill_instance == chosen.instance_id
    assert (placement.transfer_ms, placement.queue_ms, placement.prefill_ms) == (
        chosen.transfer_ms, chosen.queue_ms, chosen.prefill_ms)
    assert placement.expected_cached_blocks == chosen.num_cached_blocks
    assert placement.pulled_from == chosen.pulled_from
    try:
        # what the conductor's own call decides (it adds what the index says of the device)
        assert msgspec.structs.replace(state.place(request), device_blocks=-1) == placement
    except Overloaded as e:  # admission refused that very placement (its decode's TBT SLO)
        assert f" on {placement.decode_instance} " in str(e)
        event(f"{name}: refused by admission")
        return
    event(f"{name}: {'colocated' if placement.prefill_instance[0] == 'd' else 'disaggregated'}")
    event(f"{name}: {len(fast.prefix_hits.runs) if fast.prefix_hits else 0} runs, "
          f"{'pulled' if placement.pulled_from else 'local'}, "
          f"{'first' if placement.prefill_instance == fast.prefill[0].instance_id else 'other'}")


def test_with_the_trunk_everywhere_and_idle_queues_the_least_queue_wins():
    """Every instance holds the trunk: the queue alone decides, first listed on ties."""
    clock = Clock()
    state = ConductorState("baton", PolicyConfig(block_size_tokens=BS, short_prefill_tokens=0), clock=clock)
    for instance_id, role in (("p0", "prefill"), ("p1", "prefill"), ("p2", "prefill"), ("d0", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)
        state.index.note_device_blocks(instance_id, keys_of(TRUNK))
    new_agent = TRUNK + list(range(500, 500 + 2 * BS))
    first = state.place(PlacementRequest("a", len(new_agent), keys_of(new_agent), 8))
    assert (first.prefill_instance, first.expected_cached_blocks, first.queue_ms) == ("p0", 6, 0.0)
    second = state.place(PlacementRequest("b", len(new_agent), keys_of(new_agent), 8))
    assert second.prefill_instance == "p1"  # p0 has a's prefill queued


def test_the_best_source_is_the_first_ready_holder_prefill_pool_first():
    """One run held by p0 (not ready), p1 and d0: p1, the first ready holder in pool order."""
    from conductor.policy import InstanceView, PrefixHit
    from conductor.pricing import best_hit_source

    prefill = (InstanceView("p0", ready=False), InstanceView("p1"), InstanceView("p2"))
    decode = (InstanceView("d0"),)
    hits = {"p0": PrefixHit(4), "p1": PrefixHit(4), "d0": PrefixHit(4), "p2": PrefixHit(2)}
    for prefix_hits in (hits, GroupedHits.of(hits, prefill, decode)):
        snapshot = ClusterSnapshot(prefill, decode, 0, prefix_hits)
        assert best_hit_source(snapshot, include_decode=True).instance_id == "p1"
    only_decode = {"p0": PrefixHit(4), "d0": PrefixHit(4)}
    snapshot = ClusterSnapshot(prefill, decode, 0, GroupedHits.of(only_decode, prefill, decode))
    assert best_hit_source(snapshot, include_decode=True).instance_id == "d0"
    assert best_hit_source(snapshot, include_decode=False) is None
