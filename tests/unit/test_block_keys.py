"""Block keys: positional chain hashing that agrees across processes and machines."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.keys import (
    KEY_SIZE_BYTES,
    KeyExtras,
    block_keys,
    hash_block,
    key_from_hex,
    key_hex,
    root_key,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXTRAS = KeyExtras(model_id="HuggingFaceTB/SmolLM2-135M-Instruct")

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
block_sizes = st.integers(min_value=1, max_value=17)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 150_000, size=n).tolist()


def test_golden_keys_pin_the_encoding() -> None:
    """Changing these values changes every key in every cache and index: bump the person tags."""
    keys = block_keys(list(range(8)), 4, KeyExtras(model_id="m", cache_salt="s"))
    assert [key_hex(k) for k in keys] == [
        "90a7da921865e6d00005238abfe36e8d",
        "ce161c0b8519668c10e39d1df52ca80d",
    ]


def test_encoding_is_the_documented_one() -> None:
    """Rebuild the keys from the module docstring's encoding with nothing but hashlib."""

    def lp(text: str) -> bytes:
        return struct.pack("<I", len(text.encode())) + text.encode()

    root_bytes = lp("m") + lp("s") + lp("") + lp("")
    root = hashlib.blake2b(root_bytes, digest_size=16, person=b"baton.root.v1")
    parent = root.digest()
    expected = []
    for block in ([0, 1, 2, 3], [4, 5, 6, 7]):
        parent = hashlib.blake2b(
            parent + struct.pack("<4I", *block), digest_size=16, person=b"baton.block.v1"
        ).digest()
        expected.append(parent)
    assert block_keys(list(range(8)), 4, KeyExtras(model_id="m", cache_salt="s")) == expected


def test_keys_match_in_a_fresh_process_with_another_hash_seed() -> None:
    prompt = tokens(1000, seed=7)
    script = (
        "import json, sys\n"
        "from kvstore.keys import KeyExtras, block_keys, key_hex\n"
        "prompt = json.load(sys.stdin)\n"
        "keys = block_keys(prompt, 16, KeyExtras(model_id='m', cache_salt='tenant-a'))\n"
        "print(json.dumps([key_hex(k) for k in keys]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(prompt),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env=env,
    ).stdout
    extras = KeyExtras(model_id="m", cache_salt="tenant-a")
    here = [key_hex(k) for k in block_keys(prompt, 16, extras)]
    assert json.loads(out) == here
    assert len(here) == 1000 // 16


@settings(max_examples=200, deadline=None)
@given(token_ids=token_lists, block_size=block_sizes)
def test_one_key_per_full_block_and_partial_block_gets_none(
    token_ids: list[int], block_size: int
) -> None:
    keys = block_keys(token_ids, block_size, EXTRAS)
    assert len(keys) == len(token_ids) // block_size
    assert all(isinstance(k, bytes) and len(k) == KEY_SIZE_BYTES for k in keys)
    # Appending a partial block adds no key and changes none.
    partial = token_ids + [1] * (block_size - 1 - len(token_ids) % block_size)
    assert block_keys(partial, block_size, EXTRAS) == keys


@settings(max_examples=200, deadline=None)
@given(data=st.data(), block_size=block_sizes)
def test_changed_token_invalidates_its_block_and_all_later_but_no_earlier(
    data: st.DataObject, block_size: int
) -> None:
    token_ids = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200))
    position = data.draw(st.integers(0, len(token_ids) - 1))
    changed = list(token_ids)
    changed[position] = (changed[position] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    before = block_keys(token_ids, block_size, EXTRAS)
    after = block_keys(changed, block_size, EXTRAS)
    first_changed_block = position // block_size
    assert before[:first_changed_block] == after[:first_changed_block]
    for old, new in zip(before[first_changed_block:], after[first_changed_block:]):
        assert old != new


@pytest.mark.parametrize(
    "other",
    [
        KeyExtras(model_id="other-model"),
        KeyExtras(model_id=EXTRAS.model_id, cache_salt="tenant-b"),
        KeyExtras(model_id=EXTRAS.model_id, lora_id="adapter-1"),
        KeyExtras(model_id=EXTRAS.model_id, kv_layout="fp8"),
    ],
)
def test_any_extra_changes_every_key(other: KeyExtras) -> None:
    prompt = tokens(512)
    mine, theirs = block_keys(prompt, 16, EXTRAS), block_keys(prompt, 16, other)
    assert len(mine) == len(theirs) == 32
    assert not set(mine) & set(theirs)


def test_extras_fields_are_length_prefixed() -> None:
    """Moving characters between adjacent fields must not collide."""
    a = KeyExtras(model_id="ab", cache_salt="c")
    b = KeyExtras(model_id="a", cache_salt="bc")
    assert root_key(a) != root_key(b)


def test_block_keys_equal_the_hash_block_chain() -> None:
    prompt = tokens(100)
    parent = root_key(EXTRAS)
    expected = []
    for start in range(0, 96, 32):
        parent = hash_block(parent, prompt[start : start + 32])
        expected.append(parent)
    assert block_keys(prompt, 32, EXTRAS) == expected


def test_list_tuple_and_ndarray_inputs_agree() -> None:
    prompt = tokens(300)
    as_list = block_keys(prompt, 16, EXTRAS)
    assert block_keys(tuple(prompt), 16, EXTRAS) == as_list
    assert block_keys(np.asarray(prompt, dtype=np.int64), 16, EXTRAS) == as_list
    assert block_keys(np.asarray(prompt, dtype=np.uint32), 16, EXTRAS) == as_list


def test_same_tokens_in_another_position_give_another_key() -> None:
    block = [5] * 16
    keys = block_keys(block * 3, 16, EXTRAS)
    assert len(set(keys)) == 3


@pytest.mark.parametrize("bad", [[-1], [2**32], np.array([-1]), np.array([2**32]), np.array([1.0])])
def test_token_ids_outside_uint32_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_keys(bad, 1, EXTRAS)  # type: ignore[arg-type]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2], 0, EXTRAS)


def test_hex_round_trip() -> None:
    key = block_keys(tokens(16), 16, EXTRAS)[0]
    text = key_hex(key)
    assert len(text) == 32 and key_from_hex(text) == key
    with pytest.raises(ValueError, match="32 hex digits"):
        key_from_hex("abcd")


def test_hashing_a_long_prompt_is_cheap() -> None:
    """8,000 tokens in 128-token blocks: well under a millisecond on an idle core."""
    import timeit

    prompt = tokens(8000)
    runs_s = timeit.repeat(lambda: block_keys(prompt, 128, EXTRAS), number=50, repeat=3)
    per_call_s = min(runs_s) / 50
    assert per_call_s < 5e-3  # generous: the CI box is shared


def test_chain_keys_continue_a_chain_exactly_like_block_keys():
    from kvstore.keys import chain_keys, root_key

    extras = KeyExtras(model_id="m", cache_salt="s")
    tokens = list(range(10, 10 + 8 * 16 + 5))
    whole = block_keys(tokens, 16, extras)
    assert chain_keys(root_key(extras), tokens, 16) == whole
    assert chain_keys(whole[2], tokens[3 * 16:], 16) == whole[3:]
    assert chain_keys(root_key(extras), tokens[:15], 16) == []
