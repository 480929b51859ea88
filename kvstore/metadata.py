"""Cluster-wide block metadata in Redis: which node holds each block, and in which tier.

Layout (all keys under ``baton:``):

- ``baton:block:<key hex>``: hash, field = node id, value = tier (``host`` or ``disk``);
- ``baton:node:<node id>:blocks``: set of the key hexes the node holds (so a dead node's entries
  can be found and removed without scanning every block);
- ``baton:nodes``: hash, node id → its description (arena path);
- ``baton:node:<node id>:alive``: a key with a time-to-live, renewed by the node's heartbeat;
- ``baton:transfer``: hash, node id → where its block server listens (JSON ``PeerAddress``).

A node whose ``alive`` key has expired is dead: ``reap_dead_nodes`` (run by every live node on its
heartbeat) deletes its block entries and its registration, so no reader is sent to a node that is
gone. Metadata is advisory: the store node that owns a block is the authority on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from kvstore.keys import BlockKey, key_hex

BLOCK_PREFIX = "baton:block:"
NODES_KEY = "baton:nodes"
TRANSFER_KEY = "baton:transfer"


def _node_blocks(node_id: str) -> str:
    return f"baton:node:{node_id}:blocks"


def _node_alive(node_id: str) -> str:
    return f"baton:node:{node_id}:alive"


class BlockDirectory:
    """Reads and writes the block metadata of one cluster."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client

    @classmethod
    def from_url(cls, url: str) -> "BlockDirectory":
        return cls(redis.Redis.from_url(url))

    def register(self, node_id: str, description: str, ttl_s: float) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(NODES_KEY, node_id, description)
        pipe.set(_node_alive(node_id), 1, px=int(ttl_s * 1000))
        pipe.execute()

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        """Renew the node's liveness; False when Redis no longer has it registered (Redis was
        restarted or flushed, or the node was reaped during a long pause): re-register then."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(_node_alive(node_id), 1, px=int(ttl_s * 1000))
        pipe.hexists(NODES_KEY, node_id)
        return bool(pipe.execute()[1])

    def publish(
        self,
        node_id: str,
        stored: Sequence[BlockKey] = (),
        removed: Sequence[BlockKey] = (),
        tier: str = "host",
    ) -> None:
        """Record ``stored`` blocks at ``tier`` on ``node_id`` and forget ``removed`` ones."""
        if not (stored or removed):
            return
        pipe = self._redis.pipeline(transaction=False)
        for key in stored:
            hexkey = key_hex(key)
            pipe.hset(BLOCK_PREFIX + hexkey, node_id, tier)
            pipe.sadd(_node_blocks(node_id), hexkey)
        for key in removed:
            hexkey = key_hex(key)
            pipe.hdel(BLOCK_PREFIX + hexkey, node_id)
            pipe.srem(_node_blocks(node_id), hexkey)
        pipe.execute()

    def locate(self, keys: Sequence[BlockKey]) -> list[dict[str, str]]:
        """For each key, ``{node id: tier}`` of the nodes holding it (empty when none)."""
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(BLOCK_PREFIX + key_hex(key))
        return [
            {node.decode(): tier.decode() for node, tier in entry.items()}
            for entry in pipe.execute()
        ]

    def node_block_count(self, node_id: str) -> int:
        """How many blocks the directory records on ``node_id`` (any tier)."""
        return int(self._redis.scard(_node_blocks(node_id)))

    def node_block_keys(self, node_id: str) -> set[BlockKey]:
        """The keys of every block the directory records on ``node_id`` (any tier)."""
        return {BlockKey(bytes.fromhex(h.decode())) for h in self._redis.smembers(_node_blocks(node_id))}

    def nodes(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self._redis.hgetall(NODES_KEY).items()}

    def set_transfer_address(self, node_id: str, address_json: bytes) -> None:
        self._redis.hset(TRANSFER_KEY, node_id, address_json)

    def transfer_addresses(self) -> dict[str, bytes]:
        """Node id → its block server's address (JSON ``kvstore.transfer.PeerAddress``)."""
        return {k.decode(): v for k, v in self._redis.hgetall(TRANSFER_KEY).items()}

    def is_alive(self, node_id: str) -> bool:
        return bool(self._redis.exists(_node_alive(node_id)))

    def deregister(self, node_id: str) -> None:
        """Remove a node and every block entry it had (clean shutdown or reaping)."""
        members = self._redis.smembers(_node_blocks(node_id))
        pipe = self._redis.pipeline(transaction=False)
        for hexkey in members:
            pipe.hdel(BLOCK_PREFIX + hexkey.decode(), node_id)
        pipe.delete(_node_blocks(node_id), _node_alive(node_id))
        pipe.hdel(NODES_KEY, node_id)
        pipe.hdel(TRANSFER_KEY, node_id)
        pipe.execute()

    def reap_dead_nodes(self) -> list[str]:
        """Deregister every registered node whose heartbeat has expired; returns their ids."""
        dead = [node for node in self.nodes() if not self.is_alive(node)]
        for node in dead:
            self.deregister(node)
        return dead
