"""What one engine step computed, read from vLLM's scheduler as it schedules the step.

The runner times every engine step; a step that only decodes is what the decode-step model is
fitted on (``DecodeStep``). A step that decodes some sequences while it computes a chunk of
someone's prompt (a co-located engine, chunked prefill) is priced by placement as the decode
batch's step plus the chunk's share of that prompt's prefill: ``MixedStep`` carries what that
price needs, so the conductor can judge it (``CostCalibration.observe_mixed_step``) and judge a
request's whole decode phase, not only its decode-only steps.

``ScheduleTap`` wraps the scheduler's ``schedule`` (vLLM 0.32, ``Scheduler.schedule``, which
advances each scheduled request's ``num_computed_tokens`` before it returns) and keeps the
shape of the step it scheduled. It reads, never changes, what the scheduler decided.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.wire import PromptChunk

PROMPT_STARTS_MAX = 4096
"""Prompts in progress whose first computed count a tap remembers at most (past it they are
forgotten: a chunk of a forgotten prompt is priced as if the prompt started at its chunk)."""


@dataclass(frozen=True)
class StepShape:
    """One scheduled step: the sequences it decodes (one token each, past their prompt) and the
    prompt chunks it computes."""

    decode_request_ids: tuple[str, ...]
    context_tokens: int
    """Tokens the decoding sequences attend over (their computed tokens before the step)."""
    chunks: tuple[PromptChunk, ...]
    loaded_blocks: int = 0
    """KV blocks the connector copied in on this step, before its forward pass (loads it did
    not leave to run beside the step: ``kvstore.connector_meta.LoadSpec.on_step``)."""

    @property
    def is_mixed(self) -> bool:
        return bool(self.decode_request_ids) and bool(self.chunks)


class ScheduleTap:
    """Wraps ``scheduler.schedule`` to keep the shape of the step it last scheduled."""

    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler
        self._schedule = scheduler.schedule
        self._prompt_starts: dict[str, int] = {}  # request -> tokens computed when it was first scheduled
        self.num_schedules = 0
        """``schedule`` calls so far: a runner takes a shape only from a step that made one."""
        self.last: StepShape | None = None
        scheduler.schedule = self._tapped

    def _tapped(self, *args, **kwargs):
        output = self._schedule(*args, **kwargs)
        self.num_schedules += 1
        try:
            self.last = self._shape(output)
        except (AttributeError, KeyError, TypeError):  # a vLLM that schedules otherwise: no shape
            self.last = None
        return output

    def _shape(self, output) -> StepShape:
        requests = self._scheduler.requests
        starts = self._prompt_starts
        for new in output.scheduled_new_reqs:
            starts[new.req_id] = new.num_computed_tokens  # its prefix hit (device cache or loaded)
        decoding: list[str] = []
        context = 0
        chunks: list[PromptChunk] = []
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests[request_id]
            before = request.num_computed_tokens - num_tokens  # the scheduler advanced it already
            prompt_tokens = request.num_prompt_tokens
            if num_tokens == 1 and before >= prompt_tokens:
                decoding.append(request_id)
                context += before
                continue
            start = min(starts.get(request_id, before), before)
            chunks.append(PromptChunk(done_tokens=before - start, num_tokens=num_tokens,
                                      cached_tokens=start))
            if before + num_tokens >= prompt_tokens:
                starts.pop(request_id, None)  # its prompt is computed
        if len(starts) > PROMPT_STARTS_MAX:
            starts.clear()
        loads = getattr(getattr(output, "kv_connector_metadata", None), "loads", None) or ()
        loaded = sum(len(load.block_ids) for load in loads if getattr(load, "on_step", False))
        return StepShape(tuple(decoding), context, tuple(chunks), loaded)
