"""The conductor's KV index: events in, per-instance prefix hits by tier out."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from conductor.kv_index import KvIndex, StreamGap
from conductor.policy import PrefixHit
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstore.keys import KeyExtras, block_keys

BS = 4
MODEL, LAYOUT = "m", "float32:4"
PROMPT = list(range(100, 124))  # 6 full blocks


def keys(tokens=PROMPT, salt=""):
    return block_keys(tokens, BS, KeyExtras(MODEL, salt, "", LAYOUT))


def stored(hashes, parent, tokens, extra_keys=None, medium="GPU"):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=BS, lora_id=None, medium=medium, lora_name=None, extra_keys=extra_keys)


def payload(*events):
    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=list(events)))


@pytest.fixture
def index():
    ix = KvIndex()
    ix.add_instance("p0", "node-a", MODEL, LAYOUT)
    ix.add_instance("p1", "node-a", MODEL, LAYOUT)
    ix.add_instance("p2", "node-b", MODEL, LAYOUT)
    return ix


def test_engine_blocks_are_translated_to_baton_chain_keys(index):
    # Two events: the first three blocks, then three more chained on vLLM's hash of block 3.
    assert index.ingest_engine("p0", 0, payload(stored([11, 12, 13], None, PROMPT[:12]))) is None
    assert index.ingest_engine("p0", 1, payload(stored([14, 15, 16], 13, PROMPT[12:]))) is None
    assert index.prefix_hits(keys()) == {"p0": PrefixHit(6, 0, 0)}
    # A prompt sharing the first two blocks only.
    other = PROMPT[:8] + [1] * 16
    assert index.prefix_hits(keys(other)) == {"p0": PrefixHit(2, 0, 0)}


def test_cache_salt_from_vllm_extra_keys_enters_the_root(index):
    index.ingest_engine("p0", 0, payload(stored([1, 2], None, PROMPT[:8], extra_keys=[["tenant-a"], None])))
    assert index.prefix_hits(keys(salt="tenant-a")) == {"p0": PrefixHit(2, 0, 0)}
    assert index.prefix_hits(keys()) == {}
    assert index.prefix_hits(keys(salt="tenant-b")) == {}


def test_removed_and_cleared(index):
    index.ingest_engine("p0", 0, payload(stored([1, 2, 3], None, PROMPT[:12])))
    index.ingest_engine("p0", 1, payload(BlockRemoved(block_hashes=[3], medium="GPU")))
    assert index.prefix_hits(keys()) == {"p0": PrefixHit(2, 0, 0)}
    index.ingest_engine("p0", 2, payload(BlockRemoved(block_hashes=[1], medium="GPU")))
    assert index.prefix_hits(keys()) == {}  # block 2 is held but the run starts with a miss
    index.ingest_engine("p0", 3, payload(AllBlocksCleared()))
    assert index.num_blocks()["device"] == 0
    assert index.num_resyncs == 0  # a clean restart is not a repair


def test_store_tiers_count_for_every_instance_on_the_node(index):
    k = keys()
    index.ingest_store("node-a", 0, payload(stored(k[:4], None, [], medium="CPU")))
    index.ingest_store("node-a", 1, payload(stored(k[4:5], None, [], medium="DISK")))
    index.ingest_engine("p1", 0, payload(stored([1, 2], None, PROMPT[:8])))
    assert index.prefix_hits(k) == {
        "p0": PrefixHit(0, 4, 1),
        "p1": PrefixHit(2, 2, 1),  # each block counted once, in its fastest tier
    }
    index.ingest_store("node-a", 2, payload(BlockRemoved(block_hashes=k[2:3], medium="CPU")))
    assert index.prefix_hits(k) == {"p0": PrefixHit(0, 2, 0), "p1": PrefixHit(2, 0, 0)}


def test_a_sequence_gap_is_returned_and_not_applied(index):
    index.ingest_engine("p0", 0, payload(stored([1], None, PROMPT[:4])))
    gap = index.ingest_engine("p0", 2, payload(stored([2], 1, PROMPT[4:8])))
    assert gap == StreamGap("p0", 1, 2)
    assert index.prefix_hits(keys()) == {"p0": PrefixHit(1, 0, 0)}
    index.clear_instance("p0")  # the caller could not replay: drop what the stream said
    assert index.prefix_hits(keys()) == {}
    assert index.num_resyncs == 1
    assert index.ingest_engine("p0", 7, payload(stored([1], None, PROMPT[:4]))) is None  # fresh start
    assert index.prefix_hits(keys()) == {"p0": PrefixHit(1, 0, 0)}


def test_store_gap_and_node_clear(index):
    k = keys()
    index.ingest_store("node-b", 0, payload(stored(k[:2], None, [], medium="CPU")))
    assert index.ingest_store("node-b", 5, payload(stored(k[2:3], None, [], medium="CPU"))) == \
        StreamGap("node-b", 1, 5)
    index.clear_node("node-b")
    assert index.prefix_hits(k) == {}


def test_unknown_parent_is_counted_not_guessed(index):
    index.ingest_engine("p0", 0, payload(stored([9], 12345, PROMPT[4:8])))
    assert index.num_untranslatable_blocks == 1
    assert index.num_blocks()["device"] == 0


def test_token_ids_outside_uint32_are_counted_not_hashed(index):
    too_large = PROMPT[:7] + [2**32]
    index.ingest_engine("p0", 0, payload(stored([1, 2], None, too_large)))
    index.apply_engine_events("p1", [stored([3, 4], None, too_large)])  # decoded in Python: a list
    assert index.num_untranslatable_blocks == 4
    assert index.num_blocks()["device"] == 0
    index.ingest_engine("p0", 1, payload(stored([1, 2], None, PROMPT[:8])))
    index.apply_engine_events("p1", [stored([3, 4], None, PROMPT[:8])])
    assert index.prefix_hits(keys()) == {"p0": PrefixHit(2, 0, 0), "p1": PrefixHit(2, 0, 0)}


def test_removed_instance_frees_its_bit_and_entries(index):
    index.ingest_engine("p0", 0, payload(stored([1, 2], None, PROMPT[:8])))
    index.remove_instance("p0")
    assert index.prefix_hits(keys()) == {}
    index.add_instance("p3", "node-b", MODEL, LAYOUT)  # reuses p0's bit: must start empty
    assert index.prefix_hits(keys()) == {}
    assert index.ingest_engine("p0", 1, payload(stored([1], None, PROMPT[:4]))) is None  # ignored
    assert index.prefix_hits(keys()) == {}


def test_noted_blocks_count_until_forgotten(index):
    k = keys()
    index.note_device_blocks("p2", k[:3])
    assert index.prefix_hits(k) == {"p2": PrefixHit(3, 0, 0)}
    index.forget_device_blocks("p2", k[1:3])
    assert index.prefix_hits(k) == {"p2": PrefixHit(1, 0, 0)}


@pytest.mark.vllm
def test_vllm_encoded_batches_decode():
    from vllm.distributed.kv_events import BlockStored as VllmStored
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

    ix = KvIndex()
    ix.add_instance("p0", "n", MODEL, LAYOUT)
    event = VllmStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=PROMPT[:8],
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=[("salt",), None])
    ix.ingest_engine("p0", 0, msgspec.msgpack.encode(VllmBatch(ts=1.0, events=[event])))
    assert ix.prefix_hits(keys(salt="salt")) == {"p0": PrefixHit(2, 0, 0)}


def test_duplicates_are_skipped_and_a_restart_at_zero_starts_over(index):
    index.ingest_engine("p0", 0, payload(stored([1], None, PROMPT[:4])))
    index.ingest_engine("p0", 1, payload(stored([2], 1, PROMPT[4:8])))
    assert index.ingest_engine("p0", 1, payload(BlockRemoved(block_hashes=[1], medium="GPU"))) is None
    assert index.num_duplicates == 1
    assert index.prefix_hits(keys()) == {"p0": PrefixHit(2, 0, 0)}  # the duplicate was not applied
    index.ingest_engine("p0", 0, payload(stored([7], None, PROMPT[:4])))  # publisher restarted
    assert index.prefix_hits(keys()) == {"p0": PrefixHit(1, 0, 0)}


def test_losing_the_very_first_batch_of_a_new_stream_is_a_gap(index):
    assert index.ingest_engine("p1", 1, payload(stored([1], None, PROMPT[:4]))) == StreamGap("p1", 0, 1)
    index.add_node("node-c")
    k = keys()
    assert index.ingest_store("node-c", 2, payload(stored(k[:1], None, [], medium="CPU"))) == \
        StreamGap("node-c", 0, 2)


def walk_prefix_hits(index: KvIndex, key_list) -> dict[str, PrefixHit]:
    """The definition ``prefix_hits`` must match: walk the keys in order; an instance's run ends
    at the first key it reaches in no tier; each block counts in its fastest tier."""
    runs: dict[str, list[str]] = {}
    for instance_id in index.instance_ids():
        inst = index._instances[instance_id]
        node_bit = 1 << index._nodes[inst.node_id].bit
        tiers = []
        for key in key_list:
            if index._device.get(key, 0) >> inst.bit & 1:
                tiers.append("device")
            elif index._host.get(key, 0) & node_bit:
                tiers.append("host")
            elif index._disk.get(key, 0) & node_bit:
                tiers.append("disk")
            else:
                break
        if tiers:
            runs[instance_id] = tiers
    return {i: PrefixHit(t.count("device"), t.count("host"), t.count("disk")) for i, t in runs.items()}


def grouped_as_plain(index: KvIndex, key_list) -> dict[str, PrefixHit]:
    """``prefix_run_groups`` as the plain mapping, checking its shape on the way: bits ascending,
    each run distinct and used."""
    groups = index.prefix_run_groups(key_list)
    bits, run_of = groups.bits.tolist(), groups.run_of.tolist()
    assert bits == sorted(set(bits)) and len(run_of) == len(bits)
    assert len(set(groups.runs)) == len(groups.runs) and set(run_of) == set(range(len(groups.runs)))
    assert all(run.num_blocks for run in groups.runs)
    assert all(index.bit_of(index._instance_ids[b]) == b for b in bits)
    return {index._instance_ids[b]: groups.runs[r] for b, r in zip(bits, run_of)}


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_prefix_hits_matches_the_walk_on_random_holdings(data):
    """Random holdings of a 12-block prompt across 5 instances on 2 nodes, in all three tiers
    (runs with holes, store-only holders, nodes with no instance): the vectorised walk gives
    exactly what the key-by-key definition gives."""
    index = KvIndex()
    for i in range(5):
        index.add_instance(f"p{i}", f"node-{i % 2}", MODEL, LAYOUT)
    index.add_node("node-empty")
    prompt = list(range(48))
    prompt_keys = keys(prompt)
    for instance_id in index.instance_ids():
        held = data.draw(st.lists(st.booleans(), min_size=12, max_size=12))
        index.note_device_blocks(instance_id, [k for k, h in zip(prompt_keys, held) if h])
    for node in ("node-0", "node-1", "node-empty"):
        for medium in ("CPU", "DISK"):
            held = data.draw(st.lists(st.booleans(), min_size=12, max_size=12))
            hashes = [k for k, h in zip(prompt_keys, held) if h]
            index.apply_store_events(node, [stored(hashes, None, [], medium=medium)])
    length = data.draw(st.integers(0, 12))
    assert index.prefix_hits(prompt_keys[:length]) == walk_prefix_hits(index, prompt_keys[:length])
    assert grouped_as_plain(index, prompt_keys[:length]) == walk_prefix_hits(index, prompt_keys[:length])


def test_entries_with_the_same_holders_share_one_mask_object():
    """A million entries held by the same few instances point at a few int objects (bit 11:
    not one of the small ints Python keeps once anyway)."""
    index = KvIndex()
    for i in range(12):
        index.add_instance(f"p{i}", f"node-{i}", MODEL, LAYOUT)
    index.ingest_engine("p11", 0, payload(stored(range(1, 7), None, PROMPT)))
    other = list(range(500, 524))
    index.ingest_engine("p11", 1, payload(stored(range(11, 17), None, other)))
    values = [index._device[k] for k in keys() + keys(other)]
    assert len({id(v) for v in values}) == 1 and values[0] == 1 << 11
    index.apply_store_events("node-11", [stored(keys(), None, [], medium="CPU")])
    index.apply_store_events("node-11", [stored(keys(other), None, [], medium="CPU")])
    host_values = [index._host[k] for k in keys() + keys(other)]
    assert len({id(v) for v in host_values}) == 1


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_prefix_hits_matches_the_walk_across_many_instances(data):
    """150 instances (masks of three 64-bit words) on 10 nodes: runs of random lengths with random
    holes, store tiers on random nodes; the walk in C gives what the key-by-key definition gives."""
    index = KvIndex()
    for i in range(150):
        index.add_instance(f"p{i}", f"node-{i % 10}", MODEL, LAYOUT)
    prompt_keys = keys(list(range(32)))
    for i, run in enumerate(data.draw(st.lists(st.integers(0, 8), min_size=150, max_size=150))):
        index.note_device_blocks(f"p{i}", prompt_keys[:run])
    for i, block in data.draw(st.lists(st.tuples(st.integers(0, 149), st.integers(0, 7)), max_size=40)):
        index.forget_device_blocks(f"p{i}", [prompt_keys[block]])
    for node in range(10):
        for medium in ("CPU", "DISK"):
            held = data.draw(st.lists(st.booleans(), min_size=8, max_size=8))
            index.apply_store_events(f"node-{node}", [stored([k for k, h in zip(prompt_keys, held) if h],
                                                             None, [], medium=medium)])
    assert index.prefix_hits(prompt_keys) == walk_prefix_hits(index, prompt_keys)
    assert grouped_as_plain(index, prompt_keys) == walk_prefix_hits(index, prompt_keys)


@settings(max_examples=100, deadline=None)
@given(trunk=st.integers(1, 20), tails=st.lists(st.integers(0, 12), min_size=1, max_size=130),
       host_from=st.integers(0, 32), cut=st.lists(st.tuples(st.integers(0, 129), st.integers(0, 31)), max_size=6))
def test_a_trunk_every_instance_holds_groups_into_few_runs(trunk, tails, host_from, cut):
    """The agent case: one trunk on every instance (long stretches of keys with the same holder
    masks, which the walk counts once per stretch), private tails on some, the trunk's end also
    in one node's host tier, a few holes: grouped and plain, both equal the key-by-key walk."""
    index = KvIndex()
    for i in range(len(tails)):
        index.add_instance(f"p{i}", f"node-{i % 8}", MODEL, LAYOUT)
    prompt_keys = keys(list(range(32 * 4)))
    for i, tail in enumerate(tails):
        index.note_device_blocks(f"p{i}", prompt_keys[:trunk + tail])
    for i, block in cut:
        if i < len(tails):
            index.forget_device_blocks(f"p{i}", [prompt_keys[block]])
    index.apply_store_events("node-0", [stored(prompt_keys[host_from:], None, [], medium="CPU")])
    expected = walk_prefix_hits(index, prompt_keys)
    assert index.prefix_hits(prompt_keys) == expected
    assert grouped_as_plain(index, prompt_keys) == expected
