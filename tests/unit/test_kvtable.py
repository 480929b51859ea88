"""The KV index's C extension: the key table against a dict, BLAKE2b against hashlib, msgpack
token parsing, and chain keys against ``kvstore.keys``."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor._kvtable import KeyTable, blake2b_128, chain_keys_msgpack, msgpack_token_ids
from kvstore.keys import KeyExtras, block_keys, chain_keys, root_key

keys16 = st.binary(min_size=16, max_size=16)
# a small pool of keys, so that sequences revisit keys (or into held keys, drops of held keys)
key_pools = st.lists(keys16, min_size=1, max_size=40, unique=True)


class Model:
    """What ``KeyTable`` must do, as a dict."""

    def __init__(self) -> None:
        self.values: dict[bytes, int] = {}

    def or_bit(self, keys, bit, masks):
        for k in keys:
            value = self.values.get(k, 0) | bit
            self.values[k] = masks.setdefault(value, value)

    def and_keep(self, keys, keep, masks):
        for k in keys:
            if k in self.values:
                value = self.values[k] & keep
                if value:
                    self.values[k] = masks.setdefault(value, value)
                else:
                    del self.values[k]


@settings(max_examples=300, deadline=None)
@given(pool=key_pools, data=st.data())
def test_key_table_matches_a_dict(pool, data):
    table, model, masks = KeyTable(), Model(), {}
    ops = st.tuples(st.sampled_from(["or", "and_keep"]), st.lists(st.sampled_from(pool), max_size=20),
                    st.integers(0, 70))
    for op, keys, bit_no in data.draw(st.lists(ops, max_size=30)):
        if op == "or":
            table.or_bit(keys, 1 << bit_no, masks)
            model.or_bit(keys, 1 << bit_no, {})
        else:
            table.and_keep(keys, ~(1 << bit_no), masks)
            model.and_keep(keys, ~(1 << bit_no), {})
        assert len(table) == len(model.values)
        for k in pool:
            assert (k in table) == (k in model.values)
            assert table.get(k, 0) == model.values.get(k, 0)
    for k, v in model.values.items():
        assert table[k] == v
        assert table[k] is masks[v]  # interned: one object per distinct mask


@settings(max_examples=20, deadline=None)
@given(seed_keys=st.lists(keys16, min_size=1, max_size=5, unique=True), data=st.data())
def test_key_table_grows_and_deletes_through_many_keys(seed_keys, data):
    """Thousands of keys (several growths), then deleting a random half: backward-shift deletion
    must keep every remaining key findable."""
    keys = [hashlib.sha256(s + i.to_bytes(4, "little")).digest()[:16]
            for s in seed_keys for i in range(800)]
    keys = list(dict.fromkeys(keys))
    table, masks = KeyTable(), {}
    table.or_bit(keys, 1 << 3, masks)
    assert len(table) == len(keys)
    gone = set(data.draw(st.lists(st.sampled_from(keys), max_size=len(keys) // 2)))
    table.and_keep(gone, ~(1 << 3), masks)
    assert len(table) == len(keys) - len(gone)
    assert [table.get(k, 0) for k in keys] == [0 if k in gone else 8 for k in keys]


def test_key_table_edges():
    table, masks = KeyTable(), {}
    k = b"k" * 16
    assert table.get(k) is None and table.get(b"short") is None
    assert b"not a key" not in table and 7 not in table
    with pytest.raises(KeyError):
        table[k]
    with pytest.raises(TypeError, match="16 bytes"):
        table.or_bit([b"short"], 1, masks)
    with pytest.raises(TypeError):
        KeyTable(3)
    table.and_keep([b"short", None, k], 0, masks)  # absent or not keys: nothing to drop
    table.or_bit((k,), 1 << 100, masks)
    assert table.get(k) == 1 << 100 and len(table) == 1
    table.and_keep([k], 0, masks)
    assert len(table) == 0 and not table


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), person=st.binary(max_size=16))
def test_blake2b_equals_hashlib(data, person):
    assert blake2b_128(data, person) == hashlib.blake2b(data, digest_size=16, person=person).digest()


def test_blake2b_block_boundaries_and_person_limit():
    for n in (0, 1, 111, 127, 128, 129, 255, 256, 257, 1000):
        data = bytes(range(256)) * 4
        assert blake2b_128(data[:n], b"baton.block.v1") == \
            hashlib.blake2b(data[:n], digest_size=16, person=b"baton.block.v1").digest()
    with pytest.raises(ValueError):
        blake2b_128(b"", b"x" * 17)


def packed(tokens):
    return struct.pack(f"<{len(tokens)}I", *tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=700))
def test_msgpack_token_ids_parse_what_msgspec_encodes(tokens):
    assert msgpack_token_ids(msgspec.msgpack.encode(tokens)) == packed(tokens)


@pytest.mark.parametrize("encoded, value", [
    (b"\x7f", 127),                          # positive fixint
    (b"\xcc\x80", 128),                      # uint8
    (b"\xcd\x01\x00", 256),                  # uint16
    (b"\xce\xff\xff\xff\xff", 2**32 - 1),    # uint32
    (b"\xcf\x00\x00\x00\x00\x00\x01\x00\x00", 65536),  # uint64 holding a uint32
    (b"\xd0\x05", 5),                        # int8..int64 holding non-negative values
    (b"\xd1\x01\x00", 256),
    (b"\xd2\x00\x01\x00\x00", 65536),
    (b"\xd3\x00\x00\x00\x00\x7f\xff\xff\xff", 2**31 - 1),
])
def test_every_msgpack_int_width(encoded, value):
    assert msgpack_token_ids(b"\x91" + encoded) == packed([value])
    assert msgpack_token_ids(b"\xdc\x00\x02" + encoded * 2) == packed([value, value])  # array16
    assert msgpack_token_ids(b"\xdd\x00\x00\x00\x01" + encoded) == packed([value])  # array32


@pytest.mark.parametrize("raw", [
    b"",                                     # nothing
    b"\x80",                                 # a map, not an array
    b"\x91\xcf\x00\x00\x00\x01\x00\x00\x00\x00",  # 2**32: too large
    b"\x91\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # 2**64 - 1
    b"\x91\xff",                             # negative fixint
    b"\x91\xd0\xff",                         # int8 -1
    b"\x91\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 min
    b"\x91\xc0",                             # nil
    b"\x91\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00",  # float64 1.0
    b"\x91\xa1a",                            # a string
    b"\x91\x91\x01",                         # a nested array
    b"\x92\x01",                             # truncated: 2 elements announced, 1 present
    b"\x91\xcd\x01",                         # truncated inside an element
    b"\xdc\x00",                             # truncated header
    b"\x91\x01\x02",                         # bytes after the array
])
def test_bad_token_ids_raise_value_error(raw):
    with pytest.raises(ValueError):
        msgpack_token_ids(raw)
    with pytest.raises(ValueError):
        chain_keys_msgpack(b"p" * 16, raw, 1)


@settings(max_examples=200, deadline=None)
@given(parent=keys16, tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
       block_size=st.integers(1, 40))
def test_chain_keys_equal_kvstore_keys(parent, tokens, block_size):
    assert chain_keys_msgpack(parent, msgspec.msgpack.encode(tokens), block_size) == \
        chain_keys(parent, tokens, block_size)


def test_chain_keys_from_the_root_are_block_keys():
    extras = KeyExtras("m", "salt", "", "bf16:16")
    tokens = list(range(1000, 1100))
    assert chain_keys_msgpack(root_key(extras), msgspec.msgpack.encode(tokens), 16) == \
        block_keys(tokens, 16, extras)
    assert len(block_keys(tokens, 16, extras)) == 6


def test_chain_keys_refuse_a_bad_parent_or_block_size():
    raw = msgspec.msgpack.encode([1, 2, 3, 4])
    with pytest.raises(ValueError, match="parent"):
        chain_keys_msgpack(b"short", raw, 2)
    with pytest.raises(ValueError, match="block_size"):
        chain_keys_msgpack(b"p" * 16, raw, 0)
