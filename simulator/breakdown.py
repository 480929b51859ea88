"""Where a policy's TTFT goes beyond the oracle's: per request, parts that add up to its excess.

A served request's TTFT is its coalescing hold, its wait for its prefill to start (the queue),
its prefix transfer (host and disk tiers, pulls), its prefill compute, and the rest: the KV
hand-off, the decode instance's admission wait and its first step (on a decode instance that
prefills it: the wait for a step boundary after the load and the batch's steps between the
chunks, then the first step). The oracle's is its prefill of the uncached suffix alone plus one
batch-of-one step (``simulator.oracle``). So per request the excess over the oracle is

    hold + queue + transfer + (prefill - oracle prefill) + (rest - oracle step) - oracle cap

where the last term is what capping the oracle at the SLO bound takes off it; a rejected or
unservable request is charged the bound, and its whole excess is ``rejected``. The parts are
means over every request of the run, as the TTFT mean is.
"""

from __future__ import annotations

import numpy as np

from simulator.oracle import oracle_ttft_ms
from simulator.sim import Simulation

COMPONENTS = {
    "rejected": "rejected or unservable requests charged the SLO bound",
    "coalesce_hold": "coalescing holds",
    "queue": "queueing for the prefill",
    "prefix_transfer": "prefix transfer (host-tier loads, pulls)",
    "miss_prefill": "prefill of blocks the oracle had cached (misses)",
    "handoff_and_steps": "KV hand-off, decode admission, steps beyond the oracle's one idle step",
    "oracle_cap": "the oracle's cap at the SLO bound",
}
"""The parts, in the order a table shows them, with what each is."""


def ttft_over_oracle(sim: Simulation) -> dict[str, np.ndarray]:
    """Per request and part (``COMPONENTS``), ms over the oracle; for each request the parts sum
    to its TTFT (a rejected one at the SLO bound) minus the oracle's (capped at the bound)."""
    bound_ms = sim.fleet.ttft_slo_ms
    oracle_raw_ms, oracle_prefill_ms = oracle_ttft_ms(sim.workload, sim.fleet, sim.profile)
    oracle_ms = np.minimum(oracle_raw_ms, bound_ms)
    served = sim.served
    zero = np.zeros(len(served))

    def on_served(values: np.ndarray) -> np.ndarray:
        return np.where(served, values, zero)

    hold_ms = on_served(sim.coalesce_wait_ms)
    queue_ms = on_served(np.nan_to_num(sim.queue_wait_ms) - sim.coalesce_wait_ms)
    rest_ms = sim.ttft_ms - np.nan_to_num(sim.queue_wait_ms) - sim.transfer_ms - sim.prefill_ms
    return {
        "rejected": np.where(served, zero, bound_ms - oracle_ms),
        "coalesce_hold": hold_ms,
        "queue": queue_ms,
        "prefix_transfer": on_served(sim.transfer_ms),
        "miss_prefill": on_served(sim.prefill_ms - oracle_prefill_ms),
        "handoff_and_steps": on_served(rest_ms - (oracle_raw_ms - oracle_prefill_ms)),
        "oracle_cap": on_served(oracle_ms - oracle_raw_ms),
    }


def mean_parts(parts: dict[str, np.ndarray], mask: np.ndarray | None = None) -> dict[str, float]:
    """Each part's mean over all requests, or its sum over ``mask``'s divided by all requests
    (so the parts of disjoint masks add up to the whole run's)."""
    return {name: float((values if mask is None else np.where(mask, values, 0.0)).sum() / len(values))
            for name, values in parts.items()}
