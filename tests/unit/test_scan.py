"""``conductor._scan``, the policies' one-pass pool scans, against the price's definition.

The reference prices each instance with ``conductor.pricing.predicted_ttft_ms`` from its class's
terms and its ``queue_ms`` (an unpriced queue of tokens priced by the prefill model), in a plain
loop; the C passes must agree to the bit, the decode pool's (``cheapest_colocated``) with its
running batch's steps added as ``colocated_price`` adds them and ties to the least loaded. Values come from small sets so that
ties are common (equal totals across instances: first listed wins; a pull that costs exactly
what the local prefix does: only strictly faster pulls), and from all of [0, 1e4] so that the
order of the additions shows in the last bit.
"""

from __future__ import annotations

import math
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor import _scan
from conductor.cost_model import PrefillCostModel
from conductor.policy import InstanceView, PolicyConfig
from conductor.pricing import ALWAYS_PULL, NEVER_PULL, PULL_IF_FASTER, predicted_ttft_ms, queue_ms, queue_model

SMALL = st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.5])
ANY = st.floats(0, 1e4)
TOKENS = st.sampled_from([0, 0, 1, 16, 1000])
"""Queued tokens: where the queue's time is 0, the scans price them."""
MODELS = [PolicyConfig(), PolicyConfig(prefill_cost=PrefillCostModel(intercept_ms=-20.0, per_token_ms=0.3)),
          PolicyConfig(prefill_cost=PrefillCostModel(intercept_ms=1.5, per_token_ms=0.1, per_token_sq_ms=3e-4,
                                                     per_token_cached_ms=1.0))]
"""Prefill models for the unpriced queues, one that prices a small queue below zero (then 0)."""


def queues(q, tokens, config):
    """Each instance's ``queue_ms``: the one definition, from views."""
    return [queue_ms(InstanceView("", num_queued_prefill_tokens=n, queued_prefill_ms=qk), config)
            for qk, n in zip(q, tokens)]


def reference(q, on_node, run_of, ready, terms, modes):
    """What ``conductor.pricing.cheapest`` defines, over plain lists (``q``: each instance's
    ``queue_ms``): each instance's T by ``predicted_ttft_ms`` from its class's row (class = run +
    1), the least, and the least without a pull; an instance that is not ready costs infinitely
    much."""
    best_i, best_t, local_j, local_t = -1, math.inf, -1, math.inf
    for k, qk in enumerate(q):
        row, mode = terms[6 * (run_of[k] + 1):6 * (run_of[k] + 2)], modes[run_of[k] + 1]
        if ready is not None and not ready[k]:
            t, pulled = math.inf, True
        else:
            t_local = predicted_ttft_ms(row[0], qk, row[1])
            t_pull = (predicted_ttft_ms(row[2], qk, row[3]) if on_node is not None and on_node[k]
                      else predicted_ttft_ms(row[4], qk, row[5]))
            if mode == NEVER_PULL:
                t, pulled = t_local, False
            elif mode == ALWAYS_PULL:
                t, pulled = t_pull, True
            else:
                t, pulled = (t_pull, True) if t_pull < t_local else (t_local, False)
        if best_i < 0 or t < best_t:
            best_i, best_t = k, t
        if not pulled and t < local_t:
            local_j, local_t = k, t
    return best_i, best_t, local_j, local_t


@pytest.mark.parametrize("values", [SMALL, ANY], ids=["tie-prone", "any"])
@settings(max_examples=400, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), num_runs=st.integers(0, 3), with_node=st.booleans(),
       some_not_ready=st.booleans(), config=st.sampled_from(MODELS))
def test_cheapest_equals_the_definition_to_the_bit_ties_included(values, data, n, num_runs, with_node,
                                                                 some_not_ready, config):
    terms = data.draw(st.lists(values, min_size=6 * (num_runs + 1), max_size=6 * (num_runs + 1)))
    modes = data.draw(st.lists(st.sampled_from([NEVER_PULL, PULL_IF_FASTER, ALWAYS_PULL]),
                               min_size=num_runs + 1, max_size=num_runs + 1))
    q = data.draw(st.lists(values, min_size=n, max_size=n))
    tokens = data.draw(st.lists(TOKENS, min_size=n, max_size=n))
    run_of = data.draw(st.lists(st.integers(-1, num_runs - 1), min_size=n, max_size=n))
    on_node = data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) if with_node else None
    ready = None
    if some_not_ready:
        ready = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    got = _scan.cheapest(np.asarray(q, dtype=np.float64), array("q", tokens), queue_model(config),
                         None if on_node is None else np.asarray(on_node, dtype=bool),
                         array("q", run_of), None if ready is None else bytes(ready),
                         array("d", terms), bytes(modes))
    assert got == reference(queues(q, tokens, config), on_node, run_of, ready, terms, modes)


def test_a_pull_that_only_ties_the_local_prefix_is_not_taken():
    # instance 0, no hit: recompute (0 + 0) + 2 = 2, pull (1 + 0) + 1 = 2: a tie, so it stays local
    no_queue = (np.array([0.0]), array("q", [0]), queue_model(PolicyConfig()))
    terms = array("d", [0.0, 2.0, 0.0, 0.0, 1.0, 1.0])
    assert _scan.cheapest(*no_queue, None, array("q", [-1]), None, terms, bytes([PULL_IF_FASTER])) \
        == (0, 2.0, 0, 2.0)
    # strictly faster pull: taken, so there is no local option
    terms = array("d", [0.0, 2.0, 0.0, 0.0, 1.0, 0.5])
    assert _scan.cheapest(*no_queue, None, array("q", [-1]), None, terms, bytes([PULL_IF_FASTER])) \
        == (0, 1.5, -1, math.inf)


def test_bad_arguments_are_errors_not_wrong_answers():
    q, runs, terms, modes = np.zeros(3), array("q", [-1, 0, -1]), array("d", [0.0] * 12), bytes([0, 1])
    queue = (q, array("q", [0] * 3), queue_model(PolicyConfig()))
    with pytest.raises(ValueError, match="differ in length"):
        _scan.cheapest(*queue, np.zeros(2, dtype=bool), runs, None, terms, modes)
    with pytest.raises(ValueError, match="differ in length"):
        _scan.cheapest(*queue, None, runs, bytes(2), terms, modes)
    with pytest.raises(ValueError, match="q and tokens differ"):
        _scan.cheapest(q, array("q", [0] * 2), queue[2], None, runs, None, terms, modes)
    with pytest.raises(ValueError, match="6 values per class"):
        _scan.cheapest(*queue, None, runs, None, array("d", [0.0] * 6), modes)
    with pytest.raises(ValueError, match="no class"):
        _scan.cheapest(*queue, None, array("q", [-1, 1, -1]), None, terms, modes)
    with pytest.raises(ValueError, match="not 0, 1 or 2"):
        _scan.cheapest(*queue, None, runs, None, terms, bytes([0, 3]))
    with pytest.raises(TypeError, match="8-byte"):
        _scan.cheapest(np.zeros(3, dtype=np.float32), *queue[1:], None, runs, None, terms, modes)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-3, 6), max_size=30), m=st.integers(0, 6))
def test_first_positions_is_the_first_index_of_each_value(values, m):
    expected = [values.index(v) if v in values else -1 for v in range(m)]
    assert _scan.first_positions(array("q", values), m) == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data(), num_prefill=st.integers(0, 8), num_decode=st.integers(0, 4))
def test_pool_runs_places_each_holder_at_its_position(data, num_prefill, num_decode):
    """Bits map to (pool, position); a bit past the map or in no pool is skipped."""
    where = [(0, p) for p in range(num_prefill)] + [(1, p) for p in range(num_decode)] + [(-1, 0)]
    where = data.draw(st.permutations(where))
    holders = sorted(data.draw(st.sets(st.integers(0, len(where) + 2))))
    runs = data.draw(st.lists(st.integers(0, 5), min_size=len(holders), max_size=len(holders)))
    expected = ([-1] * num_prefill, [-1] * num_decode)
    for bit, run in zip(holders, runs):
        if bit < len(where) and where[bit][0] >= 0:
            expected[where[bit][0]][where[bit][1]] = run
    got = _scan.pool_runs(array("q", holders), array("q", runs), array("q", [w[0] for w in where]),
                          array("q", [w[1] for w in where]), num_prefill, num_decode)
    assert [memoryview(g).cast("q").tolist() for g in got] == list(expected)


def load_key(load, kv_usage, active, k):
    return (load[k], kv_usage[k], active[k])


def colocated_reference(q, run_of, ready, running, load, kv_usage, active, terms, step, slo,
                        stall_weight=0.0):
    """What ``conductor.pricing.cheapest_colocated`` defines, over plain lists (``q`` as in
    ``reference``): an instance
    running sequences adds ``chunks × step`` to its queue (``colocated_price``) and is left out
    when its step and the first chunk exceed ``slo``; the least T by ``predicted_ttft_ms`` plus
    ``stall_weight`` × load × prefill (``colocated_cost``), ties to the least (load, KV use,
    active blocks), then the first listed."""
    base, per_seq, per_kv, block_tokens = step
    options = []
    for k, qk in enumerate(q):
        if ready is not None and not ready[k]:
            continue
        transfer, prefill, chunks, first_chunk = terms[4 * (run_of[k] + 1):4 * (run_of[k] + 2)]
        batch = 0.0
        if running[k] > 0:
            step_ms = base + per_seq * running[k] + per_kv * (active[k] * block_tokens)
            if slo is not None and step_ms + first_chunk > slo:
                continue
            batch = chunks * step_ms
        t = predicted_ttft_ms(transfer, qk + batch, prefill)
        if stall_weight > 0.0:
            t = t + (stall_weight * float(load[k])) * prefill
        options.append(((t, *load_key(load, kv_usage, active, k), k), qk + batch, batch))
    if not options:
        return -1, math.inf, 0.0, 0.0
    (t, *_, k), queue, batch = min(options)
    return k, t, queue, batch


@pytest.mark.parametrize("values", [SMALL, ANY], ids=["tie-prone", "any"])
@settings(max_examples=400, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), num_runs=st.integers(0, 3), some_not_ready=st.booleans(),
       with_slo=st.booleans(), config=st.sampled_from(MODELS),
       stall_weight=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
def test_cheapest_colocated_equals_the_definition_to_the_bit_ties_to_the_least_loaded(
        values, data, n, num_runs, some_not_ready, with_slo, config, stall_weight):
    small_ints = st.integers(0, 3)
    terms = data.draw(st.lists(values, min_size=4 * (num_runs + 1), max_size=4 * (num_runs + 1)))
    terms[2::4] = [float(c) for c in data.draw(st.lists(st.integers(1, 4), min_size=num_runs + 1,
                                                        max_size=num_runs + 1))]
    q = data.draw(st.lists(values, min_size=n, max_size=n))
    tokens = data.draw(st.lists(TOKENS, min_size=n, max_size=n))
    run_of = data.draw(st.lists(st.integers(-1, num_runs - 1), min_size=n, max_size=n))
    running = data.draw(st.lists(small_ints, min_size=n, max_size=n))
    load = [r + w for r, w in zip(running, data.draw(st.lists(small_ints, min_size=n, max_size=n)))]
    kv_usage = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    active = data.draw(st.lists(st.sampled_from([0, 10, 1000]), min_size=n, max_size=n))
    ready = bytes(data.draw(st.lists(st.booleans(), min_size=n, max_size=n))) if some_not_ready else None
    step = (data.draw(values), data.draw(values), data.draw(st.sampled_from([0.0, 1e-4, 0.5])),
            data.draw(st.sampled_from([1, 16])))
    slo = data.draw(values) if with_slo else None
    got = _scan.cheapest_colocated(np.asarray(q, dtype=np.float64), array("q", tokens), queue_model(config),
                                   array("q", run_of), ready,
                                   np.asarray(running, dtype=np.int64), np.asarray(load, dtype=np.int64),
                                   np.asarray(kv_usage), np.asarray(active, dtype=np.int64),
                                   array("d", terms), step, slo, stall_weight)
    assert got == colocated_reference(queues(q, tokens, config), run_of, ready, running, load, kv_usage,
                                      active, terms, step, slo, stall_weight)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(0, 10), some_not_ready=st.booleans())
def test_least_loaded_is_the_first_ready_instance_of_least_key(data, n, some_not_ready):
    load = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    kv_usage = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    active = data.draw(st.lists(st.sampled_from([0, 10]), min_size=n, max_size=n))
    ready = bytes(data.draw(st.lists(st.booleans(), min_size=n, max_size=n))) if some_not_ready else None
    candidates = [k for k in range(n) if ready is None or ready[k]]
    expected = min(candidates, key=lambda k: (*load_key(load, kv_usage, active, k), k), default=-1)
    assert _scan.least_loaded(array("q", load), array("d", kv_usage), array("q", active), ready) == expected


def test_bad_colocated_arguments_are_errors_not_wrong_answers():
    q, runs, ints, terms = np.zeros(3), array("q", [-1, 0, -1]), array("q", [0] * 3), array("d", [0.0] * 8)
    queue, step = (q, ints, queue_model(PolicyConfig())), (1.0, 1.0, 0.0, 16)
    with pytest.raises(ValueError, match="differ in length"):
        _scan.cheapest_colocated(*queue, runs, bytes(2), ints, ints, np.zeros(3), ints, terms, step, None)
    with pytest.raises(ValueError, match="q and tokens differ"):
        _scan.cheapest_colocated(q, array("q", [0]), queue[2], runs, None, ints, ints, np.zeros(3), ints, terms,
                                 step, None)
    with pytest.raises(ValueError, match="load columns differ"):
        _scan.cheapest_colocated(*queue, runs, None, ints, ints, np.zeros(2), ints, terms, step, None)
    with pytest.raises(ValueError, match="4 values per class"):
        _scan.cheapest_colocated(*queue, runs, None, ints, ints, np.zeros(3), ints, array("d", [0.0] * 6), step,
                                 None)
    with pytest.raises(ValueError, match="no class"):
        _scan.cheapest_colocated(*queue, array("q", [-1, 1, -1]), None, ints, ints, np.zeros(3), ints, terms,
                                 step, None)
    with pytest.raises(TypeError, match="8-byte"):
        _scan.cheapest_colocated(*queue, runs, None, array("i", [0] * 3), ints, np.zeros(3), ints, terms, step,
                                 None)
    with pytest.raises(ValueError, match="ready differs"):
        _scan.least_loaded(ints, np.zeros(3), ints, bytes(4))
