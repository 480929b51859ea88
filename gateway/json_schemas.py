"""Whether the engines' structured-output backend can enforce a JSON Schema (or a regular
expression, ``regex_refusal``), asked at the front.

An engine checks a request's schema only when the request reaches it: on the decode instance,
after placement and prefill. The fronts ask first, with vLLM's own checks for the engines'
backend (``EngineConfig.structured_outputs_backend``): its nesting bound for every backend, then
xgrammar; for ``auto`` only (``SamplingParams._validate_structured_outputs``), where xgrammar
refuses, outlines for a schema llguidance cannot take and llguidance for any other, without a
tokenizer, as vLLM does for a Hugging Face one. So a schema refused here is one the engine would
refuse, and the client hears why before any work is placed.
"""

from __future__ import annotations

import functools
import json
import re

_XGRAMMAR_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")
"""The time and C++ source line xgrammar prefixes its messages with (no use to a client)."""
MAX_CACHED_SCHEMA_CHARS = 64 * 1024
"""Schemas and regular expressions up to this size have their verdict cached (512 of them, so
at most 32 MiB of keys): a large schema takes ~10 ms to compile and clients send the same one
again and again."""


BACKENDS = ("auto", "xgrammar")
"""The engines' structured-output backends the fronts know how to check for."""


def backend_refusal(schema_text: str, backend: str = "auto") -> str | None:
    """vLLM's reason for refusing ``schema_text`` (the JSON text of an object), or None when the
    engines' structured-output ``backend`` would enforce it. Also None when vLLM is not installed
    here: the engine's own check then stays the only one."""
    return _checked("json", schema_text, backend)


def regex_refusal(pattern: str, backend: str = "auto") -> str | None:
    """vLLM's reason for refusing ``pattern`` as a request's ``regex`` constraint, or None when
    the engines' ``backend`` would enforce it (xgrammar; under ``auto`` llguidance where
    xgrammar refuses, as vLLM falls back). None too when vLLM is not installed here."""
    return _checked("regex", pattern, backend)


def _checked(kind: str, text: str, backend: str) -> str | None:
    assert backend in BACKENDS, backend
    if len(text) <= MAX_CACHED_SCHEMA_CHARS:
        return _cached_refusal(kind, text, backend)
    return _refusal(kind, text, backend)


def _refusal(kind: str, text: str, backend: str) -> str | None:
    """``kind`` "json" (a schema) or "regex": vLLM's checks, in the order vLLM runs them."""
    try:
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import (
            SamplingParams,
            StructuredOutputsParams,
            check_json_nesting,
        )
        from vllm.v1.structured_output.backend_guidance import (
            has_guidance_unsupported_json_features,
            validate_guidance_grammar,
        )
        from vllm.v1.structured_output.backend_outlines import (
            validate_structured_output_request_outlines,
        )
        from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    except ImportError:
        return None

    params = SamplingParams(structured_outputs=StructuredOutputsParams(**{kind: text}))
    if kind == "json":
        try:
            check_json_nesting(text)
        except VLLMValidationError as e:
            return str(e)
    try:
        validate_xgrammar_grammar(params)
        return None
    except (VLLMValidationError, ValueError) as e:
        if backend == "xgrammar":
            return _XGRAMMAR_LOCATION.sub("", str(e))
        # auto: vLLM falls back to the other backends, and reports their reason
    try:
        if kind == "json" and has_guidance_unsupported_json_features(json.loads(text)):
            validate_structured_output_request_outlines(params)
        else:
            validate_guidance_grammar(params, tokenizer=None)
    except (VLLMValidationError, ValueError) as e:
        return str(e)
    return None


_cached_refusal = functools.lru_cache(maxsize=512)(_refusal)
