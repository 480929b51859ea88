"""``conductor._scan``, the policies' one-pass pool scan, against the price's definition.

The reference prices each instance with ``conductor.pricing.predicted_ttft_ms`` from its class's
terms, in a plain loop; the C pass must agree to the bit. Values come from small sets so that
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
from conductor.pricing import ALWAYS_PULL, NEVER_PULL, PULL_IF_FASTER, predicted_ttft_ms

SMALL = st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.5])
ANY = st.floats(0, 1e4)


def reference(q, on_node, run_of, ready, terms, modes):
    """What ``conductor.pricing.cheapest`` defines, over plain lists: each instance's T by
    ``predicted_ttft_ms`` from its class's row (class = run + 1), the least, and the least
    without a pull; an instance that is not ready costs infinitely much."""
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
       some_not_ready=st.booleans())
def test_cheapest_equals_the_definition_to_the_bit_ties_included(values, data, n, num_runs, with_node,
                                                                 some_not_ready):
    terms = data.draw(st.lists(values, min_size=6 * (num_runs + 1), max_size=6 * (num_runs + 1)))
    modes = data.draw(st.lists(st.sampled_from([NEVER_PULL, PULL_IF_FASTER, ALWAYS_PULL]),
                               min_size=num_runs + 1, max_size=num_runs + 1))
    q = data.draw(st.lists(values, min_size=n, max_size=n))
    run_of = data.draw(st.lists(st.integers(-1, num_runs - 1), min_size=n, max_size=n))
    on_node = data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) if with_node else None
    ready = None
    if some_not_ready:
        ready = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    got = _scan.cheapest(np.asarray(q, dtype=np.float64),
                         None if on_node is None else np.asarray(on_node, dtype=bool),
                         array("q", run_of), None if ready is None else bytes(ready),
                         array("d", terms), bytes(modes))
    assert got == reference(q, on_node, run_of, ready, terms, modes)


def test_a_pull_that_only_ties_the_local_prefix_is_not_taken():
    # instance 0, no hit: recompute (0 + 0) + 2 = 2, pull (1 + 0) + 1 = 2: a tie, so it stays local
    terms = array("d", [0.0, 2.0, 0.0, 0.0, 1.0, 1.0])
    assert _scan.cheapest(np.array([0.0]), None, array("q", [-1]), None, terms, bytes([PULL_IF_FASTER])) \
        == (0, 2.0, 0, 2.0)
    # strictly faster pull: taken, so there is no local option
    terms = array("d", [0.0, 2.0, 0.0, 0.0, 1.0, 0.5])
    assert _scan.cheapest(np.array([0.0]), None, array("q", [-1]), None, terms, bytes([PULL_IF_FASTER])) \
        == (0, 1.5, -1, math.inf)


def test_bad_arguments_are_errors_not_wrong_answers():
    q, runs, terms, modes = np.zeros(3), array("q", [-1, 0, -1]), array("d", [0.0] * 12), bytes([0, 1])
    with pytest.raises(ValueError, match="differ in length"):
        _scan.cheapest(q, np.zeros(2, dtype=bool), runs, None, terms, modes)
    with pytest.raises(ValueError, match="differ in length"):
        _scan.cheapest(q, None, runs, bytes(2), terms, modes)
    with pytest.raises(ValueError, match="6 values per class"):
        _scan.cheapest(q, None, runs, None, array("d", [0.0] * 6), modes)
    with pytest.raises(ValueError, match="no class"):
        _scan.cheapest(q, None, array("q", [-1, 1, -1]), None, terms, modes)
    with pytest.raises(ValueError, match="not 0, 1 or 2"):
        _scan.cheapest(q, None, runs, None, terms, bytes([0, 3]))
    with pytest.raises(TypeError, match="8-byte"):
        _scan.cheapest(np.zeros(3, dtype=np.float32), None, runs, None, terms, modes)


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
