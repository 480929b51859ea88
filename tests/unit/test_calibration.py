"""The self-calibrating cost model: refits from measured timings, errors on unseen requests."""

from __future__ import annotations

import random

import pytest

from conductor.calibration import WARMUP_PRIOR_UNTIL, CostCalibration, mixed_step_ms
from conductor.cost_model import DecodeCostModel, PrefillCostModel
from conductor.policy import PolicyConfig
from conductor.state import ConductorState
from kvstore.keys import KeyExtras, block_keys
from protos.wire import PlacementRequest

MACHINE = PrefillCostModel(intercept_ms=40.0, per_token_ms=1.9, per_token_sq_ms=9e-4,
                           per_token_cached_ms=2e-3)
STEPS = DecodeCostModel(step_ms_base=90.0, step_ms_per_seq=4.0, step_ms_per_kv_token=0.015)


def agent_prefills(n: int, seed: int = 0, noise: float = 0.0):
    rng = random.Random(seed)
    for _ in range(n):
        uncached, cached = rng.randrange(16, 2048), rng.choice([0, 512, 1024, 1536, 3072])
        yield uncached, cached, MACHINE.t_prefill_ms(uncached, cached) * (1 + rng.uniform(-noise, noise))


def test_from_the_placeholders_the_warm_up_refit_finds_the_machine():
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8)
    measurements = list(agent_prefills(64))
    for m in measurements[:7]:
        assert not calibration.observe_prefill(*m)  # the warm-up: placeholders until 8
    assert calibration.observe_prefill(*measurements[7])
    assert calibration.prefill.per_token_ms == pytest.approx(MACHINE.per_token_ms, rel=1e-6)
    assert calibration.prefill_error() is None  # the placeholders' errors are not the calibration's
    calibration.observe_prefill(*measurements[8])  # the fitted model's first prediction
    assert calibration.prefill_error().num_predictions == 1
    fresh = CostCalibration(calibration.prefill, DecodeCostModel(), fitted=True)
    for m in measurements[8:]:
        fresh.observe_prefill(*m)
    # predicted before fitted on, by a model fitted on other requests: exact here
    assert fresh.prefill_error().p90_pct == pytest.approx(0.0, abs=1e-6)
    assert fresh.prefill_error().num_predictions == 56


def test_errors_are_measured_before_the_request_is_fitted_on():
    calibration = CostCalibration(MACHINE, DecodeCostModel(), min_samples=4, refit_every=1, fitted=True)
    calibration.observe_prefill(100, 0, MACHINE.t_prefill_ms(100, 0) * 2)  # predicted: half of it
    assert calibration.prefill_error().median_pct == pytest.approx(50.0)


def test_noisy_measurements_keep_the_error_within_the_noise():
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel())
    for m in agent_prefills(400, seed=1, noise=0.1):
        calibration.observe_prefill(*m)
    recent = CostCalibration(calibration.prefill, DecodeCostModel(), refit_every=10**9, fitted=True)
    for m in agent_prefills(200, seed=2, noise=0.1):
        recent.observe_prefill(*m)
    error = recent.prefill_error()
    assert error.median_pct < 6.0 and error.p90_pct < 11.0  # ±10% noise: |e| has median 5%, p90 9%


def test_a_window_without_spread_keeps_the_current_model():
    calibration = CostCalibration(MACHINE, DecodeCostModel(), min_samples=4, refit_every=4)
    for _ in range(8):
        assert not calibration.observe_prefill(128, 0, 300.0)  # one point: nothing to fit
    assert calibration.prefill is MACHINE and calibration.num_prefill_refits == 0


def test_decode_steps_refit_once_batch_and_context_both_vary():
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=6, refit_every=6)
    for seqs in (1, 4, 16):
        for context in (500, 8000):
            calibration.observe_decode_step(seqs, context, STEPS.t_step_ms(seqs, context))
    assert calibration.num_decode_refits == 1
    assert calibration.decode.step_ms_per_seq == pytest.approx(STEPS.step_ms_per_seq, rel=1e-6)
    assert calibration.decode_error() is None  # the warm-up's placeholders are not counted
    calibration.observe_decode_step(8, 4000, STEPS.t_step_ms(8, 4000))
    assert calibration.decode_error().num_predictions == 1
    assert calibration.decode_error().median_pct == pytest.approx(0.0, abs=1e-6)


def test_collinear_decode_steps_fit_without_swinging_terms():
    # context = 272 x batch, as a profile that grows both together measures: the two terms
    # cannot be told apart, and an unconstrained fit clipped afterwards went wild here
    rng = random.Random(3)
    steps = [(n, 272 * n, STEPS.t_step_ms(n, 272 * n) * (1 + rng.uniform(-0.05, 0.05)))
             for n in (1, 2, 3, 4, 6, 8) for _ in range(3)]
    fitted = DecodeCostModel.fit(steps)
    assert min(fitted.step_ms_base, fitted.step_ms_per_seq, fitted.step_ms_per_kv_token) >= 0.0
    for n in (1, 8, 16):  # within the noise on the line it was measured on, and sane past it
        assert fitted.t_step_ms(n, 272 * n) == pytest.approx(STEPS.t_step_ms(n, 272 * n), rel=0.1)


def test_a_refit_worse_on_its_window_than_the_current_model_is_not_taken():
    calibration = CostCalibration(MACHINE, DecodeCostModel(), min_samples=8, refit_every=8, fitted=True)
    measurements = list(agent_prefills(8, seed=5))
    measurements[3] = (*measurements[3][:2], measurements[3][2] * 10)  # one stalled prefill
    for m in measurements:
        assert not calibration.observe_prefill(*m)
    # the refit bends toward the outlier and predicts the other seven worse: MACHINE stays
    assert calibration.prefill is MACHINE and calibration.num_prefill_refits == 0
    clean = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8, fitted=True)
    assert [clean.observe_prefill(*m) for m in agent_prefills(8, seed=5)][-1]  # better: taken


def test_the_state_prices_with_the_refitted_model_after_reported_prefills():
    extras = KeyExtras("m", "", "", "L")
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8)
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16, short_prefill_tokens=0),
                           calibration=calibration)
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)
    for i, (uncached, cached, _) in enumerate(agent_prefills(8)):
        tokens = list(range(i * 10_000, i * 10_000 + uncached + cached))
        state.place(PlacementRequest(f"r{i}", len(tokens), tuple(block_keys(tokens, 16, extras)), 8))
        # the engine found ``cached`` tokens (another instance's, say) and took the machine's time
        state.prefill_done(f"r{i}", cached, MACHINE.t_prefill_ms(uncached, cached))
        state.finished(f"r{i}")
    assert calibration.num_prefill_refits == 1 and state.config.prefill_cost is calibration.prefill
    assert calibration.prefill.per_token_ms == pytest.approx(MACHINE.per_token_ms, rel=1e-6)
    tokens = list(range(900_000, 901_000))
    placement = state.place(PlacementRequest("next", 1000, tuple(block_keys(tokens, 16, extras)), 8))
    assert placement.prefill_ms == calibration.prefill.t_prefill_ms(1000, 0)


def test_only_a_prefill_that_ran_alone_on_its_instance_calibrates():
    extras = KeyExtras("m", "", "", "L")
    calibration = CostCalibration(MACHINE, DecodeCostModel(), fitted=True)
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16, short_prefill_tokens=0),
                           calibration=calibration)
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)

    def place(request_id: str, start: int):
        tokens = list(range(start, start + 512))
        return state.place(PlacementRequest(request_id, 512, tuple(block_keys(tokens, 16, extras)), 8))

    assert place("a", 0).prefill_instance == "p0"
    state.prefill_done("a", 0, MACHINE.t_prefill_ms(512, 0))  # alone: counted
    assert calibration.prefill_error().num_predictions == 1
    place("b", 10_000)
    place("c", 20_000)  # booked beside b: b and c share steps
    state.prefill_done("b", 0, MACHINE.t_prefill_ms(512, 0) * 2)
    state.prefill_done("c", 0, MACHINE.t_prefill_ms(512, 0) * 2)
    assert calibration.prefill_error().num_predictions == 1  # neither counted
    for request_id in ("a", "b", "c"):
        state.finished(request_id)


def test_a_colocated_prefill_beside_a_decode_batch_is_judged_with_the_batch_it_was_priced_with():
    extras = KeyExtras("m", "", "", "L")
    calibration = CostCalibration(MACHINE, STEPS, fitted=True)
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16), calibration=calibration)
    state.register("d0", "decode", "n0", "m", "L")  # a co-located pool of one
    state.set_ready("d0", True)

    def place(request_id: str, start: int):
        tokens = list(range(start, start + 512))
        return state.place(PlacementRequest(request_id, 512, tuple(block_keys(tokens, 16, extras)), 8))

    first = place("a", 0)
    assert first.decode_batch_ms == 0.0  # nothing decoding yet
    state.prefill_done("a", 0, MACHINE.t_prefill_ms(512, 0))  # a decodes from now on
    second = place("b", 10_000)
    assert second.prefill_instance == "d0" and second.decode_batch_ms > 0.0
    state.prefill_done("b", 0, MACHINE.t_prefill_ms(512, 0) + second.decode_batch_ms)
    error = calibration.prefill_error()
    assert error.num_predictions == 2 and error.p90_pct == pytest.approx(0.0, abs=1e-6)
    for request_id in ("a", "b"):
        state.finished(request_id)


def test_the_state_prices_decode_steps_with_the_refitted_model():
    from protos.wire import DecodeStep

    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=6, refit_every=6)
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16), calibration=calibration)
    steps = [DecodeStep(n, c, STEPS.t_step_ms(n, c)) for n in (1, 4, 16) for c in (500, 8000)]
    state.observe_decode_steps(steps[:5])
    assert state.config.decode_cost == DecodeCostModel()  # not refitted before 6
    state.observe_decode_steps(steps[5:])
    assert state.config.decode_cost is calibration.decode
    assert calibration.decode.step_ms_per_seq == pytest.approx(STEPS.step_ms_per_seq, rel=1e-6)


def test_admissions_tbt_margin_follows_the_decode_models_measured_p90_error():
    from conductor.calibration import MIN_TBT_ERROR_SAMPLES, tbt_error_margin
    from protos.wire import DecodeStep, PredictionError

    assert tbt_error_margin(None) == 0.0
    assert tbt_error_margin(PredictionError(5.0, 12.0, MIN_TBT_ERROR_SAMPLES - 1)) == 0.0
    assert tbt_error_margin(PredictionError(5.0, 12.0, MIN_TBT_ERROR_SAMPLES)) == 0.12
    assert tbt_error_margin(PredictionError(40.0, 80.0, 100)) == 0.5  # capped

    calibration = CostCalibration(PrefillCostModel(), STEPS, min_samples=6, refit_every=6,
                                  fitted=True)
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16), calibration=calibration)
    # every step runs 1.2x what the model predicts: a 1/6 error on each (|pred - real| / real)
    steps = [DecodeStep(n, c, STEPS.t_step_ms(n, c) * 1.2) for n in (1, 4, 16) for c in (500, 8000)]
    state.observe_decode_steps(steps[:2])
    assert state.config.tbt_error_frac == 0.0  # too few held-out steps yet
    state.observe_decode_steps(steps * 3)
    assert calibration.decode_error().num_predictions >= MIN_TBT_ERROR_SAMPLES
    assert state.config.tbt_error_frac == tbt_error_margin(calibration.decode_error()) > 0.0


def test_a_prefill_beside_a_decode_batch_is_fitted_without_the_batch_and_judged_with_it():
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8)
    rng = random.Random(11)
    # half of the prefills ran beside a batch whose steps, as priced, added 30-60 ms to them
    for i, (uncached, cached, own) in enumerate(agent_prefills(16, seed=4)):
        batch = rng.uniform(30.0, 60.0) if i % 2 else 0.0
        calibration.observe_prefill(uncached, cached, own + batch, batch)
    assert calibration.num_prefill_refits >= 1
    for u, c in ((64, 0), (300, 1536), (1500, 0)):  # the prompt's own work, not the batch's
        assert calibration.prefill.t_prefill_ms(u, c) == pytest.approx(MACHINE.t_prefill_ms(u, c), rel=1e-3)
    before = calibration.prefill_error().num_predictions
    calibration.observe_prefill(300, 1536, MACHINE.t_prefill_ms(300, 1536) + 45.0, 45.0)
    error = calibration.prefill_error()
    assert error.num_predictions == before + 1 and error.median_pct == pytest.approx(0.0, abs=1e-3)
    assert not calibration.observe_prefill(300, 0, 40.0, 50.0)  # more batch than measured: not fitted
    assert not calibration.observe_prefill(300, 0, 400.0, -1.0)


def test_a_finished_request_is_judged_on_its_decode_steps_summed_each_predicted_before_fitted():
    from protos.wire import DecodeSpan, DecodeStep

    calibration = CostCalibration(PrefillCostModel(), STEPS, min_samples=6, refit_every=1000,
                                  fitted=True)
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16), calibration=calibration)
    # steps 0-3 on e0: predicted p, measured 1.3p, 0.8p, 1.25p, 1.0p; one request was in 1-3
    scale = [1.3, 0.8, 1.25, 1.0]
    steps = [DecodeStep(2, 1000 + i, STEPS.t_step_ms(2, 1000 + i) * k, i) for i, k in enumerate(scale)]
    state.observe_decode_steps(steps, "e0", (DecodeSpan(1, 3),))
    predicted = [STEPS.t_step_ms(2, 1000 + i) for i in range(1, 4)]
    measured = [p * k for p, k in zip(predicted, scale[1:])]
    expected = abs(sum(predicted) - sum(measured)) / sum(measured) * 100
    error = calibration.decode_request_error()
    assert (error.num_predictions, error.median_pct) == (1, round(expected, 2))
    assert expected < 5.0 < 20.0 < calibration.decode_error().median_pct  # per step: 0-25% off
    # another engine's numbers are its own; a span with fewer than 2 predicted steps is not judged
    assert not calibration.observe_decode_span("e1", 1, 3)
    assert not calibration.observe_decode_span("e0", 3, 9)
    assert not calibration.observe_decode_span("e0", 3, 2)
    # an engine whose numbering starts again (a new process, same name) drops the old steps
    state.observe_decode_steps([DecodeStep(2, 1000, STEPS.t_step_ms(2, 1000), 0)], "e0")
    assert not calibration.observe_decode_span("e0", 1, 3)


def test_steps_measured_before_the_model_was_fitted_are_not_judged_per_request():
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=6, refit_every=6)
    for i, (seqs, context) in enumerate([(1, 500), (4, 500), (16, 500), (1, 8000), (4, 8000), (16, 8000)]):
        calibration.observe_decode_step(seqs, context, STEPS.t_step_ms(seqs, context), "e0", i)
    assert calibration.num_decode_refits == 1
    assert not calibration.observe_decode_span("e0", 0, 5)  # priced by the placeholders
    for i in (6, 7):
        calibration.observe_decode_step(2, 900, STEPS.t_step_ms(2, 900), "e0", i)
    assert calibration.observe_decode_span("e0", 0, 7)  # judged on 6 and 7 only
    assert calibration.decode_request_error().median_pct == pytest.approx(0.0, abs=1e-6)


def test_the_decode_model_follows_the_machine_when_the_same_steps_get_faster():
    # 200 steps while another engine computes beside (slow), then the same shapes at 0.6x
    fast = DecodeCostModel(step_ms_base=STEPS.step_ms_base * 0.6, step_ms_per_seq=STEPS.step_ms_per_seq * 0.6,
                           step_ms_per_kv_token=STEPS.step_ms_per_kv_token * 0.6)
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8)
    shapes = [(n, n * 1700 + 24 * i) for i in range(25) for n in (4, 6, 8, 10, 12, 8, 6, 4)]
    for n, context in shapes:
        calibration.observe_decode_step(n, context, STEPS.t_step_ms(n, context))
    assert calibration.decode.t_step_ms(10, 17000) == pytest.approx(STEPS.t_step_ms(10, 17000), rel=0.01)
    for n, context in shapes[:64]:
        calibration.observe_decode_step(n, context, fast.t_step_ms(n, context))
    # within 64 steps of the change it prices the machine as it is now
    assert calibration.decode.t_step_ms(10, 17000) == pytest.approx(fast.t_step_ms(10, 17000), rel=0.02)


def test_a_prompts_chunks_are_priced_as_its_share_of_its_prefill():
    # three steps of 512, 512 and 79 uncached tokens over a 256-token prefix hit
    shares = [MACHINE.t_chunk_ms(0, 512, 256), MACHINE.t_chunk_ms(512, 512, 256),
              MACHINE.t_chunk_ms(1024, 79, 256)]
    assert shares[0] == pytest.approx(MACHINE.t_prefill_ms(512, 256))  # the intercept, once
    assert sum(shares) == pytest.approx(MACHINE.t_prefill_ms(1103, 256))
    assert shares[1] == pytest.approx(MACHINE.t_prefill_ms(1024, 256) - MACHINE.t_prefill_ms(512, 256))


def test_a_mixed_step_is_judged_as_placement_prices_it_and_never_fitted_on():
    from protos.wire import MixedStep, PromptChunk

    calibration = CostCalibration(MACHINE, STEPS, min_samples=6, refit_every=1, fitted=True)
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16), calibration=calibration)
    chunks = (PromptChunk(done_tokens=0, num_tokens=300, cached_tokens=1500),
              PromptChunk(done_tokens=512, num_tokens=211, cached_tokens=0))
    priced = (STEPS.t_step_ms(3, 5000) + MACHINE.t_prefill_ms(300, 1500)
              + MACHINE.t_chunk_ms(512, 211, 0))
    state.observe_decode_steps((), "e0", (), (MixedStep(3, 5000, chunks, priced * 1.25, 0),))
    error = calibration.mixed_step_error()
    assert (error.num_predictions, error.median_pct) == (1, round(abs(priced - priced * 1.25) / (priced * 1.25) * 100, 2))
    assert (calibration.num_decode_refits, calibration.num_prefill_refits) == (0, 0)
    assert calibration.decode is STEPS and calibration.prefill is MACHINE
    assert calibration.decode_error() is None  # not a decode-only step
    # a prompt found whole (cached or loaded) computes its last token: one more decoding sequence
    whole = (PromptChunk(done_tokens=0, num_tokens=1, cached_tokens=1800),)
    state.observe_decode_steps((), "e0", (), (MixedStep(3, 5000, whole + chunks[:1], 100.0, 1),))
    assert calibration.mixed_step_error().num_predictions == 2
    assert mixed_step_ms(MACHINE, STEPS, 3, 5000, whole + chunks[:1]) == pytest.approx(
        STEPS.t_step_ms(4, 6800) + MACHINE.t_prefill_ms(300, 1500))
    # KV blocks copied in on the step are priced as a same-node transfer of their bytes
    config = state.config
    copied = config.transfer.t_transfer_ms(112 * config.block_size_tokens * config.kv_bytes_per_token,
                                           "same_node")
    measured = mixed_step_ms(MACHINE, STEPS, 3, 5000, whole) + copied
    state.observe_decode_steps((), "e0", (), (MixedStep(3, 5000, whole, measured, 2, loaded_blocks=112),))
    assert copied > 10.0 and calibration.mixed_step_error().num_predictions == 3
    assert calibration._mixed_errors[-1] == pytest.approx(0.0, abs=1e-9)  # the newest: priced exactly
    # not judged without chunks, or before both models are fitted
    assert not calibration.observe_mixed_step(3, 5000, (), 100.0, "e0", 1)
    unfitted = CostCalibration(MACHINE, STEPS, min_samples=6, refit_every=1)
    assert not unfitted.observe_mixed_step(3, 5000, chunks, 100.0, "e0", 1)


def test_a_finished_request_is_judged_over_its_decode_only_and_mixed_steps_together():
    from protos.wire import DecodeSpan, DecodeStep, MixedStep, PromptChunk

    calibration = CostCalibration(MACHINE, STEPS, min_samples=6, refit_every=1000, fitted=True)
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16), calibration=calibration)
    chunk = (PromptChunk(done_tokens=0, num_tokens=250, cached_tokens=1600),)
    mixed_price = STEPS.t_step_ms(2, 3000) + MACHINE.t_prefill_ms(250, 1600)
    # steps 0 and 2 decode only, 1 and 3 mixed; the request decoded in 0-3 (seq 4: after it ended)
    state.observe_decode_steps(
        (DecodeStep(2, 3000, STEPS.t_step_ms(2, 3000) * 1.1, 0),
         DecodeStep(2, 3002, STEPS.t_step_ms(2, 3002) * 1.1, 2),
         DecodeStep(1, 1500, 500.0, 4)), "e0", (DecodeSpan(0, 3),),
        (MixedStep(2, 3001, chunk, mixed_price * 0.7, 1), MixedStep(2, 3003, chunk, mixed_price * 0.7, 3)))
    decode_only = [(STEPS.t_step_ms(2, c), STEPS.t_step_ms(2, c) * 1.1) for c in (3000, 3002)]
    every = decode_only + [(STEPS.t_step_ms(2, c) + MACHINE.t_prefill_ms(250, 1600), mixed_price * 0.7)
                           for c in (3001, 3003)]

    def summed(pairs):
        return round(abs(sum(p for p, _ in pairs) - sum(m for _, m in pairs)) / sum(m for _, m in pairs) * 100, 2)

    assert calibration.decode_request_error().median_pct == summed(decode_only)
    assert calibration.request_all_steps_error().median_pct == summed(every)
    # a request that decoded only beside chunks is judged over all its steps, not the decode model's
    assert not calibration.observe_decode_span("e0", 1, 1)
    assert not calibration.observe_decode_span("e0", 3, 3)
    assert calibration.request_all_steps_error().num_predictions == 1
    calibration.observe_decode_span("e0", 1, 3)
    assert calibration.request_all_steps_error().num_predictions == 2
    assert calibration.decode_request_error().num_predictions == 1  # seq 2 alone: under 2 steps


# --- engines' warm-up measurements: the first fit ----------------------------------------------

SHOP = PrefillCostModel(intercept_ms=30.0, per_token_ms=0.43, per_token_sq_ms=1e-4,
                        per_token_cached_ms=1.4e-4, per_cached_token_ms=0.031)
"""Fitted on vLLM-CPU measurements (SmolLM2, one core): 87 new over 1,408 cached ~130 ms."""


def warmup(model: PrefillCostModel = SHOP, slower: float = 1.0):
    from engine.warmup import warmup_points
    from protos.wire import MeasuredPrefill

    return [MeasuredPrefill(u, c, model.t_prefill_ms(u, c) * slower) for u, c in warmup_points(8192, 128)]


def test_a_warm_start_replaces_the_placeholders_at_once_and_errors_count_only_live_requests():
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8)
    assert calibration.warm_start(warmup())
    for field in set(PrefillCostModel.model_fields) - {"floor_ms"}:
        assert getattr(calibration.prefill, field) == pytest.approx(getattr(SHOP, field), rel=1e-6)
    assert calibration.prefill.floor_ms == round(SHOP.t_prefill_ms(8, 0), 1)  # its tiny prompt
    assert calibration.prefill_error() is None  # warm-up prefills are not predictions
    calibration.observe_prefill(214, 1408, SHOP.t_prefill_ms(214, 1408) * 1.5)
    assert calibration.prefill_error().median_pct == 33.33  # predicted 1/1.5 of it (rounded)


def test_later_engines_warm_ups_refine_the_warm_start_until_a_live_refit():
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8)
    assert calibration.warm_start(warmup(slower=2.0))  # one engine, started beside the others
    assert calibration.warm_start(warmup(slower=1.0))  # the next: fitted on both engines' prefills
    both = calibration.prefill.t_prefill_ms(1024, 0) / SHOP.t_prefill_ms(1024, 0)
    assert 1.0 < both < 2.0
    rng = random.Random(4)
    assert calibration.prefill_source() == "warm-up of 16 prefills"  # both engines' eight
    for _ in range(8):  # live traffic: the machine as SHOP says, a spread of u and c
        u, c = rng.randrange(16, 2048), rng.choice([0, 512, 1024, 2048])
        calibration.observe_prefill(u, c, SHOP.t_prefill_ms(u, c))
    assert calibration.num_prefill_refits == 1
    assert calibration.prefill_source() == "refit 1 times on live prefills"
    refit = calibration.prefill
    assert not calibration.warm_start(warmup(slower=3.0))  # a live refit is not replaced
    assert calibration.prefill is refit
    for _ in range(WARMUP_PRIOR_UNTIL - 8):  # the live window full enough: the warm-up leaves the fit
        u, c = rng.randrange(16, 2048), rng.choice([0, 512, 1024, 2048])
        calibration.observe_prefill(u, c, SHOP.t_prefill_ms(u, c))
    assert calibration.prefill.t_prefill_ms(1024, 0) == pytest.approx(SHOP.t_prefill_ms(1024, 0), rel=1e-6)


def test_a_few_live_shapes_are_fitted_with_the_warm_ups_grid():
    # an agent fleet's first live window: cold prompts and steps over one prefix length, on a
    # machine 10% slower than its warm-up measured; alone, the window cannot pin five terms
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8)
    assert calibration.warm_start(warmup())
    live = [(1495, 0), (87, 1408), (214, 1408), (1506, 0), (87, 1408), (214, 1408), (87, 1408), (1495, 0)]
    for u, c in live:
        calibration.observe_prefill(u, c, SHOP.t_prefill_ms(u, c) * 1.1)
    assert calibration.num_prefill_refits == 1
    for u, c in ((512, 2048), (128, 1024), (2048, 0)):  # between the warm-up and the live level
        assert SHOP.t_prefill_ms(u, c) < calibration.prefill.t_prefill_ms(u, c) < SHOP.t_prefill_ms(u, c) * 1.1


def test_no_prefill_is_priced_under_the_floor_and_the_default_has_none():
    floored = SHOP.model_copy(update={"floor_ms": 45.0})
    assert SHOP.t_prefill_ms(2, 0) == pytest.approx(30.0 + 0.43 * 2 + 4e-4)  # the polynomial
    assert floored.t_prefill_ms(2, 0) == 45.0
    assert floored.t_prefill_ms(1024, 0) == SHOP.t_prefill_ms(1024, 0)  # above it: the polynomial
    assert floored.t_prefill_ms(1, 1408) == SHOP.t_prefill_ms(1, 1408)  # a prefix costs its own
    assert PrefillCostModel.model_validate_json(SHOP.model_dump_json(exclude={"floor_ms"})) == SHOP


def test_the_floor_is_the_median_of_the_tiniest_prompts_each_predicted_before_it_counts():
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel(), min_samples=8, refit_every=8)
    calibration.warm_start(warmup())
    warm_floor = round(SHOP.t_prefill_ms(8, 0), 1)
    assert calibration.prefill.t_prefill_ms(2, 0) == warm_floor  # not the polynomial's 30.9 ms
    assert calibration.observe_prefill(2, 0, 60.0)  # a readiness check: the floor moves
    assert calibration.prefill_error().median_pct == pytest.approx(abs(warm_floor - 60.0) / 60.0 * 100, abs=0.01)
    assert calibration.prefill.floor_ms == round((warm_floor + 60.0) / 2, 1)
    moved = calibration.prefill
    assert not calibration.observe_prefill(17, 0, 90.0)  # past FLOOR_TOKENS
    assert not calibration.observe_prefill(1, 1408, 90.0)  # a cached prefix: not a floor
    assert not calibration.observe_prefill(9, 0, 90.0, batch_ms=40.0)  # beside a decode batch
    assert calibration.prefill is moved
    assert calibration.observe_prefill(9, 0, 61.0)  # median of 33.4, 60, 61
    assert calibration.prefill.floor_ms == 60.0
    assert not calibration.observe_prefill(9, 0, 60.0)  # median still 60: the model is unchanged


def test_a_profile_is_not_replaced_by_a_warm_start():
    calibration = CostCalibration(MACHINE, DecodeCostModel(), fitted=True)
    assert not calibration.warm_start(warmup())
    assert calibration.prefill == MACHINE and calibration.prefill_source() == "profile"
    assert CostCalibration(PrefillCostModel(), DecodeCostModel()).prefill_source() == "placeholders"


def test_the_state_prices_the_first_request_with_the_engines_warm_up():
    extras = KeyExtras("m", "", "", "L")
    calibration = CostCalibration(PrefillCostModel(), DecodeCostModel())
    state = ConductorState("baton", PolicyConfig(block_size_tokens=16, short_prefill_tokens=0),
                           calibration=calibration)
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        state.register(instance_id, role, "n0", "m", "L")
        state.set_ready(instance_id, True)
    state.observe_warmup(warmup())
    assert state.config.prefill_cost is calibration.prefill
    tokens = list(range(1495))
    placement = state.place(PlacementRequest("first", 1495, tuple(block_keys(tokens, 16, extras)), 8))
    assert placement.prefill_ms == pytest.approx(SHOP.t_prefill_ms(1495, 0), rel=1e-6)
