"""Admission: whether a placed request is let in, decided before any prefill work is spent.

``admit(snapshot, request, config, placement)`` is the one admission rule, for every policy: it
raises ``Overloaded`` when the placement's priced TTFT exceeds ``ttft_slo_ms`` or the decode
instance's predicted inter-token time, with this request added to its batch and widened by the
decode model's measured error (``tbt_error_frac``), exceeds ``tbt_slo_ms``; otherwise it returns. Policies only choose; ``ConductorState.place`` (live and in
the simulator) prices the choice and then admits it.
"""

from __future__ import annotations

from conductor.policy_config import PolicyConfig
from conductor.pricing import predicted_ttft_ms
from conductor.snapshot import ClusterSnapshot, load
from protos.errors import BatonError
from protos.wire import Placement, PlacementRequest


class Overloaded(BatonError):
    """The request is predicted to miss its SLO on every instance; rejected before any prefill.
    What a client sees for it is the fronts' (``gateway.status``)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses Ray as itself, hint included
        return (Overloaded, (str(self), self.retry_after_s))


def admit(snapshot: ClusterSnapshot, request: PlacementRequest, config: PolicyConfig,
          placement: Placement) -> None:
    """Raise ``Overloaded`` when ``placement`` misses an SLO (see the module); the retry-after
    hint is the TTFT overshoot, at least ``min_retry_after_s``."""
    ttft_ms = predicted_ttft_ms(placement.transfer_ms, placement.queue_ms, placement.prefill_ms)
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
    tbt_ms = config.decode_cost.t_step_ms(load(view) + 1, context_tokens)
    if tbt_ms * (1.0 + config.tbt_error_frac) > slo:
        margin = (f" (+{config.tbt_error_frac:.0%}, the decode model's p90 error)"
                  if config.tbt_error_frac else "")
        raise Overloaded(
            f"predicted inter-token time {tbt_ms:.1f} ms{margin} on {view.instance_id} "
            f"({load(view)} sequences, {context_tokens} context tokens with this request) exceeds "
            f"tbt_slo_ms {slo:g}; retry later, add decode instances, or raise tbt_slo_ms",
            config.min_retry_after_s,
        )
