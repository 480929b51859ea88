"""SGLang's approximate radix trees: what its cache-aware router believes each worker caches,
learned from its own routing history, never from the workers.

Follows sgl-project/sglang ``sgl-router/src/tree.rs`` (the multi-tenant radix tree) as
``sgl-router/src/policies/cache_aware.rs`` uses it (read at commit 026f853, the sglang-router
0.2 line; defaults from ``py_src/sglang_router/router_args.py``: ``eviction_interval_secs``
120, ``max_tree_size`` 2**26 characters). Rewritten over Baton's block keys instead of
characters: a key names its block and everything before it, so one worker's radix tree is the
set of keys routed to it, and the shared tree's deepest node on a prompt is the longest leading
run any worker holds. What it keeps from the original:

- ``record`` inserts the whole prompt for the chosen worker at routing time (both of the
  router's branches do), refreshing that worker's access time along the path;
- ``match`` is ``prefix_match``: the deepest match over all workers and a worker holding it
  (the first that reached it; SGLang takes the first of a hash map, as arbitrary);
- ``size`` is ``tenant_char_count`` in blocks; the smallest tree is the miss branch's choice;
- ``maintain`` is the background thread: every ``eviction_interval_s`` each tree larger than
  the bound drops least recently used leaves until it fits (``evict_tenant_by_size``). Between
  evictions trees grow without bound, and nothing tells them what the engines evicted.

Not kept: ``prefix_match`` also refreshes the matched worker's access time when the router then
chooses another (it only reorders that worker's eviction).

The conductor owns one of these per ``ConductorState`` (mechanism); the policy only reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Collection, Hashable, Sequence

BlockKey = Hashable


class SglangTrees:
    """Per worker, the block keys routed to it, LRU over leaves (touched leaf first, so an
    ancestor is always more recent than its descendants and a tree stays prefix-closed)."""

    def __init__(self, max_size_blocks: int, eviction_interval_s: float) -> None:
        assert max_size_blocks >= 0 and eviction_interval_s > 0
        self.max_size_blocks = max_size_blocks
        self.eviction_interval_s = eviction_interval_s
        self._trees: dict[str, OrderedDict[BlockKey, None]] = {}
        self._holders: dict[BlockKey, dict[str, None]] = {}
        """Key → the workers whose tree holds it, in the order they first got it."""
        self._next_eviction_s: float | None = None
        self.num_evicted_blocks = 0

    def size(self, worker: str) -> int:
        tree = self._trees.get(worker)
        return len(tree) if tree is not None else 0

    def match(self, keys: Sequence[BlockKey], eligible: Collection[str]) -> tuple[int, str | None]:
        """(blocks matched, worker): the longest leading run of ``keys`` that a worker in
        ``eligible`` holds, and the first such worker to have reached it; (0, None) if none."""
        holders = self._holders
        matched, tenant = 0, None
        for key in keys:
            workers = holders.get(key)
            if workers is None:
                break
            first = next((w for w in workers if w in eligible), None)
            if first is None:
                break
            matched, tenant = matched + 1, first
        return matched, tenant

    def record(self, keys: Sequence[BlockKey], worker: str) -> None:
        """The router sent a prompt with ``keys`` to ``worker``: insert it there, most recent."""
        tree = self._trees.setdefault(worker, OrderedDict())
        holders = self._holders
        for key in reversed(keys):
            if key in tree:
                tree.move_to_end(key)
            else:
                tree[key] = None
                workers = holders.get(key)
                if workers is None:
                    holders[key] = {worker: None}
                else:
                    workers[worker] = None

    def maintain(self, now_s: float) -> None:
        """Run the periodic eviction if one is due at ``now_s`` (the first call starts the clock)."""
        if self._next_eviction_s is None:
            self._next_eviction_s = now_s + self.eviction_interval_s
            return
        if now_s < self._next_eviction_s:
            return
        elapsed = now_s - self._next_eviction_s
        self._next_eviction_s += (int(elapsed // self.eviction_interval_s) + 1) * self.eviction_interval_s
        for worker, tree in self._trees.items():
            while len(tree) > self.max_size_blocks:
                key, _ = tree.popitem(last=False)
                self._drop(key, worker)
                self.num_evicted_blocks += 1

    def remove_worker(self, worker: str) -> None:
        for key in self._trees.pop(worker, ()):
            self._drop(key, worker)

    def _drop(self, key: BlockKey, worker: str) -> None:
        workers = self._holders[key]
        del workers[worker]
        if not workers:
            del self._holders[key]

    def check_invariants(self) -> None:
        for worker, tree in self._trees.items():
            for key in tree:
                assert worker in self._holders[key]
        for key, workers in self._holders.items():
            assert workers and all(key in self._trees[w] for w in workers)
