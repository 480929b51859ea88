"""Segmented salts: a ``cache_salt`` from block k on (``KeyExtras.salt_from_block``).

A public trunk of k blocks keys as if unsalted, so two tenants share exactly those keys and none
after; the salted link has its own hash kind; offset 0 is byte-for-byte today's whole-prompt salt.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.keys import (
    KeyExtras,
    block_keys,
    continue_keys,
    first_salted_block,
    hash_block,
    key_hex,
    parent_key,
    prompt_block_keys,
    root_key,
    salted_link,
)

BS = 4
UNSALTED = KeyExtras("m", "", "", "f32:4")


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 150_000, size=n).tolist()


def seg(salt: str, k: int) -> KeyExtras:
    return KeyExtras("m", salt, "", "f32:4", salt_from_block=k)


def test_offset_zero_keeps_every_key_byte_identical():
    # the golden keys of test_block_keys, with the new field spelled out
    keys = block_keys(list(range(8)), 4, KeyExtras(model_id="m", cache_salt="s", salt_from_block=0))
    assert [key_hex(k) for k in keys] == [
        "90a7da921865e6d00005238abfe36e8d",
        "ce161c0b8519668c10e39d1df52ca80d",
    ]
    prompt = tokens(23)
    assert prompt_block_keys(prompt, BS, seg("A", 0)) == prompt_block_keys(
        prompt, BS, KeyExtras("m", "A", "", "f32:4"))


def test_a_segment_without_a_salt_is_the_unsalted_chain():
    prompt = tokens(23)
    assert prompt_block_keys(prompt, BS, seg("", 3)) == prompt_block_keys(prompt, BS, UNSALTED)


def test_two_salts_share_exactly_the_trunk():
    prompt = tokens(10 * BS)
    k = 3
    a, b = block_keys(prompt, BS, seg("A", k)), block_keys(prompt, BS, seg("B", k))
    unsalted = block_keys(prompt, BS, UNSALTED)
    assert a[:k] == b[:k] == unsalted[:k]
    assert all(x != y for x, y in zip(a[k:], b[k:]))
    assert not set(a[k:]) & set(b[k:]) and not set(a[k:]) & set(unsalted)
    # ... and the salted part is not the whole-prompt salted chain either
    assert not set(a) & set(block_keys(prompt, BS, KeyExtras("m", "A", "", "f32:4")))


def test_the_salted_link_is_the_documented_hash():
    prompt = tokens(6 * BS)
    keys = block_keys(prompt, BS, seg("A", 2))
    link = hashlib.blake2b(keys[1] + struct.pack("<I", 1) + b"A", digest_size=16,
                           person=b"baton.salt.v1").digest()
    assert salted_link(keys[1], "A") == link
    assert parent_key(2, keys[1], seg("A", 2)) == link
    assert keys[2] == hash_block(link, prompt[2 * BS:3 * BS])
    assert keys[3] == hash_block(keys[2], prompt[3 * BS:4 * BS])
    assert root_key(seg("A", 2)) == root_key(UNSALTED)
    assert parent_key(0, None, seg("A", 2)) == root_key(UNSALTED)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.text(max_size=8),
       st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=BS))
def test_a_salted_link_never_equals_a_block_or_root_key(previous, salt, block):
    link = salted_link(previous, salt)
    assert link != hash_block(previous, block)
    assert link != root_key(KeyExtras("m", salt))
    assert link != salted_link(previous, salt + "x")


def test_the_tail_block_is_salted_when_the_offset_falls_in_it():
    trunk = tokens(3 * BS, seed=1)
    prompt = trunk + [7, 8]  # 3 full blocks and a tail of 2 tokens
    a = prompt_block_keys(prompt, BS, seg("A", first_salted_block(3 * BS + 1, BS)))
    b = prompt_block_keys(prompt, BS, seg("B", first_salted_block(3 * BS + 1, BS)))
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert a[3] == hash_block(salted_link(a[2], "A"), [7, 8])
    # an offset past the tail's start leaves the full blocks public, the tail private
    assert a[:3] == block_keys(trunk, BS, UNSALTED)


def test_a_tail_before_the_segment_is_unsalted():
    prompt = tokens(2 * BS + 3)
    keys = prompt_block_keys(prompt, BS, seg("A", 5))  # the salt starts after the prompt
    assert keys == prompt_block_keys(prompt, BS, UNSALTED)


def test_the_block_holding_the_offset_is_salted():
    assert [first_salted_block(n, BS) for n in (0, 1, 3, 4, 5, 8)] == [0, 0, 0, 1, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(0, 12), st.integers(0, 12), st.text(max_size=3))
def test_known_full_continuation_equals_full_hashing(num_tokens, k, known, salt):
    prompt = tokens(num_tokens, seed=num_tokens)
    extras = seg(salt, k)
    whole = prompt_block_keys(prompt, BS, extras)
    known = min(known, num_tokens // BS)
    assert prompt_block_keys(prompt, BS, extras, whole[:known]) == whole
    rest = prompt[known * BS:]
    assert whole[:known] + continue_keys(whole[:known], rest, BS, extras) == (
        block_keys(prompt, BS, extras))
    assert block_keys(prompt, BS, extras) == whole[:num_tokens // BS]
