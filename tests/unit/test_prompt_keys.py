"""Prompt keys as the connector uses them: full blocks, then the partial tail."""

from __future__ import annotations

from kvstore.connector import prompt_block_keys
from kvstore.keys import KeyExtras, block_keys

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
