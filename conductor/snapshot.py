"""What a placement policy reads: the cluster at one instant and the request to place.

``ClusterSnapshot`` holds both pools as ``InstanceView``s, the KV index as this request sees it
(``PrefixHit`` per instance) and the placement count; ``protos.wire.PlacementRequest`` is the
request. A snapshot is read-only by contract: policies never mutate it. ``ConductorState`` makes them and
may add fields that only make a policy faster (ready subsets, a pool index, ``PoolArrays`` and
``LoadArrays``, and ``prefix_hits`` as ``GroupedHits``): a snapshot with them decides exactly as
one without.
"""

from __future__ import annotations

from array import array
from typing import ClassVar, Iterator, Mapping, Self, Sequence

import msgspec

from conductor import _scan


class InstanceView(msgspec.Struct, frozen=True):
    """What a policy may know about one instance. Every field past ``ready`` defaults to idle."""

    instance_id: str
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    ready: bool = True
    num_queued_prefill_tokens: int = 0
    """Uncached prompt tokens waiting to be prefilled here (tokens)."""
    queued_prefill_ms: float = 0.0
    """Mooncake's T_queue: the sum of predicted prefill times of the requests queued here (ms).
    When 0 and ``num_queued_prefill_tokens`` > 0, policies price the queue as one prefill of that
    many tokens."""
    num_active_decode_blocks: int = 0
    """KV blocks held by the sequences running here (Dynamo's ``decode_blocks``) (blocks)."""
    kv_usage_frac: float = 0.0
    """Fraction of the device KV cache in use, 0..1."""
    num_cached_blocks: int = 0
    """Blocks in this instance's prefix cache, all tiers (SGLang's tree size) (blocks)."""
    node_id: str = ""
    """The machine the instance runs on; equal non-empty ids make a pull ``same_node``."""


def load(view: InstanceView) -> int:
    """An instance's load: its running plus waiting requests."""
    return view.num_running_reqs + view.num_waiting_reqs


def has_unpriced_queue(view: InstanceView) -> bool:
    """Whether ``view``'s queue is tokens without a priced time (``queued_prefill_ms`` <= 0 and
    ``num_queued_prefill_tokens`` > 0): the price then prices those tokens
    (``conductor.pricing.queue_ms``)."""
    return view.queued_prefill_ms <= 0 and view.num_queued_prefill_tokens > 0


class PrefixHit(msgspec.Struct, frozen=True):
    """How much of one request's prefix one instance holds, by tier.

    The caller walks the request's ``block_keys`` in order and stops at the first key the instance
    holds in no tier: that *leading run* is all that is reusable (chain hashing makes keys
    positional). Each block of the run is counted once, in the fastest tier the instance holds it
    in. Policies price the run as laid out device → host → disk (the first ``num_blocks_device``
    blocks on device, then host, then disk), the shape leaf-first eviction produces, where an
    ancestor is always at least as hot as its descendants.
    """

    num_blocks_device: int = 0
    num_blocks_host: int = 0
    num_blocks_disk: int = 0

    @property
    def num_blocks(self) -> int:
        return self.num_blocks_device + self.num_blocks_host + self.num_blocks_disk

    def tiers_in(self, start: int, end: int) -> tuple[int, int, int]:
        """Blocks of the run's ``[start, end)`` on (device, host, disk)."""
        host_start = self.num_blocks_device
        disk_start = host_start + self.num_blocks_host
        disk_end = disk_start + self.num_blocks_disk
        return (max(0, min(end, host_start) - max(start, 0)),
                max(0, min(end, disk_start) - max(start, host_start)),
                max(0, min(end, disk_end) - max(start, disk_start)))


NO_HIT = PrefixHit()


class QueueArrays(msgspec.Struct, frozen=True, kw_only=True):
    """A pool's queue terms as arrays aligned with its views (``ClusterSnapshot.prefill`` or
    ``decode``), kept by ``ConductorState``, which patches a position whenever it replaces that
    position's view (``patch``). A pool scan then reads every instance's queue without a pass over
    the views. Each pool's arrays add their own columns: ``PoolArrays`` (the prefill pool) and
    ``LoadArrays`` (the decode pool)."""

    queued_prefill_ms: object  # np.ndarray[float64]: view.queued_prefill_ms
    queued_prefill_tokens: object  # np.ndarray[int64]: view.num_queued_prefill_tokens
    """Where ``has_unpriced_queue``, the scans price these tokens."""

    _patched: ClassVar[tuple[str, ...]] = ("queued_prefill_ms", "queued_prefill_tokens")
    """The fields ``patch`` writes, which ``copy`` copies (each class adds its own)."""

    @staticmethod
    def queue_columns(views: Sequence[InstanceView]) -> dict[str, object]:
        """The queue fields of ``views``, for a subclass's ``of``."""
        import numpy as np

        return {"queued_prefill_ms": np.array([v.queued_prefill_ms for v in views], dtype=np.float64),
                "queued_prefill_tokens": np.array([v.num_queued_prefill_tokens for v in views], dtype=np.int64)}

    def patch(self, position: int, view: InstanceView) -> None:
        """Bring one position up to date with ``view`` (the maker's live arrays only)."""
        self.queued_prefill_ms[position] = view.queued_prefill_ms
        self.queued_prefill_tokens[position] = view.num_queued_prefill_tokens

    def copy(self) -> Self:
        """A copy that later patches of this one do not reach."""
        return msgspec.structs.replace(self, **{name: getattr(self, name).copy() for name in self._patched})


class PoolArrays(QueueArrays, frozen=True, kw_only=True):
    """The prefill pool's arrays: its queues, and which instances share each node (the pull
    source's node decides a pull's path)."""

    node_code: Mapping[str, int]
    """node_id → a small int ('' has none)."""
    on_node: Sequence[object] = ()
    """Per node code, the pool's mask (np.ndarray[bool]) of instances on that node."""

    @classmethod
    def of(cls, views: Sequence[InstanceView]) -> "PoolArrays":
        import numpy as np

        codes: dict[str, int] = {}
        node_codes = np.array(
            [(-1 if not v.node_id else codes.setdefault(v.node_id, len(codes))) for v in views],
            dtype=np.int64)
        return cls(**cls.queue_columns(views), node_code=codes,
                   on_node=[node_codes == code for code in range(len(codes))])


class LoadArrays(QueueArrays, frozen=True, kw_only=True):
    """The decode pool's arrays: its loads (the choice by load is one C pass,
    ``picking.decode_by_load``) and, since each decode instance is a prefill candidate too
    (``pricing.cheapest_colocated``), its queues and running batches."""

    load: object  # np.ndarray[int64]: running + waiting requests
    kv_usage_frac: object  # np.ndarray[float64]
    active_blocks: object  # np.ndarray[int64]: num_active_decode_blocks
    running: object  # np.ndarray[int64]: num_running_reqs

    _patched: ClassVar[tuple[str, ...]] = QueueArrays._patched + (
        "load", "kv_usage_frac", "active_blocks", "running")

    @classmethod
    def of(cls, views: Sequence[InstanceView]) -> "LoadArrays":
        import numpy as np

        return cls(**cls.queue_columns(views), load=np.array([load(v) for v in views], dtype=np.int64),
                   kv_usage_frac=np.array([v.kv_usage_frac for v in views], dtype=np.float64),
                   active_blocks=np.array([v.num_active_decode_blocks for v in views], dtype=np.int64),
                   running=np.array([v.num_running_reqs for v in views], dtype=np.int64))

    def patch(self, position: int, view: InstanceView) -> None:
        QueueArrays.patch(self, position, view)
        self.load[position] = view.num_running_reqs + view.num_waiting_reqs
        self.kv_usage_frac[position] = view.kv_usage_frac
        self.active_blocks[position] = view.num_active_decode_blocks
        self.running[position] = view.num_running_reqs


class GroupedHits(Mapping[str, PrefixHit]):
    """``ClusterSnapshot.prefix_hits`` grouped by run, as ``ConductorState`` makes it from the
    index: ``runs`` are the distinct leading runs and ``prefill_run_of`` / ``decode_run_of``
    (int64 buffers aligned with the snapshot's pools: a ``memoryview`` cast to ``q`` or an
    ``array('q')``) the index in ``runs`` of each instance's run, -1 for no hit. Instances with the same run share every term of the price but
    the queue (a system prompt on every instance gives the whole fleet one run), so the pool scan
    prices each run once (``conductor.pricing.cheapest``).

    As a mapping it is exactly the plain one (instance id → ``PrefixHit``, holders only); lookups
    go through the pool index, and iterating builds the plain dict once."""

    __slots__ = ("_first", "_plain", "_pool_index", "_pools", "decode_run_of", "prefill_run_of", "runs")

    def __init__(self, runs: tuple[PrefixHit, ...], prefill_run_of, decode_run_of,
                 prefill: Sequence[InstanceView], decode: Sequence[InstanceView],
                 pool_index: Mapping[str, tuple[int, int]]) -> None:
        self.runs = runs
        self.prefill_run_of = prefill_run_of
        self.decode_run_of = decode_run_of
        self._pools = ((prefill, prefill_run_of), (decode, decode_run_of))
        self._pool_index = pool_index
        self._plain: dict[str, PrefixHit] | None = None
        self._first: list[list[int] | None] = [None, None]

    @classmethod
    def of(cls, hits: Mapping[str, PrefixHit], prefill: Sequence[InstanceView],
           decode: Sequence[InstanceView],
           pool_index: Mapping[str, tuple[int, int]] | None = None) -> GroupedHits:
        """Plain hits grouped (entries of instances in neither pool, or of no blocks, dropped:
        no policy reads them); ``pool_index`` as ``ClusterSnapshot.pool_index`` (None: built)."""
        if isinstance(hits, GroupedHits):
            return hits
        if pool_index is None:
            pool_index = {v.instance_id: (0, n) for n, v in enumerate(prefill)}
            pool_index.update({v.instance_id: (1, n) for n, v in enumerate(decode)})
        run_of = (array("q", [-1]) * len(prefill), array("q", [-1]) * len(decode))
        runs: dict[PrefixHit, int] = {}
        for instance_id, hit in hits.items():
            where = pool_index.get(instance_id)
            if where is not None and hit.num_blocks:
                run_of[where[0]][where[1]] = runs.setdefault(hit, len(runs))
        return cls(tuple(runs), run_of[0], run_of[1], prefill, decode, pool_index)

    def get(self, instance_id: str, default=None):
        where = self._pool_index.get(instance_id)
        if where is None:
            return default
        run = self._pools[where[0]][1][where[1]]
        return self.runs[run] if run >= 0 else default

    def __getitem__(self, instance_id: str) -> PrefixHit:
        hit = self.get(instance_id)
        if hit is None:
            raise KeyError(instance_id)
        return hit

    def first_positions(self, pool: int) -> list[int]:
        """Per run, the first position in the prefill (0) or decode (1) pool holding it (-1:
        none there)."""
        first = self._first[pool]
        if first is None:
            first = self._first[pool] = _scan.first_positions(self._pools[pool][1], len(self.runs))
        return first

    def _as_plain(self) -> dict[str, PrefixHit]:
        if self._plain is None:
            self._plain = {views[p].instance_id: self.runs[run]
                           for views, run_of in self._pools for p, run in enumerate(run_of) if run >= 0}
        return self._plain

    def __iter__(self) -> Iterator[str]:
        return iter(self._as_plain())

    def __len__(self) -> int:
        return len(self._as_plain())

    def __bool__(self) -> bool:
        return any(p >= 0 for pool in (0, 1) for p in self.first_positions(pool))


class ClusterSnapshot(msgspec.Struct, frozen=True):
    """The pools at one instant, the count of placements made so far (the RR cursor and seed),
    and the KV index as this request sees it: ``prefix_hits[instance_id]`` for any instance in
    either pool (absent: no hit). Read-only by contract."""

    prefill: tuple[InstanceView, ...]
    decode: tuple[InstanceView, ...]
    num_placed: int = 0
    prefix_hits: Mapping[str, PrefixHit] = msgspec.field(default_factory=dict)
    prefill_arrays: PoolArrays | None = None
    """``prefill`` as arrays (optional: the scan builds what it needs without them)."""
    ready_prefill: tuple[InstanceView, ...] | None = None
    """The ready instances of ``prefill`` in order, when the snapshot's maker keeps them (it is
    ``prefill`` itself when all are ready); None: policies filter."""
    ready_decode: tuple[InstanceView, ...] | None = None
    """The same for ``decode``."""
    decode_arrays: LoadArrays | None = None
    """``decode`` as arrays (optional, like ``prefill_arrays``)."""
    pool_index: Mapping[str, tuple[int, int]] | None = None
    """Instance id → (0 for ``prefill`` or 1 for ``decode``, its index there), when the maker
    keeps it; lets a policy go from a prefix hit to its view without scanning the pools."""
    router_state: object | None = None
    """State a policy learns from its own routing history and the conductor keeps for it
    (``conductor.policy.ROUTER_STATES``: SGLang's approximate trees); the policy only reads it."""

    def hit(self, instance_id: str) -> PrefixHit:
        return self.prefix_hits.get(instance_id, NO_HIT)


