"""The self-calibrating cost model: the prefill and decode-step models refitted from the timings
the engines report, with the error they make on measurements they were not fitted on.

``CostCalibration`` starts from given models (``baton profile``'s fit, ``fitted``; or the
placeholders: then the first refit, after ``min_samples`` measurements, is the warm-up, and the
placeholders' errors are not counted). Each measurement is first predicted with the current
fitted model and its absolute percentage error recorded, and only then added to the window the
next refit uses, so every reported error is on a request the model had not seen. Every
``refit_every`` measurements the model is refitted on the last ``window`` of them
(``cost_model.nonnegative_relative_fit``); a window the fit cannot use (too few, or no spread)
keeps the current model, and so does a refit that predicts its own window worse than it. The
decode model's window is shorter (``DECODE_WINDOW``, the refit judged on its newest
``DECODE_JUDGED_ON`` steps): a step's time follows what else the machine is doing, and a long
window lagged every change of it.

Engines' warm-up measurements (``engine.warmup``) start the model when no profile was given:
while no live refit has happened, the warm-up prefills every engine reported so far are fitted
at once, so the first requests are priced with this machine's figures instead of placeholders
(which priced 87 new tokens over 1,408 cached at 45 ms where they take ~135 ms). They also join
the live refits while the live window holds fewer than ``WARMUP_PRIOR_UNTIL`` measurements: the
first live windows are a few prompt shapes (an agent fleet's first 8 alone-prefills were 6 cold
prompts and 2 steps), too few to pin five terms, and a refit on them alone priced the next steps
up to 35% off where the warm-up's grid, spread over the whole range, keeps them in place. Past
that count they leave the fit: measured while the engines start side by side, they can run
slower than live traffic (1.7x seen before the warm-up's tiny prompt), and kept for good they
held the live error at a 22% median where live refits alone reach 5%. Either way a refit is
judged on the live window only. Errors are only counted on live measurements, each predicted
before it joins a fit.

A step that decodes beside prompt chunks (a co-located engine) is judged, never fitted on, as
placement prices it: the decode model's step plus each chunk's share of its prompt's prefill
(``observe_mixed_step``); a finished request is judged over its decode-only steps (the decode
model's own figure) and over all the steps it decoded in (the whole cost model's).

The KV hand-off of a disaggregated request is priced as its bytes' transfer plus a measured
overhead (``PolicyConfig.handoff_overhead_ms``): the decode instance's lookup and load, the step
boundaries it waits for and its first step beside its running batch. The router measures each
hand-off (a prefill's result to the decode's first token); ``observe_handoff`` keeps the last
``HANDOFF_WINDOW`` of them less their priced transfer, and the overhead is their median, updated
every ``refit_every`` hand-offs once ``min_samples`` were seen. Before it, hand-offs cost their
bytes only, which priced them 39-849 ms (median ~200) under what they took (``baton bench
sessions``, one prefill and one decode instance on two cores).

Pure mechanism, no I/O: the conductor's state feeds it and reads the models back.
"""

from __future__ import annotations

from collections import deque

import msgspec
import numpy as np

from conductor.cost_model import DecodeCostModel, PrefillCostModel, PrefillSample
from conductor.policy_config import TBT_ERROR_FRAC_CAP
from protos.wire import PredictionError

__all__ = ["CostCalibration", "PredictionError", "tbt_error_margin"]

MAX_WARMUP_SAMPLES = 64
"""Warm-up measurements kept for the first fit (the newest; an engine brings eight)."""

WARMUP_PRIOR_UNTIL = 32
"""Live prefills the window must hold before a refit leaves the warm-up measurements out (see the
module). Replaying 8 logged live runs (2 seeds x 2 runs x both Baton stacks, agent fleet first)
through the calibration, the fleet's error went from medians 9-17% / p90s 17-32% (1p1d) to
5-9% / 17-21%; 16 left two sessions' medians above 10%, 64 changed nothing over 32."""


def _window_error(predict, samples) -> float:
    """Median absolute percentage error of ``predict(a, b)`` over samples of (a, b, ms)."""
    errors = [abs(predict(s.uncached_tokens, s.cached_tokens) - s.prefill_ms) / s.prefill_ms
              for s in samples if s.prefill_ms > 0]
    return float(np.median(errors)) if errors else 0.0


def _summary(errors: deque) -> PredictionError | None:
    if not errors:
        return None
    values = np.fromiter(errors, dtype=np.float64, count=len(errors))
    return PredictionError(round(float(np.median(values)), 2), round(float(np.percentile(values, 90)), 2),
                           len(values))


FLOOR_TOKENS = 16
"""A prompt of at most this many tokens, none cached, measures the prefill model's floor
(``PrefillCostModel.floor_ms``: one engine step, whatever the tokens). The benchmarks'
readiness checks and warm requests (2 to 9 tokens) had been priced 29-52 ms where they took
37-63, among the largest errors of a run. Replaying logged live runs through the calibration
(bf16 box, 2026-12-06), prefill p90 %: seed 12, three baton-0p2d runs, 12.5 / 19.8 / 18.0
without the floor, 12.5 / 18.8 / 16.6 with it; seed 9, four runs of both Baton stacks, with a
floor from the warm-up alone, 22.2 / 32.9 / 16.8 / 11.2 without, 20.7 / 32.9 / 15.8 / 11.2 with.
Medians moved by less than a point."""

FLOOR_WINDOW = 16
"""The floor is the median of the newest this many tiny prompts (warm-up and live)."""


HANDOFF_WINDOW = 64
"""Measured hand-offs the overhead is the median of (the newest): it follows the decode
batch's step time as load changes."""


DECODE_WINDOW = 64
"""Decode steps the decode model is refitted on (the newest). A step's time moves with what
else the machine runs, not only with its batch and context: on two cores, steps of the same
shape took ~40 ms beside the other engine's cold prompts and ~25 ms without (1p1d, SmolLM2), so
a model fitted on 256 steps lagged a change of workload by ~100 steps, all priced 60-75% over.
Replaying three logged live runs (1,461 held-out steps, 2 seeds, both Baton stacks, private
prefixes then the fleet): per-step error median / p90 8.5 / 74.7, 7.4 / 24.2, 12.4 / 87.9 % with
256; 3.6 / 14.5, 6.3 / 20.1, 3.3 / 17.8 % with 64 judged on the newest 32 (32 steps: about the
same, 128: p90 up to 83 %)."""

DECODE_JUDGED_ON = 32
"""A decode refit replaces the model unless it predicts the newest this many steps of its
window worse (the rest of the window is what it is fitted on, not what it must now price)."""

PREDICTED_STEPS_KEPT = 4096
"""Per instance, the newest numbered decode steps whose held-out prediction is kept for the
per-request error (``observe_decode_span``): a request whose span reaches further back is
judged on the steps still kept."""

MIN_SPAN_STEPS = 2
"""A finished request is judged per request over at least this many predicted steps."""

MIN_TBT_ERROR_SAMPLES = 16
"""Held-out decode steps the margin waits for before it trusts the measured error."""


def mixed_step_ms(prefill: PrefillCostModel, decode: DecodeCostModel, num_seqs: int,
                  context_tokens: int, chunks) -> float:
    """The price of a step that decodes ``num_seqs`` sequences over ``context_tokens`` beside
    prompt ``chunks`` (``PromptChunk``s), as placement prices a co-located prefill: the decode
    model's step plus each chunk's share of its prompt's prefill (``t_chunk_ms``). A chunk of
    one token is a prompt found whole (cached or loaded: vLLM computes its last token again)
    and costs what one more decoding sequence over its context does; the prefill model, fitted
    on prompts that compute, priced a hand-off's first step on a decode engine (one sequence
    decoding beside it) at ~40 ms where it took 23-27 (SmolLM2, one CPU core)."""
    singles = [c for c in chunks if c.num_tokens == 1]
    context = context_tokens + sum(c.done_tokens + c.cached_tokens for c in singles)
    return decode.t_step_ms(num_seqs + len(singles), context) + sum(
        prefill.t_chunk_ms(c.done_tokens, c.num_tokens, c.cached_tokens)
        for c in chunks if c.num_tokens != 1)


def _keep(predictions: dict[str, dict[int, tuple[float, float]]], instance_id: str, seq: int,
          predicted: float, measured: float) -> None:
    steps = predictions.setdefault(instance_id, {})
    if steps and seq <= next(reversed(steps)):
        steps.clear()  # numbering started again: a new engine under the same name
    steps[seq] = (predicted, measured)
    if len(steps) > PREDICTED_STEPS_KEPT:
        del steps[next(iter(steps))]  # the oldest (numbers arrive in order)


def _sum_error(kept: list[tuple[float, float]]) -> float:
    """Absolute percentage error of the summed predictions against the summed measurements."""
    predicted, measured = sum(p for p, _ in kept), sum(m for _, m in kept)
    return abs(predicted - measured) / measured * 100.0


def tbt_error_margin(error: PredictionError | None) -> float:
    """Admission's inter-token margin (``PolicyConfig.tbt_error_frac``) from the decode model's
    measured error (``PredictionError``, in percent): its p90 as a fraction, capped; 0 until
    ``MIN_TBT_ERROR_SAMPLES`` steps were predicted before being fitted."""
    if error is None or error.num_predictions < MIN_TBT_ERROR_SAMPLES:
        return 0.0
    return round(min(TBT_ERROR_FRAC_CAP, error.p90_pct / 100.0), 3)


class CostCalibration:
    """Online refits of ``PrefillCostModel`` and ``DecodeCostModel`` (see the module)."""

    def __init__(self, prefill: PrefillCostModel, decode: DecodeCostModel, window: int = 256,
                 min_samples: int = 8, refit_every: int = 8, error_window: int = 256,
                 fitted: bool = False, decode_window: int = DECODE_WINDOW) -> None:
        assert window >= min_samples >= 4 and refit_every >= 1 and error_window >= 1
        assert decode_window >= min_samples
        self.prefill, self.decode = prefill, decode
        self._window, self._min_samples, self._refit_every = window, min_samples, refit_every
        self._prefills: deque[PrefillSample] = deque(maxlen=window)
        self._warmup: deque[PrefillSample] = deque(maxlen=MAX_WARMUP_SAMPLES)
        self._tiny: deque[float] = deque(maxlen=FLOOR_WINDOW)
        """The newest tiny prompts' measured ms (``FLOOR_TOKENS``): the floor is their median."""
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=decode_window)
        self._prefill_errors: deque[float] = deque(maxlen=error_window)
        self._step_errors: deque[float] = deque(maxlen=error_window)
        self._request_errors: deque[float] = deque(maxlen=error_window)
        self._mixed_errors: deque[float] = deque(maxlen=error_window)
        self._request_all_errors: deque[float] = deque(maxlen=error_window)
        self._predicted_steps: dict[str, dict[int, tuple[float, float]]] = {}
        """instance -> step number -> (predicted, measured ms), for steps predicted before fitted."""
        self._predicted_mixed: dict[str, dict[int, tuple[float, float]]] = {}
        """The same for mixed steps (``observe_mixed_step``), kept apart: the decode model's own
        per-request figure covers decode-only steps."""
        self._handoff_residuals: deque[float] = deque(maxlen=HANDOFF_WINDOW)
        self._handoff_errors: deque[float] = deque(maxlen=error_window)
        self._since_handoff_fit = 0
        self.handoff_overhead_ms = 0.0
        """What a hand-off costs beyond its bytes (ms): 0 until ``min_samples`` were measured."""
        self._handoff_fitted = False
        self._since_prefill_fit = self._since_step_fit = 0
        self.num_prefill_refits = self.num_decode_refits = 0
        self._prefill_fitted = self._decode_fitted = fitted
        self._warm_started = False
        """The prefill model is a warm start's fit (later warm-ups refine it, live refits end it)."""

    def warm_start(self, samples) -> bool:
        """An engine's warm-up measurements (``MeasuredPrefill``s); True when they (with the
        other engines' so far) replaced the prefill model: only while it is the placeholders'
        or an earlier warm start's, never a profile's or a live refit's."""
        if self._prefill_fitted and not self._warm_started:
            return False
        for m in samples:
            if m.prefill_ms > 0 and m.uncached_tokens >= 0 and m.cached_tokens >= 0:
                self._warmup.append(PrefillSample(uncached_tokens=m.uncached_tokens,
                                                  cached_tokens=m.cached_tokens, prefill_ms=m.prefill_ms))
                self._note_tiny(m.uncached_tokens, m.cached_tokens, m.prefill_ms)
        try:
            self.prefill = self._floored(PrefillCostModel.fit(self._warmup))
        except ValueError:  # too few or no spread: the placeholders stay until live refits
            return False
        self._prefill_fitted = self._warm_started = True
        return True

    def observe_prefill(self, uncached_tokens: int, cached_tokens: int, prefill_ms: float,
                        batch_ms: float = 0.0) -> bool:
        """One measured prefill; True when it refitted the prefill model (or moved its floor:
        a tiny prompt, ``FLOOR_TOKENS``, measured after it was predicted). ``batch_ms``: the
        decode batch's steps its chunks shared, as priced (a co-located prefill beside running
        sequences): predicted with it, and fitted on the measured time less it (the prefill
        model is the prompt's own work; placement adds the batch)."""
        if prefill_ms <= 0 or uncached_tokens < 0 or cached_tokens < 0 or batch_ms < 0:
            return False
        if self._prefill_fitted:  # the placeholders' errors say nothing about the calibration
            predicted = self.prefill.t_prefill_ms(uncached_tokens, cached_tokens) + batch_ms
            self._prefill_errors.append(abs(predicted - prefill_ms) / prefill_ms * 100.0)
        floor_moved = False
        if batch_ms == 0 and self._note_tiny(uncached_tokens, cached_tokens, prefill_ms) \
                and self._prefill_fitted:
            floored = self._floored(self.prefill)
            floor_moved, self.prefill = floored is not self.prefill, floored
        own_ms = prefill_ms - batch_ms
        if own_ms <= 0:  # the batch priced at placement outweighs the whole measurement
            return floor_moved
        self._prefills.append(PrefillSample(uncached_tokens=uncached_tokens, cached_tokens=cached_tokens,
                                            prefill_ms=own_ms))
        self._since_prefill_fit += 1
        if len(self._prefills) < self._min_samples or self._since_prefill_fit < self._refit_every:
            return floor_moved
        self._since_prefill_fit = 0
        rows = list(self._prefills)
        if len(rows) < WARMUP_PRIOR_UNTIL:  # a few live shapes: the warm-up's grid holds the rest
            rows = list(self._warmup) + rows
        try:
            refit = self._floored(PrefillCostModel.fit(rows))
        except ValueError:  # no spread to fit on yet: keep predicting with what we have
            return floor_moved
        if self._prefill_fitted and _window_error(refit.t_prefill_ms, self._prefills) > _window_error(
                self.prefill.t_prefill_ms, self._prefills):
            return floor_moved  # worse on its own window than the model it would replace
        self.prefill, self._prefill_fitted, self._warm_started = refit, True, False
        self.num_prefill_refits += 1
        return True

    def _note_tiny(self, uncached_tokens: int, cached_tokens: int, prefill_ms: float) -> bool:
        """Keep a tiny prompt's measurement for the floor; True when it was one."""
        if cached_tokens or not 0 < uncached_tokens <= FLOOR_TOKENS or prefill_ms <= 0:
            return False
        self._tiny.append(prefill_ms)
        return True

    def _floored(self, model: PrefillCostModel) -> PrefillCostModel:
        """``model`` with the floor its tiny prompts measured (unchanged before any was)."""
        if not self._tiny:
            return model
        floor = round(float(np.median(np.fromiter(self._tiny, dtype=np.float64))), 1)
        return model if floor == model.floor_ms else model.model_copy(update={"floor_ms": floor})

    def observe_decode_step(self, num_seqs: int, context_tokens: int, step_ms: float,
                            instance_id: str = "", seq: int = -1) -> bool:
        """One measured decode step (or a request's mean inter-token time over its batch);
        True when it refitted the decode model. A numbered step (``seq`` >= 0, the engine's
        count of its timed decode-only steps) keeps its held-out prediction for the
        per-request error of the requests in it (``observe_decode_span``)."""
        if step_ms <= 0 or num_seqs < 1 or context_tokens < 0:
            return False
        if self._decode_fitted:
            predicted = self.decode.t_step_ms(num_seqs, context_tokens)
            self._step_errors.append(abs(predicted - step_ms) / step_ms * 100.0)
            if seq >= 0:
                self._keep_prediction(instance_id, seq, predicted, step_ms)
        self._steps.append((num_seqs, context_tokens, step_ms))
        self._since_step_fit += 1
        if len(self._steps) < self._min_samples or self._since_step_fit < self._refit_every:
            return False
        self._since_step_fit = 0
        if len({n for n, _, _ in self._steps}) < 2 or len({c for _, c, _ in self._steps}) < 2:
            return False  # one batch size or one context only: the terms cannot be told apart
        refit = DecodeCostModel.fit(self._steps)
        newest = list(self._steps)[-DECODE_JUDGED_ON:]
        steps = [PrefillSample(uncached_tokens=n, cached_tokens=c, prefill_ms=t) for n, c, t in newest]
        if self._decode_fitted and _window_error(refit.t_step_ms, steps) > _window_error(
                self.decode.t_step_ms, steps):
            return False
        self.decode, self._decode_fitted = refit, True
        self.num_decode_refits += 1
        return True

    def observe_mixed_step(self, num_seqs: int, context_tokens: int, chunks, step_ms: float,
                           instance_id: str = "", seq: int = -1, copy_ms: float = 0.0) -> bool:
        """One measured step that decoded ``num_seqs`` sequences beside prompt chunks
        (``MixedStep``): predicted by ``mixed_step_ms``, plus ``copy_ms`` for the KV blocks
        copied in on the step (priced as placement prices a transfer), once both models are
        fitted; never fitted on. True when its error was recorded (and, numbered, its prediction kept for the
        per-request figure over all steps)."""
        if (step_ms <= 0 or num_seqs < 1 or context_tokens < 0 or not chunks
                or copy_ms < 0 or not (self._decode_fitted and self._prefill_fitted)):
            return False
        predicted = mixed_step_ms(self.prefill, self.decode, num_seqs, context_tokens, chunks) + copy_ms
        self._mixed_errors.append(abs(predicted - step_ms) / step_ms * 100.0)
        if seq >= 0:
            _keep(self._predicted_mixed, instance_id, seq, predicted, step_ms)
        return True

    def _keep_prediction(self, instance_id: str, seq: int, predicted: float, measured: float) -> None:
        _keep(self._predicted_steps, instance_id, seq, predicted, measured)

    def observe_decode_span(self, instance_id: str, first_seq: int, last_seq: int) -> bool:
        """A finished request was in ``instance_id``'s numbered decode steps ``first_seq`` to
        ``last_seq``: the decode model's error for it is its kept steps' predicted time against
        their measured time, summed (each step predicted before it joined a fit). True when
        recorded: at least ``MIN_SPAN_STEPS`` of its steps were predicted and kept. The same
        sum over its decode-only and mixed steps together (``observe_mixed_step``) is the cost
        model's error on its whole decode (``request_all_steps_error``)."""
        if last_seq < first_seq:
            return False
        steps = self._predicted_steps.get(instance_id, {})
        mixed = self._predicted_mixed.get(instance_id, {})
        kept = [steps[s] for s in range(first_seq, last_seq + 1) if s in steps]
        every = [steps.get(s) or mixed.get(s) for s in range(first_seq, last_seq + 1)
                 if s in steps or s in mixed]
        if len(every) >= MIN_SPAN_STEPS:
            self._request_all_errors.append(_sum_error(every))
        if len(kept) < MIN_SPAN_STEPS:
            return False
        self._request_errors.append(_sum_error(kept))
        return True

    def observe_handoff(self, measured_ms: float, transfer_ms: float) -> bool:
        """One measured hand-off (ms) whose bytes were priced at ``transfer_ms``; True when it
        changed ``handoff_overhead_ms``. Once the overhead is set, each hand-off is first
        predicted with it (its error recorded), then joins the window."""
        if measured_ms <= 0 or transfer_ms < 0:
            return False
        if self._handoff_fitted:
            predicted = transfer_ms + self.handoff_overhead_ms
            self._handoff_errors.append(abs(predicted - measured_ms) / measured_ms * 100.0)
        self._handoff_residuals.append(max(0.0, measured_ms - transfer_ms))
        self._since_handoff_fit += 1
        if (len(self._handoff_residuals) < self._min_samples
                or self._since_handoff_fit < self._refit_every):
            return False
        self._since_handoff_fit = 0
        overhead = round(float(np.median(np.fromiter(self._handoff_residuals, dtype=np.float64))), 1)
        self._handoff_fitted = True
        if overhead == self.handoff_overhead_ms:
            return False
        self.handoff_overhead_ms = overhead
        return True

    def handoff_error(self) -> PredictionError | None:
        """The priced hand-off's error on hand-offs measured after its overhead was set."""
        return _summary(self._handoff_errors)

    def prefill_source(self) -> str:
        """Where the prefill model's figures come from (``CostModelStatus.prefill_source``)."""
        if self.num_prefill_refits:
            return f"refit {self.num_prefill_refits} times on live prefills"
        if self._warm_started:
            return f"warm-up of {len(self._warmup)} prefills"
        return "profile" if self._prefill_fitted else "placeholders"

    def prefill_error(self) -> PredictionError | None:
        """The prefill model's error on the last measurements, each predicted before it was fitted."""
        return _summary(self._prefill_errors)

    def decode_error(self) -> PredictionError | None:
        """The decode model's error per step, the same way."""
        return _summary(self._step_errors)

    def decode_request_error(self) -> PredictionError | None:
        """The decode model's error per finished request (``observe_decode_span``)."""
        return _summary(self._request_errors)

    def mixed_step_error(self) -> PredictionError | None:
        """The priced mixed step's error (``observe_mixed_step``)."""
        return _summary(self._mixed_errors)

    def request_all_steps_error(self) -> PredictionError | None:
        """The cost model's error per finished request over every step it decoded in,
        decode-only and mixed (``observe_decode_span``)."""
        return _summary(self._request_all_errors)
