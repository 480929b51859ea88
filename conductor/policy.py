"""Placement policies: pure functions from a cluster snapshot and a request to a placement.

``select(snapshot, request, config) -> Placement``. The live conductor and the trace simulator
call the same functions, so what the simulator measures is the code that serves. A policy never
does I/O and never mutates its inputs; state it needs (a round-robin cursor, a seed) is in the
snapshot and the request. Every ``Placement.reason`` carries the numbers the choice was made on.

The cost-aware policies (``mooncake``, ``baton``) price each prefill instance in milliseconds:
``T = transfer + queue + prefill`` (see ``conductor.cost_model``). Ties go to the instance listed
first in the snapshot, so a policy is deterministic.
"""

from __future__ import annotations

import hashlib
import math
import random as _random
from typing import Callable, Mapping, Sequence

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from conductor import _scan
from conductor.cost_model import DecodeCostModel, PrefillCostModel, TransferModel
from protos.errors import BatonError, NoWorkerReady
from protos.wire import Placement


class Overloaded(BatonError):
    """The request is predicted to miss its SLO on every instance; rejected before any prefill."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses Ray as itself, hint included
        return (Overloaded, (str(self), self.retry_after_s))


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


class PoolArrays(msgspec.Struct, frozen=True):
    """The prefill pool's queue terms as arrays aligned with ``ClusterSnapshot.prefill``, kept by
    ``ConductorState`` as it patches views. With them the cost-aware policies price every
    instance without a prefix hit in one C pass (``conductor._scan``) instead of a Python loop;
    the result is bit for bit what the loop computes (same float operations, first listed on ties).
    """

    queued_prefill_ms: object  # np.ndarray[float64]: view.queued_prefill_ms
    queued_prefill_tokens: object  # np.ndarray[int64]: view.num_queued_prefill_tokens
    node_code: Mapping[str, int]
    """node_id → a small int ('' has none)."""
    position: Mapping[str, int]
    """instance id → its index in the pool."""
    on_node: Sequence[object] = ()
    """Per node code, the pool's mask (np.ndarray[bool]) of instances on that node."""
    unpriced: set[int] = msgspec.field(default_factory=set)
    """Positions whose queue is tokens without a priced time (``queued_prefill_ms`` <= 0 and
    ``num_queued_prefill_tokens`` > 0): the policies price those tokens (``_queue_ms``)."""

    @classmethod
    def of(cls, views: Sequence["InstanceView"]) -> "PoolArrays":
        import numpy as np

        codes: dict[str, int] = {}
        node_codes = np.array(
            [(-1 if not v.node_id else codes.setdefault(v.node_id, len(codes))) for v in views],
            dtype=np.int64)
        return cls(np.array([v.queued_prefill_ms for v in views], dtype=np.float64),
                   np.array([v.num_queued_prefill_tokens for v in views], dtype=np.int64),
                   codes, {v.instance_id: i for i, v in enumerate(views)},
                   [node_codes == code for code in range(len(codes))],
                   {i for i, v in enumerate(views) if _unpriced(v)})

    def patch(self, position: int, view: "InstanceView") -> None:
        """Bring one position up to date with ``view`` (the maker's live arrays only)."""
        self.queued_prefill_ms[position] = view.queued_prefill_ms
        self.queued_prefill_tokens[position] = view.num_queued_prefill_tokens
        if _unpriced(view):
            self.unpriced.add(position)
        else:
            self.unpriced.discard(position)

    def copy(self) -> "PoolArrays":
        """A copy that later patches of this one do not reach."""
        return msgspec.structs.replace(
            self, queued_prefill_ms=self.queued_prefill_ms.copy(),
            queued_prefill_tokens=self.queued_prefill_tokens.copy(), unpriced=set(self.unpriced))


class LoadArrays(msgspec.Struct, frozen=True):
    """The decode pool's load terms as arrays aligned with ``ClusterSnapshot.decode``, kept by
    ``ConductorState`` like ``PoolArrays``: the choice by load is then a few vector operations."""

    load: object  # np.ndarray[int64]: running + waiting sequences
    kv_usage_frac: object  # np.ndarray[float64]
    active_blocks: object  # np.ndarray[int64]: num_active_decode_blocks

    @classmethod
    def of(cls, views: Sequence["InstanceView"]) -> "LoadArrays":
        import numpy as np

        return cls(np.array([_load(v) for v in views], dtype=np.int64),
                   np.array([v.kv_usage_frac for v in views], dtype=np.float64),
                   np.array([v.num_active_decode_blocks for v in views], dtype=np.int64))

    def patch(self, position: int, view: "InstanceView") -> None:
        self.load[position] = view.num_running_reqs + view.num_waiting_reqs
        self.kv_usage_frac[position] = view.kv_usage_frac
        self.active_blocks[position] = view.num_active_decode_blocks

    def copy(self) -> "LoadArrays":
        return LoadArrays(self.load.copy(), self.kv_usage_frac.copy(), self.active_blocks.copy())


def _unpriced(view: "InstanceView") -> bool:
    return view.queued_prefill_ms <= 0 and view.num_queued_prefill_tokens > 0


class ClusterSnapshot(msgspec.Struct, frozen=True):
    """The pools at one instant, the count of placements made so far (the RR cursor and seed),
    and the KV index as this request sees it: ``prefix_hits[instance_id]`` for any instance in
    either pool (absent: no hit). Read-only by contract."""

    prefill: tuple[InstanceView, ...]
    decode: tuple[InstanceView, ...]
    num_placed: int = 0
    prefix_hits: Mapping[str, PrefixHit] = msgspec.field(default_factory=dict)
    prefill_arrays: PoolArrays | None = None
    """``prefill`` as arrays (optional: policies fall back to a loop without them)."""
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

    def hit(self, instance_id: str) -> PrefixHit:
        return self.prefix_hits.get(instance_id, NO_HIT)


class PlacementRequest(msgspec.Struct, frozen=True):
    request_id: str
    num_prompt_tokens: int
    block_keys: tuple[bytes, ...] = ()
    """The prompt's chain-hashed full-block keys, in order (what ``prefix_hits`` was matched on)."""
    max_tokens: int = 0
    """Most tokens the request may generate (sizes its decode KV for admission)."""


class PolicyConfig(BaseModel):
    """Knobs of every policy; each policy reads only its own (prefixed by its name)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size_tokens: int = Field(16, gt=0, description="Tokens per KV block (tokens).")
    kv_bytes_per_token: int = Field(
        23_040, gt=0, description="KV bytes one token occupies (bytes); see cost_model.kv_bytes_per_token."
    )
    prefill_cost: PrefillCostModel = Field(PrefillCostModel(), description="Predicted prefill time.")
    transfer: TransferModel = Field(TransferModel(), description="Predicted KV transfer time per path.")
    sglang_cache_threshold: float = Field(
        0.3, ge=0, le=1, description="SGLang: min matched fraction of the prompt to follow the cache."
    )
    sglang_balance_abs_threshold: int = Field(
        64, ge=0, description="SGLang: imbalanced when max - min load exceeds this (requests)."
    )
    sglang_balance_rel_threshold: float = Field(
        1.5, ge=1, description="SGLang: ... and max load exceeds this × min load (ratio)."
    )
    dynamo_overlap_score_weight: float = Field(
        1.0, ge=0, description="Dynamo: weight of prefill_blocks against decode_blocks."
    )
    dynamo_temperature: float = Field(
        0.0, ge=0, description="Dynamo: softmax temperature over normalized cost; 0 is argmin."
    )
    dynamo_host_hit_credit: float = Field(
        0.75, ge=0, le=1, description="Dynamo: a host-tier hit counts as this fraction of a device hit."
    )
    dynamo_disk_hit_credit: float = Field(
        0.0, ge=0, le=1, description="Dynamo: a disk-tier hit counts as this fraction of a device hit."
    )
    mooncake_kvcache_balancing_threshold: float = Field(
        2.0, gt=0, description="Mooncake: pull the best prefix when best_len / local_len exceeds this."
    )
    baton_replication_margin_frac: float = Field(
        0.05, ge=0, description="Baton: keep a local-prefix choice unless a pull is faster by more "
        "than this fraction of its TTFT (avoids replicating a prefix for a marginal gain)."
    )
    short_prefill_tokens: int = Field(
        256, ge=0, description="Baton: an uncached suffix shorter than this prefills on the decode "
        "instance (tokens); 0 always disaggregates."
    )
    ttft_slo_ms: float | None = Field(
        None, gt=0, description="Mooncake, baton: reject when the best predicted TTFT exceeds this "
        "(ms); unset: never reject."
    )
    tbt_slo_ms: float | None = Field(
        None, gt=0, description="Reject when the chosen decode instance's predicted inter-token time "
        "with this request exceeds this (ms); unset: never reject."
    )
    decode_cost: DecodeCostModel = Field(DecodeCostModel(), description="Predicted decode step time.")
    min_retry_after_s: float = Field(1.0, ge=0, description="Least retry-after hint on rejection (s).")


Policy = Callable[[ClusterSnapshot, PlacementRequest, PolicyConfig], Placement]


SERVES_WITHOUT_PREFILL_POOL = frozenset({"baton"})
"""Policies that can prefill every request on its decode instance, so a cluster with an empty
prefill pool (``prefill.num_instances: 0``) serves fully co-located with them."""


def _ready(snapshot: "ClusterSnapshot", role: str) -> tuple[InstanceView, ...]:
    """The ready instances of one pool, in pool order (the pool itself when all are ready)."""
    pool = snapshot.prefill if role == "prefill" else snapshot.decode
    if not pool and role == "prefill":
        raise NoWorkerReady(
            "the prefill pool has no instances; only the policies "
            f"{sorted(SERVES_WITHOUT_PREFILL_POOL)} serve co-located without one: set "
            "prefill.num_instances >= 1 or conductor.policy=baton"
        )
    ready = snapshot.ready_prefill if role == "prefill" else snapshot.ready_decode
    if ready is None:
        ready = [view for view in pool if view.ready]
        ready = pool if len(ready) == len(pool) else tuple(ready)
    if not ready:
        raise NoWorkerReady(f"no {role} instance is ready; retry in a few seconds")
    return ready


def _load(view: InstanceView) -> int:
    return view.num_running_reqs + view.num_waiting_reqs


def _rng(snapshot: ClusterSnapshot, request: PlacementRequest) -> _random.Random:
    """A generator seeded from the request id and the placement count: same inputs, same draws."""
    digest = hashlib.blake2b(f"{request.request_id}\0{snapshot.num_placed}".encode(), digest_size=8)
    return _random.Random(int.from_bytes(digest.digest(), "little"))


def _decode_by_load(snapshot: ClusterSnapshot) -> InstanceView:
    """Fewest running + waiting sequences, then lowest KV use, then fewest active blocks."""
    ready = _ready(snapshot, "decode")
    arrays = snapshot.decode_arrays
    if arrays is not None and ready is snapshot.decode:  # all ready: the arrays line up
        import numpy as np

        load = arrays.load
        tied = (load == load.min()).nonzero()[0]
        if len(tied) > 1:  # lexsort is stable: the first listed of equal keys comes first
            tied = tied[np.lexsort((arrays.active_blocks[tied], arrays.kv_usage_frac[tied]))]
        return ready[int(tied[0])]
    # the load alone usually decides: the full key is built only for the instances tied on it
    least = min([v.num_running_reqs + v.num_waiting_reqs for v in ready])
    tied = [v for v in ready if v.num_running_reqs + v.num_waiting_reqs == least]
    if len(tied) == 1:
        return tied[0]
    return min(tied, key=lambda v: (v.kv_usage_frac, v.num_active_decode_blocks))


def _decode_terms(view: InstanceView) -> str:
    return f"decode {view.instance_id}: load {_load(view)}, kv {view.kv_usage_frac:.0%}"


def random(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """A uniform draw from each pool's ready instances, seeded by request id and placement count."""
    prefill = _ready(snapshot, "prefill")
    decode = _ready(snapshot, "decode")
    rng = _rng(snapshot, request)
    p, d = rng.choice(prefill), rng.choice(decode)
    seed = f"seeded by {request.request_id!r}/{snapshot.num_placed}"
    return Placement(p.instance_id, d.instance_id, "random", seed)


def round_robin(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """The n-th placement goes to instance n mod size of each pool (ready instances only)."""
    prefill = _ready(snapshot, "prefill")
    decode = _ready(snapshot, "decode")
    p = prefill[snapshot.num_placed % len(prefill)]
    d = decode[snapshot.num_placed % len(decode)]
    return Placement(p.instance_id, d.instance_id, "round_robin", f"cursor={snapshot.num_placed}")


def least_loaded(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Fewest running + waiting requests in each pool; ties go to the first instance listed."""
    p = min(_ready(snapshot, "prefill"), key=_load)
    d = min(_ready(snapshot, "decode"), key=_load)
    return Placement(
        p.instance_id, d.instance_id, "least_loaded", f"prefill_load={_load(p)} decode_load={_load(d)}"
    )


def sglang_cache_aware(
    snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig
) -> Placement:
    """SGLang's cache-aware router for the prefill pool; decode by load.

    Load is running + waiting requests. If the pool is imbalanced (max - min > abs threshold and
    max > rel threshold × min) go to the least loaded instance; else to the longest prefix match
    (all tiers) if it covers more than ``cache_threshold`` of the prompt; else to the instance with
    the smallest cache (``num_cached_blocks``), to spread new prefixes.
    """
    prefill = _ready(snapshot, "prefill")
    d = _decode_by_load(snapshot)
    loads = [_load(v) for v in prefill]
    lo, hi = min(loads), max(loads)
    if hi - lo > config.sglang_balance_abs_threshold and hi > config.sglang_balance_rel_threshold * lo:
        p = min(prefill, key=_load)
        why = f"imbalanced (load max {hi}, min {lo}): shortest queue, load {_load(p)}"
    else:
        p = max(prefill, key=lambda v: snapshot.hit(v.instance_id).num_blocks)
        matched_tokens = min(snapshot.hit(p.instance_id).num_blocks * config.block_size_tokens,
                             request.num_prompt_tokens)
        ratio = matched_tokens / request.num_prompt_tokens if request.num_prompt_tokens else 0.0
        if ratio > config.sglang_cache_threshold:
            why = (f"best match {matched_tokens} tokens = {ratio:.2f} of prompt > "
                   f"{config.sglang_cache_threshold}")
        else:
            p = min(prefill, key=lambda v: v.num_cached_blocks)
            why = (f"match {ratio:.2f} <= {config.sglang_cache_threshold}: smallest tree, "
                   f"{p.num_cached_blocks} blocks")
    return Placement(p.instance_id, d.instance_id, "sglang_cache_aware", f"{why}; {_decode_terms(d)}")


def _dynamo_pick(views: Sequence[InstanceView], costs: Sequence[float], temperature: float,
                 rng: _random.Random) -> int:
    """Index of the argmin cost (first on ties), or a softmax draw over min-max normalized costs."""
    if temperature == 0:
        return min(range(len(costs)), key=costs.__getitem__)
    lo, hi = min(costs), max(costs)
    normalized = [(c - lo) / (hi - lo) if hi > lo else 0.0 for c in costs]
    weights = [math.exp(-n / temperature) for n in normalized]
    return rng.choices(range(len(views)), weights=weights)[0]


def dynamo_kv(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Dynamo's KV router: cost = overlap_score_weight × prefill_blocks + decode_blocks.

    ``prefill_blocks`` = the prompt's blocks (rounded up) less the leading-run hits on that
    instance, a host hit credited at ``dynamo_host_hit_credit`` and a disk hit at
    ``dynamo_disk_hit_credit`` of a device hit; ``decode_blocks`` = its active KV blocks. Decode
    instances are chosen by the same rule with no prefill term.
    """
    prefill = _ready(snapshot, "prefill")
    decode = _ready(snapshot, "decode")
    rng = _rng(snapshot, request)
    request_blocks = -(-request.num_prompt_tokens // config.block_size_tokens)
    prefill_blocks = []
    for view in prefill:
        hit = snapshot.hit(view.instance_id)
        credit = (hit.num_blocks_device + config.dynamo_host_hit_credit * hit.num_blocks_host
                  + config.dynamo_disk_hit_credit * hit.num_blocks_disk)
        prefill_blocks.append(max(0.0, request_blocks - credit))
    w = config.dynamo_overlap_score_weight
    costs = [w * pb + v.num_active_decode_blocks for pb, v in zip(prefill_blocks, prefill)]
    i = _dynamo_pick(prefill, costs, config.dynamo_temperature, rng)
    decode_costs = [float(v.num_active_decode_blocks) for v in decode]
    j = _dynamo_pick(decode, decode_costs, config.dynamo_temperature, rng)
    p, d = prefill[i], decode[j]
    reason = (f"cost = {w:g} x prefill_blocks {prefill_blocks[i]:g} + decode_blocks "
              f"{p.num_active_decode_blocks} = {costs[i]:g}; decode {d.instance_id}: decode_blocks "
              f"{d.num_active_decode_blocks}")
    return Placement(p.instance_id, d.instance_id, "dynamo_kv", reason)


class PrefillPrice(msgspec.Struct, frozen=True):
    """The priced TTFT terms of one prefill option (ms)."""

    instance_id: str
    transfer_ms: float
    queue_ms: float
    prefill_ms: float
    num_cached_blocks: int
    num_pulled_blocks: int = 0
    pulled_from: str = ""

    @property
    def total_ms(self) -> float:
        return self.transfer_ms + self.queue_ms + self.prefill_ms

    def describe(self) -> str:
        where = (f"pulled {self.num_pulled_blocks} blocks from {self.pulled_from}" if self.num_pulled_blocks
                 else f"local prefix {self.num_cached_blocks} blocks")
        return (f"{self.instance_id}: T=transfer {self.transfer_ms:.1f} + queue {self.queue_ms:.1f} + "
                f"prefill {self.prefill_ms:.1f} = {self.total_ms:.1f} ms ({where})")


def _queue_ms(view: InstanceView, config: PolicyConfig) -> float:
    if view.queued_prefill_ms > 0 or view.num_queued_prefill_tokens <= 0:
        return view.queued_prefill_ms
    return config.prefill_cost.t_prefill_ms(view.num_queued_prefill_tokens, 0)


def price(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
          view: InstanceView, source: InstanceView | None = None) -> PrefillPrice:
    """TTFT terms for prefilling on ``view``, using its own leading run, or, with ``source``, the
    longer run ``source`` holds: the blocks past the local run are pulled from ``source``.

    Transfer: local host blocks load over ``same_node``; disk blocks anywhere over
    ``remote_disk``; pulled device/host blocks over ``same_node`` when both share a non-empty
    ``node_id``, else ``remote_host``. Device blocks on ``view`` itself cost nothing.
    """
    remote = snapshot.hit(source.instance_id) if source is not None else None
    same_node = source is not None and bool(source.node_id) and source.node_id == view.node_id
    transfer_ms, prefill_ms, num_cached, num_pulled = _price_terms(
        request, config, snapshot.hit(view.instance_id), remote, same_node)
    return PrefillPrice(view.instance_id, transfer_ms, _queue_ms(view, config), prefill_ms,
                        num_cached, num_pulled, source.instance_id if num_pulled else "")


def _price_terms(request: PlacementRequest, config: PolicyConfig, local: PrefixHit,
                 remote: PrefixHit | None, same_node: bool) -> tuple[float, float, int, int]:
    """``price`` without the queue: (transfer ms, prefill ms, cached blocks, pulled blocks), which
    depend only on the two runs and whether the pull stays on the node."""
    # A term of zero blocks costs 0.0 and adding 0.0 to a non-negative sum changes no bit, so
    # only the terms that move something are computed (this runs several times per decision).
    bytes_per_block = config.block_size_tokens * config.kv_bytes_per_token
    t = config.transfer
    transfer_ms = 0.0
    if local.num_blocks_host:
        transfer_ms = t.t_transfer_ms(local.num_blocks_host * bytes_per_block, "same_node")
    if local.num_blocks_disk:
        transfer_ms += t.t_transfer_ms(local.num_blocks_disk * bytes_per_block, "remote_disk")
    num_cached_blocks, num_pulled = local.num_blocks, 0
    if remote is not None:
        device, host, disk = remote.tiers_in(num_cached_blocks, remote.num_blocks)
        pulled_ms = 0.0  # summed apart, then added: the grouping of the full formula
        if device + host:
            pulled_ms = t.t_transfer_ms((device + host) * bytes_per_block,
                                        "same_node" if same_node else "remote_host")
        if disk:
            pulled_ms += t.t_transfer_ms(disk * bytes_per_block, "remote_disk")
        transfer_ms += pulled_ms
        num_pulled = device + host + disk
        num_cached_blocks += num_pulled
    cached_tokens = min(num_cached_blocks * config.block_size_tokens, request.num_prompt_tokens)
    prefill_ms = config.prefill_cost.t_prefill_ms(request.num_prompt_tokens - cached_tokens, cached_tokens)
    return transfer_ms, prefill_ms, num_cached_blocks, num_pulled


def _best_source(snapshot: ClusterSnapshot, views: Sequence[InstanceView]) -> InstanceView:
    """The instance with the longest leading run; ties to the most device blocks, then first listed."""
    return max(views, key=lambda v: (snapshot.hit(v.instance_id).num_blocks,
                                     snapshot.hit(v.instance_id).num_blocks_device))


def _admit(chosen: PrefillPrice, config: PolicyConfig) -> None:
    slo = config.ttft_slo_ms
    if slo is not None and chosen.total_ms > slo:
        retry_after_s = max(config.min_retry_after_s, (chosen.total_ms - slo) / 1000.0)
        raise Overloaded(
            f"predicted TTFT {chosen.total_ms:.1f} ms on the best instance exceeds ttft_slo_ms {slo:g}; "
            f"retry after {retry_after_s:.1f} s, add prefill instances, or raise ttft_slo_ms",
            retry_after_s,
        )


def _placed(chosen: PrefillPrice, decode: InstanceView, policy: str, reason: str) -> Placement:
    return Placement(
        chosen.instance_id, decode.instance_id, policy, reason,
        transfer_ms=chosen.transfer_ms, queue_ms=chosen.queue_ms, prefill_ms=chosen.prefill_ms,
        expected_cached_blocks=chosen.num_cached_blocks, pulled_from=chosen.pulled_from,
        priority=-chosen.num_cached_blocks,
    )


class _Scan:
    """Prices a whole pool in one pass for the cost-aware policies.

    Only instances with a prefix hit need a full ``price``; every other instance's T is its queue
    plus one of two constants (recompute everything, or pull the best run over the same-node or
    the remote path). Totals are computed in the same order as ``price`` so both agree to the
    last bit; ``*_options`` remain the reference the tests compare against.

    ``price`` here memoises the queue-free terms: the instances of one node that reach a store
    hit share one run, so they share every term but the queue.
    """

    def __init__(self, snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
                 best: InstanceView | None) -> None:
        self.snapshot, self.request, self.config, self.best = snapshot, request, config, best
        self.recompute_ms = config.prefill_cost.t_prefill_ms(request.num_prompt_tokens, 0)
        self.best_len = snapshot.hit(best.instance_id).num_blocks if best is not None else 0
        """The best run's length (blocks)."""
        self._terms: dict[tuple, tuple[float, float, int, int]] = {}

    def terms(self, local: PrefixHit, source: InstanceView | None,
              same_node: bool) -> tuple[float, float, int, int]:
        key = (local, source.instance_id if source is not None else None, same_node)
        terms = self._terms.get(key)
        if terms is None:
            remote = self.snapshot.hit(source.instance_id) if source is not None else None
            terms = self._terms[key] = _price_terms(self.request, self.config, local, remote, same_node)
        return terms

    def price(self, view: InstanceView, source: InstanceView | None = None) -> PrefillPrice:
        """Exactly ``price(snapshot, request, config, view, source)``."""
        same_node = source is not None and bool(source.node_id) and source.node_id == view.node_id
        transfer_ms, prefill_ms, num_cached, num_pulled = self.terms(
            self.snapshot.hit(view.instance_id), source, same_node)
        return PrefillPrice(view.instance_id, transfer_ms, _queue_ms(view, self.config), prefill_ms,
                            num_cached, num_pulled, source.instance_id if num_pulled else "")

    def total(self, view: InstanceView, source: InstanceView | None = None) -> tuple[float, int]:
        """(``total_ms``, ``num_pulled_blocks``) of ``self.price(view, source)``, the same sum,
        without building the price (the scan needs only these for every holder)."""
        same_node = source is not None and bool(source.node_id) and source.node_id == view.node_id
        transfer_ms, prefill_ms, _, num_pulled = self.terms(
            self.snapshot.hit(view.instance_id), source, same_node)
        return transfer_ms + _queue_ms(view, self.config) + prefill_ms, num_pulled

    def pull_terms(self, same_node: bool) -> tuple[float, float]:
        """(transfer, prefill) ms for an instance without a hit pulling the best run."""
        transfer_ms, prefill_ms, _, _ = self.terms(NO_HIT, self.best, same_node)
        return transfer_ms, prefill_ms


def _best_hit_source(snapshot: ClusterSnapshot, include_decode: bool) -> InstanceView | None:
    """``_best_source`` over the ready instances with a hit, listed prefill pool first, then the
    decode pool when ``include_decode`` (None when no such instance has a hit). With the
    snapshot's ``pool_index`` it visits only the hits: the largest (run, device blocks), then
    the first listed, exactly as the scan of the pools picks."""
    hits = snapshot.prefix_hits
    index = snapshot.pool_index
    if index is None:
        if not any(hit.num_blocks for hit in hits.values()):
            return None
        views = _ready(snapshot, "prefill") + (
            tuple(v for v in snapshot.decode if v.ready) if include_decode else ())
        holders = [v for v in views if v.instance_id in hits and hits[v.instance_id].num_blocks]
        return _best_source(snapshot, holders) if holders else None
    pools = (snapshot.prefill, snapshot.decode)
    best, best_key = None, None
    for instance_id, hit in hits.items():
        where = index.get(instance_id)
        if where is None or (where[0] and not include_decode):
            continue
        num_blocks = hit.num_blocks
        if not num_blocks:
            continue
        view = pools[where[0]][where[1]]
        key = (num_blocks, hit.num_blocks_device, -where[0], -where[1])
        if view.ready and (best_key is None or key > best_key):
            best, best_key = view, key
    return best


def _cheapest(prefill: Sequence[InstanceView], scan: _Scan,
              source_for_hit: Callable[[InstanceView], InstanceView | None],
              always_pull: bool) -> tuple[InstanceView, float, InstanceView | None, float]:
    """(best view, its T, best view without a pull, its T), first listed on ties. An instance
    with a hit is priced pulling from ``source_for_hit(view)`` (None: its own prefix); one
    without pulls the best run when ``always_pull`` (Mooncake) or when that is faster."""
    arrays = scan.snapshot.prefill_arrays
    if arrays is not None and prefill is scan.snapshot.prefill:
        return _cheapest_vectorized(prefill, arrays, scan, source_for_hit, always_pull)
    holders = {i for i, hit in scan.snapshot.prefix_hits.items() if hit.num_blocks}
    config, recompute_ms, best = scan.config, scan.recompute_ms, scan.best
    best_node = best.node_id if best is not None else ""
    # What an instance without a hit pays to pull the best run depends only on whether it
    # shares the source's node: both prices are computed once, outside the loop.
    if best is not None:
        same_transfer, same_prefill = scan.pull_terms(bool(best_node))
        other_transfer, other_prefill = scan.pull_terms(False)
    best_view, best_t, local_view, local_t = None, math.inf, None, math.inf
    for view in prefill:  # the hot loop of placement at scale: kept flat on purpose
        if view.instance_id in holders:
            t, num_pulled = scan.total(view, source_for_hit(view))
            pulled = bool(num_pulled)
        else:
            q = view.queued_prefill_ms
            if q <= 0 and view.num_queued_prefill_tokens > 0:
                q = _queue_ms(view, config)
            t, pulled = 0.0 + q + recompute_ms, False
            if best is not None:
                if best_node and view.node_id == best_node:
                    t_pull = same_transfer + q + same_prefill
                else:
                    t_pull = other_transfer + q + other_prefill
                if always_pull or t_pull < t:
                    t, pulled = t_pull, True
        if t < best_t:
            best_view, best_t = view, t
        if not pulled and t < local_t:
            local_view, local_t = view, t
    return best_view, best_t, local_view, local_t


def _cheapest_vectorized(prefill: Sequence[InstanceView], arrays: PoolArrays, scan: _Scan,
                         source_for_hit: Callable[[InstanceView], InstanceView | None],
                         always_pull: bool) -> tuple[InstanceView, float, InstanceView | None, float]:
    """``_cheapest`` over the pool's arrays: the same float operations in the same order, so
    the same totals, first listed on ties, as the loop. Holders are priced here; everyone else
    is one pass of ``conductor._scan.cheapest`` (a numpy expression per term cost a microsecond
    each, a dozen per decision). ``0.0 + q`` is ``q`` for a queue term (never -0.0)."""
    if not prefill:
        return None, math.inf, None, math.inf
    config, recompute_ms, best = scan.config, scan.recompute_ms, scan.best
    q = arrays.queued_prefill_ms
    if arrays.unpriced:  # a view without a priced queue: price its tokens, as _queue_ms does
        q = q.copy()
        for i in arrays.unpriced:
            q[i] = _queue_ms(prefill[i], config)
    if best is None:  # no ready instance holds any of the prompt: nothing to pull, no hit
        t = q + recompute_ms
        i = int(t.argmin())
        return prefill[i], float(t[i]), prefill[i], float(t[i])
    best_node = best.node_id
    same_transfer, same_prefill = scan.pull_terms(bool(best_node))
    other_transfer, other_prefill = scan.pull_terms(False)
    code = arrays.node_code.get(best_node) if best_node else None
    holders = []  # (position, T, pulled) of the instances with a hit, priced one by one
    for instance_id, hit in scan.snapshot.prefix_hits.items():
        i = arrays.position.get(instance_id)
        if i is not None and hit.num_blocks:
            total_ms, num_pulled = scan.total(prefill[i], source_for_hit(prefill[i]))
            holders.append((i, total_ms, bool(num_pulled)))
    holders.sort()
    # the rest in one pass in C: the loop's sums in its order, first listed on ties
    i, best_t, j, local_t = _scan.cheapest(
        q, arrays.on_node[code] if code is not None else None, same_transfer, same_prefill,
        other_transfer, other_prefill, recompute_ms, always_pull,
        [h[0] for h in holders], [h[1] for h in holders], [h[2] for h in holders])
    return prefill[i], best_t, (prefill[j] if j >= 0 else None), local_t


def mooncake_options(snapshot: ClusterSnapshot, request: PlacementRequest,
                     config: PolicyConfig) -> list[PrefillPrice]:
    """Algorithm 1's price for each ready prefill instance, in pool order.

    The best prefix is the longest leading run in the prefill pool. An instance pulls it when
    ``best_len / local_len > kvcache_balancing_threshold`` (a local run of 0 with a best run > 0
    always pulls), else it uses its local prefix.
    """
    prefill = _ready(snapshot, "prefill")
    best = _best_source(snapshot, prefill)
    best_len = snapshot.hit(best.instance_id).num_blocks
    threshold = config.mooncake_kvcache_balancing_threshold
    options = []
    for view in prefill:
        local_len = snapshot.hit(view.instance_id).num_blocks
        pull = best_len > local_len and (local_len == 0 or best_len / local_len > threshold)
        options.append(price(snapshot, request, config, view, best if pull else None))
    return options


def mooncake(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Mooncake's FAST'25 Algorithm 1: the least T = transfer + queue + prefill; decode by load;
    ``Overloaded`` when even that misses ``ttft_slo_ms``."""
    prefill = _ready(snapshot, "prefill")
    d = _decode_by_load(snapshot)
    best = _best_hit_source(snapshot, include_decode=False)
    scan = _Scan(snapshot, request, config, best)
    best_len = snapshot.hit(best.instance_id).num_blocks if best else 0
    threshold = config.mooncake_kvcache_balancing_threshold

    def source_for_hit(view: InstanceView) -> InstanceView | None:
        local_len = snapshot.hit(view.instance_id).num_blocks
        pull = best_len > local_len and best_len / local_len > threshold
        return best if pull else None

    view, _, _, _ = _cheapest(prefill, scan, source_for_hit, always_pull=True)
    chosen = scan.price(view, source_for_hit(view) if snapshot.hit(view.instance_id).num_blocks else best)
    _admit(chosen, config)
    return _placed(chosen, d, "mooncake", f"{chosen.describe()}; {_decode_terms(d)}")


def baton_options(snapshot: ClusterSnapshot, request: PlacementRequest,
                  config: PolicyConfig) -> list[PrefillPrice]:
    """Each ready prefill instance's best price, in pool order: its local prefix, or the longest
    run held by any ready instance (either pool) pulled to it, whichever is faster.

    This is Algorithm 1 with the threshold derived rather than set: pull exactly when the transfer
    costs less than the prefill it saves (at equal queue). Queue-time differences between
    instances are weighed by the choice across instances that follows.
    """
    prefill = _ready(snapshot, "prefill")
    best = _best_source(snapshot, prefill + tuple(v for v in snapshot.decode if v.ready))
    return [_baton_option(snapshot, request, config, view, best) for view in prefill]


def _baton_option(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
                  view: InstanceView, best: InstanceView | None) -> PrefillPrice:
    """``view``'s local price, or the pulled one when it is strictly faster."""
    local = price(snapshot, request, config, view)
    best_len = snapshot.hit(best.instance_id).num_blocks if best is not None else 0
    if best is not None and best_len > local.num_cached_blocks:
        pulled = price(snapshot, request, config, view, best)
        if pulled.total_ms < local.total_ms:
            return pulled
    return local


def _baton_source(view: InstanceView, scan: _Scan) -> InstanceView | None:
    """Where ``_baton_option`` takes ``view``'s prefix from: ``scan.best`` when pulling it is
    strictly faster, else None (its own), decided on the same totals through ``scan``'s memo."""
    best = scan.best
    if best is None or scan.best_len <= scan.snapshot.hit(view.instance_id).num_blocks:
        return None
    return best if scan.total(view, best)[0] < scan.total(view)[0] else None


def baton(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Algorithm 1 priced in ms with an adaptive pull threshold, plus conditional disaggregation.

    Takes the least T over ``baton_options``, except that the fastest option without a pull wins
    when it is within ``baton_replication_margin_frac`` of it: the chosen T never exceeds
    (1 + margin) × the least. The decode instance is chosen by load; when the prompt's uncached
    suffix on that decode instance (its own leading run) is shorter than ``short_prefill_tokens``,
    it prefills there too, saving the KV hand-off. With an empty prefill pool every request
    prefills on its decode instance (co-located serving). Rejects with ``Overloaded`` past
    ``ttft_slo_ms``.
    """
    prefill = _ready(snapshot, "prefill") if snapshot.prefill else ()
    d = _decode_by_load(snapshot)
    cached_on_decode = min(snapshot.hit(d.instance_id).num_blocks * config.block_size_tokens,
                           request.num_prompt_tokens)
    suffix_tokens = request.num_prompt_tokens - cached_on_decode
    if not prefill or suffix_tokens < config.short_prefill_tokens:
        chosen = price(snapshot, request, config, d)
        _admit(chosen, config)
        why = ("no prefill pool" if not prefill else
               f"uncached suffix {suffix_tokens} tokens < short_prefill_tokens {config.short_prefill_tokens}")
        reason = f"colocated: {why}; {chosen.describe()}; {_decode_terms(d)}"
        return _placed(chosen, d, "baton", reason)
    best = _best_hit_source(snapshot, include_decode=True)
    scan = _Scan(snapshot, request, config, best)

    def source_for_hit(view: InstanceView) -> InstanceView | None:
        return _baton_source(view, scan)

    view, best_t, local_view, local_t = _cheapest(prefill, scan, source_for_hit, always_pull=False)
    if local_view is not None and local_t <= best_t * (1 + config.baton_replication_margin_frac):
        view = local_view
    chosen = scan.price(view, _baton_source(view, scan))
    _admit(chosen, config)
    return _placed(chosen, d, "baton", f"{chosen.describe()}; {_decode_terms(d)}")


def with_prices(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
                placement: Placement) -> Placement:
    """``placement`` with the priced terms of its prefill instance filled in, for the policies
    that choose without pricing (so every decision can be explained in milliseconds)."""
    if placement.policy in ("mooncake", "baton"):
        return placement
    views = {v.instance_id: v for v in snapshot.prefill + snapshot.decode}
    chosen = price(snapshot, request, config, views[placement.prefill_instance])
    return msgspec.structs.replace(
        placement, transfer_ms=chosen.transfer_ms, queue_ms=chosen.queue_ms,
        prefill_ms=chosen.prefill_ms, expected_cached_blocks=chosen.num_cached_blocks,
        priority=-chosen.num_cached_blocks,
    )


def admit(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
          placement: Placement) -> None:
    """Admission control for every policy: raise ``Overloaded`` when the placement's priced TTFT
    exceeds ``ttft_slo_ms`` or the decode instance's predicted step time, with this request added
    to its batch, exceeds ``tbt_slo_ms``. Runs before any prefill work is spent."""
    ttft_ms = placement.transfer_ms + placement.queue_ms + placement.prefill_ms
    slo = config.ttft_slo_ms
    if slo is not None and ttft_ms > slo:
        retry_after_s = max(config.min_retry_after_s, (ttft_ms - slo) / 1000.0)
        raise Overloaded(
            f"predicted TTFT {ttft_ms:.1f} ms on {placement.prefill_instance} exceeds ttft_slo_ms "
            f"{slo:g}; retry after {retry_after_s:.1f} s, add prefill instances, or raise ttft_slo_ms",
            retry_after_s,
        )
    slo = config.tbt_slo_ms
    if slo is None:
        return
    view = next(v for v in snapshot.decode + snapshot.prefill if v.instance_id == placement.decode_instance)
    context_tokens = (view.num_active_decode_blocks * config.block_size_tokens
                      + request.num_prompt_tokens + request.max_tokens)
    tbt_ms = config.decode_cost.t_step_ms(_load(view) + 1, context_tokens)
    if tbt_ms > slo:
        raise Overloaded(
            f"predicted inter-token time {tbt_ms:.1f} ms on {view.instance_id} ({_load(view)} "
            f"sequences, {context_tokens} context tokens with this request) exceeds tbt_slo_ms "
            f"{slo:g}; retry later, add decode instances, or raise tbt_slo_ms",
            config.min_retry_after_s,
        )


POLICIES: dict[str, Policy] = {
    "random": random,
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "sglang_cache_aware": sglang_cache_aware,
    "dynamo_kv": dynamo_kv,
    "mooncake": mooncake,
    "baton": baton,
}
