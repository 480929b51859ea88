"""Prompt keys as the connector uses them: full blocks, then the partial tail."""

from __future__ import annotations

import pytest

from kvstore.keys import (
    KEY_SIZE_BYTES,
    KeyExtras,
    block_keys,
    pack_keys,
    prompt_block_keys,
    unpack_keys,
)

EXTRAS = KeyExtras(model_id="m")


def test_a_block_aligned_prompt_has_only_full_block_keys():
    tokens = list(range(256))
    assert prompt_block_keys(tokens, 128, EXTRAS) == block_keys(tokens, 128, EXTRAS)


def test_a_partial_tail_gets_one_more_key_that_no_full_block_shares():
    tokens = list(range(300))
    keys = prompt_block_keys(tokens, 128, EXTRAS)
    assert len(keys) == 3
    assert keys[:2] == block_keys(tokens, 128, EXTRAS)
    longer = prompt_block_keys(list(range(384)), 128, EXTRAS)
    assert keys[2] not in longer  # same first 300 tokens, but the tail is not the full block


def test_the_tail_key_depends_on_every_tail_token_and_on_the_prefix():
    base = prompt_block_keys(list(range(150)), 128, EXTRAS)[-1]
    assert prompt_block_keys(list(range(149)) + [7], 128, EXTRAS)[-1] != base
    assert prompt_block_keys([9] + list(range(1, 150)), 128, EXTRAS)[-1] != base
    assert prompt_block_keys(list(range(150)), 128, EXTRAS)[-1] == base


def test_a_prompt_shorter_than_a_block_has_just_its_tail_key():
    assert len(prompt_block_keys([1, 2, 3], 128, EXTRAS)) == 1
    assert prompt_block_keys([], 128, EXTRAS) == []


@pytest.mark.parametrize("num_known", [0, 1, 2])
@pytest.mark.parametrize("num_tokens", [256, 300, 511])
def test_known_leading_keys_are_kept_and_only_the_rest_is_hashed(num_known, num_tokens):
    """A continuation's prompt is the original prompt plus the reply so far: its keys are the
    original's full-block keys followed by the reply's blocks, the same as hashing it whole."""
    tokens = list(range(7, 7 + num_tokens))
    known = block_keys(tokens[:num_known * 128], 128, EXTRAS)
    assert prompt_block_keys(tokens, 128, EXTRAS, known) == prompt_block_keys(tokens, 128, EXTRAS)
    fake = [bytes([9]) * KEY_SIZE_BYTES] * num_known  # they are used, not recomputed
    assert prompt_block_keys(tokens, 128, EXTRAS, fake)[:num_known] == fake


def test_packed_keys_are_16_bytes_each_and_unpack_to_the_same_keys():
    keys = prompt_block_keys(list(range(300)), 128, EXTRAS)
    packed = pack_keys(keys)
    assert len(packed) == KEY_SIZE_BYTES * len(keys)
    assert unpack_keys(packed) == keys
    assert unpack_keys(b"") == []
    with pytest.raises(ValueError, match="16 bytes each"):
        unpack_keys(packed[:-1])
