"""How far the simulated fleet's actual prefill and transfer times stray from the conductor's
prediction: a seeded, per-request multiplicative error.

The simulator draws ``actual = predicted × f`` with ``f`` lognormal of median 1, so the
policies price with a model that is right on the median and wrong in both directions. Its one
parameter is given as ``E|f - 1|`` (``--prediction-error``, the mean absolute relative error)
or fitted to a measured median absolute error (what the live conductor publishes; see
``simulator.live_error``): ``|f - 1|`` and the live figure ``|predicted - actual| / actual =
|1/f - 1|`` have the same distribution, since ``1/f`` is ``f``'s own lognormal.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2)))


def _bisect(increasing: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """The x in [lo, hi] where ``increasing(x)`` reaches ``target``."""
    for _ in range(60):
        mid = (lo + hi) / 2
        if increasing(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mean_abs_error_of(sigma: float) -> float:
    """``E|f - 1|`` of ``f = exp(sigma·Z)``: ``e^{s²/2}·(2Φ(s) - 1)`` (split at Z = 0)."""
    return math.exp(sigma * sigma / 2) * math.erf(sigma / math.sqrt(2))


def sigma_for_mean_abs_error(mean_abs_error: float) -> float:
    """The lognormal sigma whose factor ``exp(sigma·Z)`` has ``E|f - 1| = mean_abs_error``
    (increasing in sigma: bisected)."""
    assert 0 <= mean_abs_error < 2
    if mean_abs_error == 0:
        return 0.0
    return _bisect(mean_abs_error_of, mean_abs_error, 0.0, 4.0)


def abs_error_quantile(sigma: float, q: float) -> float:
    """The ``q`` quantile of ``|f - 1|`` for ``f = exp(sigma·Z)``: the ``m`` with
    ``P(1 - m <= f <= 1 + m) = q`` (``1 - m`` floored at 0 once ``m >= 1``)."""
    assert sigma >= 0 and 0 < q < 1
    if sigma == 0:
        return 0.0

    def share_within(m: float) -> float:
        below = _phi(math.log(1 - m) / sigma) if m < 1 else 0.0
        return _phi(math.log1p(m) / sigma) - below

    return _bisect(share_within, q, 0.0, math.expm1(10 * sigma))


def sigma_for_median_abs_error(median_abs_error: float) -> float:
    """The lognormal sigma whose ``|f - 1|`` has median ``median_abs_error`` (increasing in
    sigma: bisected)."""
    assert 0 <= median_abs_error < 1
    if median_abs_error == 0:
        return 0.0
    return _bisect(lambda s: abs_error_quantile(s, 0.5), median_abs_error, 0.0, 4.0)


def error_factors(num_requests: int, mean_abs_error: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(prefill factors, transfer factors), one per request, independent, from ``seed``: the same
    draws for every policy and rate scale, so a ranking compares policies on the same luck."""
    sigma = sigma_for_mean_abs_error(mean_abs_error)
    if sigma == 0:
        return np.ones(num_requests), np.ones(num_requests)
    rng = np.random.default_rng(seed)
    draws = rng.standard_normal((2, num_requests))
    return np.exp(sigma * draws[0]), np.exp(sigma * draws[1])
