"""The baseline placement policies, each as its authors describe it: ``random``,
``round_robin``, ``least_loaded``, SGLang's ``sglang_cache_aware``, Dynamo's ``dynamo_kv`` and
Mooncake's ``mooncake``.

Each is ``select(snapshot, request, config) -> Placement``: pure (no I/O, inputs untouched, the
same answer for the same inputs; a draw is seeded by the request id and the placement count),
ties to the instance listed first, and the numbers it chose on in ``Placement.reason``. Only
``mooncake`` prices its options (``conductor.pricing``); ``ConductorState`` prices the others'
choices with ``with_prices`` and admits every policy's placement with ``conductor.admission``.
"""

from __future__ import annotations

import math
import random as _random
from functools import partial
from typing import Sequence

from conductor.picking import decode_by_load, decode_terms, ready, seeded_rng
from conductor.policy_config import PolicyConfig
from conductor.pricing import Pricer, best_hit_source, cheapest
from conductor.sglang_tree import SglangTrees
from conductor.snapshot import ClusterSnapshot, InstanceView, load
from protos.wire import Placement, PlacementRequest


def random(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """A uniform draw from each pool's ready instances, seeded by request id and placement count."""
    prefill = ready(snapshot, "prefill")
    decode = ready(snapshot, "decode")
    rng = seeded_rng(snapshot, request)
    p, d = rng.choice(prefill), rng.choice(decode)
    seed = f"seeded by {request.request_id!r}/{snapshot.num_placed}"
    return Placement(p.instance_id, d.instance_id, "random", seed)


def round_robin(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """The n-th placement goes to instance n mod size of each pool (ready instances only)."""
    prefill = ready(snapshot, "prefill")
    decode = ready(snapshot, "decode")
    p = prefill[snapshot.num_placed % len(prefill)]
    d = decode[snapshot.num_placed % len(decode)]
    return Placement(p.instance_id, d.instance_id, "round_robin", f"cursor={snapshot.num_placed}")


def least_loaded(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Fewest running + waiting requests in each pool; ties go to the first instance listed."""
    p = min(ready(snapshot, "prefill"), key=load)
    d = min(ready(snapshot, "decode"), key=load)
    return Placement(
        p.instance_id, d.instance_id, "least_loaded", f"prefill_load={load(p)} decode_load={load(d)}"
    )


def sglang_cache_aware(
    snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig
) -> Placement:
    """SGLang's cache-aware router for the prefill pool; decode by load.

    Follows sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` (commit 026f853, the
    sglang-router 0.2 line; defaults 0.3 / 64 / 1.5 from its ``router_args.py``). Load is the
    router's own count of requests it sent a worker and has not seen finish (the conductor's
    booked ``num_running_reqs``). If ``max - min > balance_abs_threshold`` and ``max >
    balance_rel_threshold × min``: the shortest queue. Else the approximate trees
    (``snapshot.router_state``, a ``conductor.sglang_tree.SglangTrees`` the conductor fills from
    this policy's past choices; none: empty trees): the worker with the deepest match if it
    covers more than ``cache_threshold`` of the prompt, else the worker with the smallest tree.
    Ties go to the first listed. The conductor then inserts the prompt into the chosen tree.
    """
    prefill = ready(snapshot, "prefill")
    d = decode_by_load(snapshot)
    loads = [v.num_running_reqs for v in prefill]
    lo, hi = min(loads), max(loads)
    trees = snapshot.router_state if isinstance(snapshot.router_state, SglangTrees) else _NO_TREES
    if hi - lo > config.sglang_balance_abs_threshold and hi > config.sglang_balance_rel_threshold * lo:
        p = prefill[loads.index(lo)]
        why = f"imbalanced (load max {hi}, min {lo}): shortest queue, load {lo}"
    else:
        by_id = {v.instance_id: v for v in prefill}
        matched_blocks, tenant = trees.match(request.block_keys, by_id)
        matched_tokens = min(matched_blocks * config.block_size_tokens, request.num_prompt_tokens)
        ratio = matched_tokens / request.num_prompt_tokens if request.num_prompt_tokens else 0.0
        if ratio > config.sglang_cache_threshold and tenant is not None:
            p = by_id[tenant]
            why = (f"tree match {matched_tokens} tokens = {ratio:.2f} of prompt > "
                   f"{config.sglang_cache_threshold}")
        else:
            p = min(prefill, key=lambda v: trees.size(v.instance_id))
            why = (f"tree match {ratio:.2f} <= {config.sglang_cache_threshold}: smallest tree, "
                   f"{trees.size(p.instance_id)} blocks")
    return Placement(p.instance_id, d.instance_id, "sglang_cache_aware", f"{why}; {decode_terms(d)}")


def sglang_trees(config: PolicyConfig) -> SglangTrees:
    """The approximate trees a conductor running ``sglang_cache_aware`` keeps."""
    return SglangTrees(config.sglang_max_tree_size_tokens // config.block_size_tokens,
                       config.sglang_eviction_interval_s)


_NO_TREES = SglangTrees(0, 1.0)


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
    prefill = ready(snapshot, "prefill")
    decode = ready(snapshot, "decode")
    rng = seeded_rng(snapshot, request)
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


def _mooncake_source(snapshot: ClusterSnapshot, best: InstanceView | None, best_len: int,
                     threshold: float, view: InstanceView) -> InstanceView | None:
    """Where an instance with a hit takes its prefix from: ``best`` (its run is ``best_len``
    blocks) when ``best_len / local_len > threshold``, else None (its own)."""
    local_len = snapshot.hit(view.instance_id).num_blocks
    return best if best_len > local_len and best_len / local_len > threshold else None


def mooncake(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig) -> Placement:
    """Mooncake's FAST'25 Algorithm 1: the least T = transfer + queue + prefill; decode by load.

    The best prefix is the longest leading run in the prefill pool. An instance pulls it when
    ``best_len / local_len > kvcache_balancing_threshold`` (an instance without a hit always
    pulls it), else it uses its local prefix. Rejecting past ``ttft_slo_ms`` is admission's.
    """
    prefill = ready(snapshot, "prefill")
    d = decode_by_load(snapshot)
    best = best_hit_source(snapshot, include_decode=False)
    pricer = Pricer(snapshot, request, config)
    best_len = snapshot.hit(best.instance_id).num_blocks if best else 0
    source_for_hit = partial(_mooncake_source, snapshot, best, best_len,
                             config.mooncake_kvcache_balancing_threshold)
    view, _, _, _ = cheapest(prefill, pricer, best, source_for_hit, always_pull=True)
    chosen = pricer.price(view, source_for_hit(view) if snapshot.hit(view.instance_id).num_blocks else best)
    return chosen.placement(d.instance_id, "mooncake", f"{chosen.describe()}; {decode_terms(d)}")
