"""Baton's ``SamplingOptions`` as vLLM's ``SamplingParams``: the one place the engine runner's
requests get their sampling (the knobs are checked at the fronts, ``gateway.sampling_knobs``)."""

from __future__ import annotations

from protos.wire import SamplingOptions


def structured_outputs(sampling: SamplingOptions):
    """vLLM's structured-output constraint for ``sampling`` (None: unconstrained). The grammar
    acts on sampling only: the prompt, its KV and its reuse are the same as without it."""
    from vllm.sampling_params import StructuredOutputsParams

    if sampling.json_schema:
        return StructuredOutputsParams(json=sampling.json_schema)
    if sampling.json_object:
        return StructuredOutputsParams(json_object=True)
    if sampling.regex:
        return StructuredOutputsParams(regex=sampling.regex)
    if sampling.choice:
        return StructuredOutputsParams(choice=list(sampling.choice))
    return None


def sampling_params(sampling: SamplingOptions, max_tokens: int, transfer: dict | None):
    """vLLM's ``SamplingParams`` for one engine request of at most ``max_tokens`` tokens (the
    runner's budget: 1 for a prefill hand-off, whose ``min_tokens`` is cut to it), with the
    KV connector's ``transfer`` parameters (None: none), deltas as outputs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=list(sampling.stop) or None,
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.num_logprobs,
        prompt_logprobs=sampling.num_prompt_logprobs,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        min_tokens=min(sampling.min_tokens, max_tokens),
        logit_bias=dict(sampling.logit_bias) or None,
        structured_outputs=structured_outputs(sampling),
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": transfer} if transfer is not None else None,
    )
