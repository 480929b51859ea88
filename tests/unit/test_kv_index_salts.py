"""The index under segmented salts (``kvstore.keys``): an engine's device blocks stay keyed with
the whole-prompt salt (what vLLM's cache can share), the store's tiers carry the requests'
segmented keys (the unsalted trunk is shared across salts)."""

from __future__ import annotations

import msgspec

from conductor.kv_index import KvIndex
from conductor.policy import PrefixHit
from kvstore.events import BlockStored, KVEventBatch
from kvstore.keys import KeyExtras, block_keys

BS = 4
MODEL, LAYOUT = "m", "float32:4"
TRUNK = list(range(100, 112))  # 3 full blocks
SUFFIX_A, SUFFIX_B = list(range(500, 508)), list(range(600, 608))  # 2 blocks each


def segmented(tokens, salt, offset):
    return block_keys(tokens, BS, KeyExtras(MODEL, salt, "", LAYOUT, salt_from_block=offset // BS))


def payload(*events):
    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=list(events)))


def stored(hashes, tokens, medium, extra_keys=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=list(tokens),
                       block_size=BS, lora_id=None, medium=medium, lora_name=None,
                       extra_keys=extra_keys)


def test_another_salt_reaches_the_stores_trunk_and_no_device_block_and_nothing_after():
    index = KvIndex()
    index.add_instance("p0", "node-a", MODEL, LAYOUT)
    index.add_instance("p1", "node-b", MODEL, LAYOUT)
    prompt_a = TRUNK + SUFFIX_A
    # tenant A's prefill on p0: vLLM's blocks salted from the first block ...
    index.ingest_engine("p0", 0, payload(stored([1, 2, 3, 4, 5], prompt_a, "GPU",
                                                extra_keys=[["A"], None, None, None, None])))
    # ... and node-a's store holding them under A's segmented keys (salt from the trunk's end)
    keys_a = segmented(prompt_a, "A", len(TRUNK))
    index.ingest_store("node-a", 0, payload(stored(keys_a, [], "CPU")))

    # A again: its own device blocks are not under its segmented keys; the store's are
    assert index.prefix_hits(keys_a) == {"p0": PrefixHit(0, 5, 0)}
    # B with its own suffix, and B asking for A's very suffix: the trunk only, from the store
    b_own = segmented(TRUNK + SUFFIX_B, "B", len(TRUNK))
    b_for_a = segmented(prompt_a, "B", len(TRUNK))
    assert index.prefix_hits(b_own) == index.prefix_hits(b_for_a) == {"p0": PrefixHit(0, 3, 0)}
    # whole-prompt salts share nothing, anywhere; A's whole-prompt keys meet vLLM's device blocks
    assert index.prefix_hits(segmented(prompt_a, "B", 0)) == {}
    assert index.prefix_hits(segmented(prompt_a, "A", 0)) == {"p0": PrefixHit(5, 0, 0)}
