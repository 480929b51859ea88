"""``conductor._scan.cheapest``, the policies' one-pass pool scan, against the price's definition.

The reference prices each instance with ``conductor.pricing.predicted_ttft_ms``, the one sum of
the prefill price, in a plain loop; the C pass must agree to the bit. Values come from small sets
so that ties are common (equal totals across instances: first listed wins; a pull that costs
exactly what recomputing does: only strictly faster pulls), and from all of [0, 1e4] so that the
order of the additions shows in the last bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor import _scan
from conductor.pricing import predicted_ttft_ms

SMALL = st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.5])
ANY = st.floats(0, 1e4)


def reference(q, on_node, same_transfer, same_prefill, other_transfer, other_prefill, recompute_ms,
              always_pull, overrides):
    """What ``conductor.pricing.cheapest`` defines, over plain lists: each instance's T by
    ``predicted_ttft_ms`` (an override's as given), the least, and the least without a pull."""
    best_i, best_t, local_j, local_t = -1, math.inf, -1, math.inf
    for k, qk in enumerate(q):
        if k in overrides:
            t, pulled = overrides[k]
        else:
            t_pull = (predicted_ttft_ms(same_transfer, qk, same_prefill)
                      if on_node is not None and on_node[k]
                      else predicted_ttft_ms(other_transfer, qk, other_prefill))
            if always_pull:
                t, pulled = t_pull, True
            else:
                t, pulled = predicted_ttft_ms(0.0, qk, recompute_ms), False
                if t_pull < t:
                    t, pulled = t_pull, True
        if best_i < 0 or t < best_t:
            best_i, best_t = k, t
        if not pulled and t < local_t:
            local_j, local_t = k, t
    return best_i, best_t, local_j, local_t


@pytest.mark.parametrize("values", [SMALL, ANY], ids=["tie-prone", "any"])
@settings(max_examples=400, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), always_pull=st.booleans(), with_node=st.booleans())
def test_cheapest_equals_the_definition_to_the_bit_ties_included(values, data, n, always_pull, with_node):
    consts = data.draw(st.tuples(values, values, values, values, values))
    q = data.draw(st.lists(values, min_size=n, max_size=n))
    on_node = data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) if with_node else None
    positions = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    overrides = {p: (data.draw(values), data.draw(st.booleans())) for p in positions}
    got = _scan.cheapest(np.asarray(q, dtype=np.float64),
                         None if on_node is None else np.asarray(on_node, dtype=bool),
                         *consts, always_pull, positions, [overrides[p][0] for p in positions],
                         [overrides[p][1] for p in positions])
    assert got == reference(q, on_node, *consts, always_pull, overrides)


def test_a_pull_that_only_ties_recomputing_is_not_taken():
    # instance 0: recompute 0 + 2 = 2, pull (1 + 0) + 1 = 2: a tie, so it stays local
    assert _scan.cheapest(np.array([0.0]), None, 0.0, 0.0, 1.0, 1.0, 2.0, False, [], [], []) == (0, 2.0, 0, 2.0)
    # strictly faster pull: taken, so there is no local option
    assert _scan.cheapest(np.array([0.0]), None, 0.0, 0.0, 1.0, 0.5, 2.0, False, [], [], []) == (0, 1.5, -1, math.inf)


def test_bad_arguments_are_errors_not_wrong_answers():
    q = np.zeros(3)
    with pytest.raises(ValueError, match="same length"):
        _scan.cheapest(q, None, 0.0, 0.0, 0.0, 0.0, 1.0, False, [0], [], [])
    with pytest.raises(ValueError, match="ascend"):
        _scan.cheapest(q, None, 0.0, 0.0, 0.0, 0.0, 1.0, False, [2, 1], [0.0, 0.0], [False, False])
    with pytest.raises(ValueError, match="past the pool"):
        _scan.cheapest(q, None, 0.0, 0.0, 0.0, 0.0, 1.0, False, [5], [0.0], [False])
    with pytest.raises(ValueError, match="differ in length"):
        _scan.cheapest(q, np.zeros(2, dtype=bool), 0.0, 0.0, 0.0, 0.0, 1.0, False, [], [], [])
    with pytest.raises(TypeError, match="8-byte"):
        _scan.cheapest(np.zeros(3, dtype=np.float32), None, 0.0, 0.0, 0.0, 0.0, 1.0, False, [], [], [])
