"""The priced KV hand-off learns its overhead from measured hand-offs: the calibration's median
of (measured - priced transfer), the conductor's books that pair each measurement with its
placement's priced transfer, and a decision that flips once a hand-off is known to cost more
than its bytes."""

from __future__ import annotations

import pytest

from conductor.calibration import HANDOFF_WINDOW, CostCalibration
from conductor.cost_model import DecodeCostModel, PrefillCostModel
from conductor.policy import PolicyConfig
from conductor.state import ConductorState
from kvstore.keys import KeyExtras, block_keys
from protos.wire import PlacementRequest

BS = 16
COST = PrefillCostModel(intercept_ms=0.0, per_token_ms=1.0, per_token_sq_ms=0.0, per_token_cached_ms=0.0)


def calibration(min_samples: int = 4, refit_every: int = 2) -> CostCalibration:
    return CostCalibration(COST, DecodeCostModel(), min_samples=min_samples, refit_every=refit_every)


def test_the_overhead_is_the_median_residual_once_enough_hand_offs_were_measured():
    c = calibration()
    # residuals 100, 300, 0 (measured under its priced transfer: clipped), 200
    assert [c.observe_handoff(m, t) for m, t in ((110, 10), (305, 5), (4, 20))] == [False] * 3
    assert c.handoff_overhead_ms == 0.0 and c.handoff_error() is None
    assert c.observe_handoff(210, 10)  # the fourth: median of 0, 100, 200, 300
    assert c.handoff_overhead_ms == 150.0
    assert c.handoff_error() is None  # nothing predicted with an overhead yet
    # predicted 10 + 150 = 160 against 200 measured: 20% off; residual 190 joins the window
    assert not c.observe_handoff(200, 10)  # not a refit yet (every second one)
    assert c.handoff_error().median_pct == 20.0 and c.handoff_error().num_predictions == 1
    assert c.observe_handoff(400, 0)  # median of 0, 100, 190, 200, 300, 400
    assert c.handoff_overhead_ms == 195.0


def test_the_window_keeps_the_newest_hand_offs():
    c = calibration()
    for _ in range(HANDOFF_WINDOW):
        c.observe_handoff(1000.0, 0.0)
    assert c.handoff_overhead_ms == 1000.0
    for _ in range(HANDOFF_WINDOW // 2 + 2):  # more than half the window now measures 50 ms
        c.observe_handoff(50.0, 0.0)
    assert c.handoff_overhead_ms == 50.0


def test_bad_measurements_are_ignored():
    c = calibration(min_samples=4, refit_every=1)
    assert [c.observe_handoff(m, t) for m, t in ((0.0, 1.0), (-5.0, 1.0), (10.0, -1.0))] == [False] * 3
    assert c.handoff_overhead_ms == 0.0 and c.handoff_error() is None


def _state() -> ConductorState:
    """One prefill and one decode instance, Baton pricing the decode instance as a prefill
    candidate (the default colocation), 1 ms per uncached token on either."""
    config = PolicyConfig(block_size_tokens=BS, prefill_cost=COST)
    state = ConductorState("baton", config, calibration=calibration())
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)
    return state


def _request(request_id: str, first_token: int, num_blocks: int = 8) -> PlacementRequest:
    tokens = list(range(first_token, first_token + num_blocks * BS))
    keys = tuple(block_keys(tokens, BS, KeyExtras("m", "", "", "L")))
    return PlacementRequest(request_id, len(tokens), keys, 8)


def test_a_busy_decode_instance_hands_off_until_hand_offs_are_measured_to_cost_more():
    state = _state()
    # d0 prefills a first prompt itself (idle, no hand-off: co-located wins the tie) ...
    assert state.place(_request("busy", 10_000)).prefill_instance == "d0"
    # ... so the next prompt is priced behind its 128 ms there, and p0 plus a hand-off of bytes
    # (about a ms) is cheaper
    first = state.place(_request("a", 20_000))
    assert (first.prefill_instance, first.decode_instance) == ("p0", "d0")
    transfer_ms = first.handoff_ms  # the prompt's 8 blocks over the node's own path
    config = state.config
    assert transfer_ms == config.transfer.t_transfer_ms(8 * BS * config.kv_bytes_per_token, "same_node")
    assert "measured overhead" not in first.reason
    state.prefill_done("a", 0, 128.0)
    state.finished("a", handoff_ms=transfer_ms + 300.0)
    for i in range(3):  # three more hand-offs, each measured 300 ms over its bytes
        placed = state.place(_request(f"h{i}", 30_000 + 1_000 * i))
        assert placed.prefill_instance == "p0"
        state.prefill_done(f"h{i}", 0, 128.0)
        state.finished(f"h{i}", handoff_ms=placed.handoff_ms + 300.0)
    assert state.config.handoff_overhead_ms == 300.0
    # now p0's 128 ms + the 300 ms hand-off lose to waiting behind d0's 128 ms
    after = state.place(_request("b", 40_000))
    assert (after.prefill_instance, after.decode_instance) == ("d0", "d0")
    assert "measured overhead 300.0" in after.reason
    assert after.handoff_ms == 0.0


def test_only_disaggregated_placements_that_priced_a_hand_off_are_measured():
    state = _state()  # the overhead is set at the 4th counted hand-off (min_samples 4)
    colocated = state.place(_request("c", 50_000))
    assert colocated.prefill_instance == colocated.decode_instance == "d0"
    state.finished("c", handoff_ms=500.0)  # a stray figure for a co-located request: not counted
    assert state.place(_request("busy", 10_000)).prefill_instance == "d0"
    placed = state.place(_request("d", 60_000))
    assert placed.prefill_instance == "p0"
    state.prefill_done("d", 0, 128.0)
    state.finished("d")  # its hand-off was not measured (e.g. cancelled before a token)
    for i, residual_ms in enumerate((40.0, 42.0, 44.0, 46.0)):
        assert state.config.handoff_overhead_ms == 0.0  # had either counted, set by now
        placed = state.place(_request(f"e{i}", 70_000 + 1_000 * i))
        assert placed.prefill_instance == "p0"
        state.prefill_done(f"e{i}", 0, 128.0)
        state.finished(f"e{i}", handoff_ms=placed.handoff_ms + residual_ms)
    assert state.config.handoff_overhead_ms == 43.0  # the median of the four measured


def test_without_a_calibration_the_hand_off_costs_its_bytes():
    config = PolicyConfig(block_size_tokens=BS, prefill_cost=COST)
    state = ConductorState("baton", config)
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)
    state.place(_request("busy", 10_000))
    placed = state.place(_request("a", 20_000))
    state.finished("a", handoff_ms=10_000.0)
    assert state.config.handoff_overhead_ms == 0.0
    assert state.place(_request("b", 30_000)).prefill_instance == "p0"
