"""A store node in a process of its own, outside Ray: for multi-node tests and the KV store
benchmark on one machine.

``python -m kvstore.standalone --node-id a --block-bytes N --config-json '{...}'`` starts a
``KVStoreNode`` (its ``kvstore.transfer`` section must be set), optionally writes synthetic
chains into it (``--fill SEED:NUM_BLOCKS``, repeatable; bytes from ``synthetic_block``), prints
one JSON line ``{"address": PeerAddress, "arena_path": ...}`` and then serves until its standard
input closes. Each input line ``stats`` is answered with one JSON line of its counters.
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec
import numpy as np

from kvstore.config import KVStoreConfig
from kvstore.keys import BlockKey, KeyExtras, block_keys
from kvstore.node import KVStoreNode

SYNTHETIC_BLOCK_TOKENS = 16


def synthetic_chain(seed: int, num_blocks: int) -> list[BlockKey]:
    tokens = [seed * 1_000_003 + i for i in range(num_blocks * SYNTHETIC_BLOCK_TOKENS)]
    return block_keys(tokens, SYNTHETIC_BLOCK_TOKENS, KeyExtras(model_id="synthetic"))


def synthetic_block(key: BlockKey, block_bytes: int) -> np.ndarray:
    """Deterministic pseudo-random bytes for ``key`` (the same in every process)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, size=block_bytes, dtype=np.uint8)


def write_chain(node: KVStoreNode, keys: list[BlockKey]) -> int:
    """Write ``keys`` (one chain) into the node; returns how many were stored."""
    slots = node.reserve(keys, [None, *keys[:-1]])
    stored = [(k, s) for k, s in zip(keys, slots) if s is not None]
    for key, slot in stored:
        node.arena.slot(slot).numpy()[:] = synthetic_block(key, node.arena.slot_bytes)
    node.commit([k for k, _ in stored])
    return len(stored)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--cluster", default="standalone")
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--config-json", required=True, help="a KVStoreConfig as JSON")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--fill", action="append", default=[], help="SEED:NUM_BLOCKS")
    args = parser.parse_args(argv)
    config = KVStoreConfig.model_validate_json(args.config_json)
    if config.transfer is None:
        parser.error("the config needs a 'transfer' section")
    node = KVStoreNode(args.node_id, args.cluster, config, args.block_bytes, args.redis_url)
    try:
        for spec in args.fill:
            seed, num_blocks = (int(part) for part in spec.split(":"))
            write_chain(node, synthetic_chain(seed, num_blocks))
        ready = {"address": msgspec.to_builtins(node.transfer_address()),
                 "arena_path": str(node.arena.path)}
        print(json.dumps(ready), flush=True)
        for line in sys.stdin:
            if line.strip() == "stats":
                counters = node.tier_counters().as_dict()
                counters.update(msgspec.to_builtins(node.transfer_server.stats()))
                print(json.dumps(counters), flush=True)
    finally:
        node.shutdown()


if __name__ == "__main__":
    main()
