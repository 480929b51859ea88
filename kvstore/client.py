"""A worker's handle on its node's KV store: control calls to the store actor, data through
the shared-memory arena.

The store actor (``kvstore.node.KVStoreNode``) decides which slot holds which block; the client
only moves bytes into and out of those slots. Every call is synchronous because vLLM calls the
connector from its (synchronous) scheduler and model runner.
"""

from __future__ import annotations

from typing import Sequence

import ray

from kvstore.host_arena import HostArena
from kvstore.keys import BlockKey


class StoreClient:
    """Connects to the named store actor and maps its arena."""

    def __init__(self, actor_name: str, namespace: str) -> None:
        self._actor = ray.get_actor(actor_name, namespace=namespace)
        info = ray.get(self._actor.arena_info.remote())
        self.arena = HostArena(info.path, info.slot_bytes, info.num_slots, create=False)

    def acquire(self, keys: Sequence[BlockKey]) -> list[int]:
        return ray.get(self._actor.acquire.remote(list(keys)))

    def release(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            ray.get(self._actor.release.remote(list(keys)))

    def reserve(
        self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]
    ) -> list[int | None]:
        return ray.get(self._actor.reserve.remote(list(keys), list(parents)))

    def commit(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            ray.get(self._actor.commit.remote(list(keys)))

    def abort(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            ray.get(self._actor.abort.remote(list(keys)))
