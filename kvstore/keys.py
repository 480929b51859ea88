"""Baton's block identity: chain-hashed keys for full blocks of tokens.

A key names one block *and everything before it*: ``key_i = H(key_{i-1}, tokens of block i)``,
with the chain rooted at ``H(extras)``. So one changed token invalidates its block and every later
block but no earlier one, and two requests share exactly the keys of their common full-block prefix.
Only full blocks get a key; a trailing partial block is never cached, so a prefix match is always a
whole number of blocks.

Keys must agree across processes and machines (the index, the store nodes and the workers compute
them independently), so ``H`` is BLAKE2b-128 over a canonical byte encoding, never Python's
process-seeded ``hash()``:

- tokens: little-endian uint32, 4 bytes each, no length prefix (a block's length is fixed by the
  chain and the parent key is always 16 bytes, so ``parent || tokens`` is unambiguous);
- strings: UTF-8, each prefixed by its byte length as little-endian uint32;
- root, block and salted-link hashes use different BLAKE2b ``person`` tags, so none of them can
  equal another kind by construction.

Segmented salts (``KeyExtras.salt_from_block``): a ``cache_salt`` may apply from block ``k`` on.
Then the chain is rooted unsalted, blocks ``0..k-1`` chain as if there were no salt (a public
trunk, shared by every tenant), and block ``k``'s parent is the *salted link*
``H_salt(key_{k-1}, salt)`` instead of ``key_{k-1}``; the chain continues from there, so every
block from ``k`` on is private to the salt. A token offset maps to ``k = offset // block_size``
(``first_salted_block``): the blocks wholly before the offset are shared, the one holding it is not.
``k = 0`` (the default) is the whole-prompt salt, byte-identical to the keys before segments
existed, and to how vLLM salts its own prefix cache (the first block only, so everything after).
Who uses which: Baton's store and the conductor's index of the store's tiers carry segmented
keys; vLLM's device cache keeps the whole-prompt salt (it cannot salt from an offset), and the
index keys the engines' device blocks that way (``conductor.kv_index``).
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence
from typing import NewType

import msgspec
import numpy as np

BlockKey = NewType("BlockKey", bytes)
"""16-byte BLAKE2b digest naming one full block and its whole prefix."""

KEY_SIZE_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1

_ROOT_PERSON = b"baton.root.v1"
_BLOCK_PERSON = b"baton.block.v1"
_SALT_PERSON = b"baton.salt.v1"
_U32 = struct.Struct("<I")

assert array.array("I").itemsize == 4, "array('I') must be 4 bytes for the canonical token encoding"
_NEEDS_BYTESWAP = sys.byteorder != "little"


class KeyExtras(msgspec.Struct, frozen=True):
    """Everything besides the tokens that decides whether two blocks' KV is interchangeable.

    Each field changes every key of a chain: ``cache_salt`` keeps tenants from probing each other's
    cache by timing; ``lora_id`` and ``kv_layout`` (dtype, block layout, tensor-parallel split)
    separate caches whose bytes differ for the same tokens. ``salt_from_block`` narrows the salt
    to the blocks from that one on (the module docstring).
    """

    model_id: str
    cache_salt: str = ""
    lora_id: str = ""
    kv_layout: str = ""
    salt_from_block: int = 0
    """With a ``cache_salt``: the first block the salt applies to; the blocks before it are keyed
    unsalted (shared across salts). 0: the whole chain (the root is salted). Without a salt it
    changes nothing."""


def first_salted_block(cache_salt_offset_tokens: int, block_size: int) -> int:
    """``KeyExtras.salt_from_block`` for a salt applying from token ``cache_salt_offset_tokens``
    on: the blocks wholly before the offset stay unsalted, the block holding it is salted."""
    assert cache_salt_offset_tokens >= 0 and block_size > 0
    return cache_salt_offset_tokens // block_size


def _salted_block(extras: KeyExtras) -> int:
    """The block whose parent is the salted link; 0 when the root carries the salt (or none)."""
    return extras.salt_from_block if extras.cache_salt and extras.salt_from_block > 0 else 0


def root_key(extras: KeyExtras) -> BlockKey:
    """The parent of the first block of every chain under ``extras`` (unsalted when the salt
    starts at a later block)."""
    h = hashlib.blake2b(digest_size=KEY_SIZE_BYTES, person=_ROOT_PERSON)
    salt = "" if _salted_block(extras) else extras.cache_salt
    for field in (extras.model_id, salt, extras.lora_id, extras.kv_layout):
        encoded = field.encode("utf-8")
        h.update(_U32.pack(len(encoded)))
        h.update(encoded)
    return BlockKey(h.digest())


def salted_link(previous: BlockKey, cache_salt: str) -> BlockKey:
    """The parent of a segmented chain's first salted block: ``previous`` (the last unsalted
    block's key) hashed with the salt under its own ``person`` tag, so it never equals a block or
    a root key."""
    assert len(previous) == KEY_SIZE_BYTES, f"previous key must be {KEY_SIZE_BYTES} bytes"
    h = hashlib.blake2b(digest_size=KEY_SIZE_BYTES, person=_SALT_PERSON)
    h.update(previous)
    encoded = cache_salt.encode("utf-8")
    h.update(_U32.pack(len(encoded)))
    h.update(encoded)
    return BlockKey(h.digest())


def parent_key(block_index: int, previous: BlockKey | None, extras: KeyExtras) -> BlockKey:
    """The parent of block ``block_index`` of a chain under ``extras`` whose block before it has
    the key ``previous`` (None for block 0): the root, the salted link, or ``previous``."""
    if block_index == 0:
        return root_key(extras)
    assert previous is not None, "a later block needs its predecessor's key"
    if block_index == _salted_block(extras):
        return salted_link(previous, extras.cache_salt)
    return previous


def hash_block(parent: BlockKey, token_ids: Sequence[int]) -> BlockKey:
    """The key of the block holding ``token_ids`` whose predecessor's key is ``parent``.

    ``parent`` is ``root_key(extras)`` for the first block. ``token_ids`` is one block's tokens;
    the caller decides what a full block is (``block_keys`` does this for a whole prompt).
    """
    return _hash_packed(parent, _pack_tokens(token_ids))


def block_keys(token_ids: Sequence[int], block_size: int, extras: KeyExtras) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``: exactly ``len(token_ids) // block_size`` keys.

    Raises ``ValueError`` when ``block_size`` is not positive or a token id is outside uint32.
    Packs the tokens once per salt segment and hashes views of the packed buffer, so a prompt
    costs one conversion plus one BLAKE2b call per block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    return continue_keys((), token_ids, block_size, extras)


def continue_keys(known_full: Sequence[BlockKey], token_ids: Sequence[int], block_size: int,
                  extras: KeyExtras) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids``, which come right after the ``len(known_full)``
    blocks keyed ``known_full`` (the whole chain before them, under ``extras``; empty: they start
    the chain). Crosses a salt segment's start where it falls among them:
    ``known_full + continue_keys(known_full, rest, b, e) == block_keys(all_tokens, b, e)``."""
    start = len(known_full)
    previous = known_full[-1] if known_full else None
    salted = _salted_block(extras)
    num_blocks = len(token_ids) // block_size
    if not start < salted < start + num_blocks:  # no salted link strictly inside this stretch
        return chain_keys(parent_key(start, previous, extras), token_ids, block_size)
    split = (salted - start) * block_size
    head = chain_keys(parent_key(start, previous, extras), token_ids[:split], block_size)
    return head + chain_keys(salted_link(head[-1], extras.cache_salt), token_ids[split:],
                             block_size)


def chain_keys(parent: BlockKey, token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """Keys of consecutive full blocks of ``token_ids`` chained after ``parent`` (the tokens are
    packed once): ``chain_keys(root_key(e), t, b) == block_keys(t, b, e)`` for extras without
    a salt segment (``continue_keys`` crosses one)."""
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    assert len(parent) == KEY_SIZE_BYTES, f"parent key must be {KEY_SIZE_BYTES} bytes"
    packed = memoryview(_pack_tokens(token_ids[: num_blocks * block_size]))
    block_bytes = 4 * block_size
    keys: list[BlockKey] = []
    new_hasher = _BLOCK_HASHER.copy
    for start in range(0, num_blocks * block_bytes, block_bytes):  # _hash_packed, inlined: hot
        h = new_hasher()
        h.update(parent)
        h.update(packed[start : start + block_bytes])
        parent = h.digest()
        keys.append(parent)
    return keys


def prompt_block_keys(token_ids: Sequence[int], block_size: int, extras: KeyExtras,
                      known_full: Sequence[BlockKey] = ()) -> list[BlockKey]:
    """Keys of a prompt's full blocks, then of its partial tail block (if any): how the store
    names a prompt's blocks.

    The tail's key hashes fewer tokens than a full block's, so it can never name a full block;
    it lets a decode engine load the whole prompt's KV and compute only the last token. Tail
    blocks are leaves: nothing chains after them.

    ``known_full``: keys of the prompt's leading full blocks hashed before (a continuation's
    prompt is the original prompt plus the tokens generated so far): only the blocks after them
    are hashed, so a block is hashed once where it is produced. The salt segment of ``extras``
    applies to the tail as to any block: its parent is the salted link when the offset falls in
    it.
    """
    num_known = len(known_full)
    assert num_known <= len(token_ids) // block_size, "more known keys than full blocks"
    rest = token_ids[num_known * block_size:]
    keys = [*known_full, *continue_keys(known_full, rest, block_size, extras)]
    tail = token_ids[len(keys) * block_size:]
    if tail:
        keys.append(hash_block(parent_key(len(keys), keys[-1] if keys else None, extras), tail))
    return keys


def kv_layout_tag(dtype: str, block_size_tokens: int) -> str:
    """The part of a block key that says how its bytes are laid out (dtype and block size)."""
    return f"{dtype}:{block_size_tokens}"


def pack_keys(keys: Sequence[BlockKey]) -> bytes:
    """Keys as one byte string, ``KEY_SIZE_BYTES`` each, in order: compact on the wire."""
    return b"".join(keys)


def unpack_keys(packed: bytes) -> list[BlockKey]:
    """Inverse of ``pack_keys``; ``ValueError`` unless ``packed`` is whole keys."""
    if len(packed) % KEY_SIZE_BYTES:
        raise ValueError(f"packed keys are {KEY_SIZE_BYTES} bytes each, got {len(packed)} bytes")
    return [BlockKey(packed[i:i + KEY_SIZE_BYTES]) for i in range(0, len(packed), KEY_SIZE_BYTES)]


def key_hex(key: BlockKey) -> str:
    """The key as 32 lowercase hex digits, for logs and Redis."""
    return key.hex()


def key_from_hex(text: str) -> BlockKey:
    """Inverse of ``key_hex``; raises ``ValueError`` unless ``text`` is 32 hex digits."""
    raw = bytes.fromhex(text)
    if len(raw) != KEY_SIZE_BYTES:
        raise ValueError(f"a block key is {2 * KEY_SIZE_BYTES} hex digits, got {text!r}")
    return BlockKey(raw)


_BLOCK_HASHER = hashlib.blake2b(digest_size=KEY_SIZE_BYTES, person=_BLOCK_PERSON)
"""Parameterised once: copying it costs half of constructing one (the KV index hashes every
block of every event it ingests)."""


def _hash_packed(parent: BlockKey, packed_tokens: bytes | memoryview) -> BlockKey:
    assert len(parent) == KEY_SIZE_BYTES, f"parent key must be {KEY_SIZE_BYTES} bytes"
    h = _BLOCK_HASHER.copy()
    h.update(parent)
    h.update(packed_tokens)
    return h.digest()  # type: ignore[return-value] - a BlockKey is its bytes


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ``ValueError`` if any id does not fit."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got an array of {token_ids.dtype}")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > MAX_TOKEN_ID):
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
        return np.ascontiguousarray(token_ids, dtype="<u4").tobytes()
    try:
        packed = array.array("I", token_ids)
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]") from e
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()
