"""Typed messages that cross process boundaries between the gateway, conductor and workers.

Everything that travels through a Ray call is one of these ``msgspec.Struct``s: small, typed,
cheap to serialise, and never a raw dict.
"""

from __future__ import annotations

import msgspec


class SamplingOptions(msgspec.Struct, frozen=True):
    """What the client asked for; validated by the gateway before any worker sees it."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


class EngineRequest(msgspec.Struct, frozen=True):
    """One tokenized request as the workers see it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    cache_salt: str = ""
    kv_source_node: str = ""
    """The store node holding this prompt's KV when it may not be the worker's own (for a decode:
    the prefill's node; for a prefill: the node of the instance it pulls a prefix from). A worker
    on another node pulls those blocks into its own store before the engine sees the request."""


class Placement(msgspec.Struct, frozen=True):
    """Where a request runs: the conductor's answer for one request."""

    prefill_instance: str
    decode_instance: str
    policy: str
    reason: str = ""
    transfer_ms: float = 0.0
    """Priced KV transfer time for the chosen prefill instance (ms); see conductor.policy.price."""
    queue_ms: float = 0.0
    """Priced wait behind the prefills already queued there (ms)."""
    prefill_ms: float = 0.0
    """Priced prefill time of the uncached suffix (ms)."""
    expected_cached_blocks: int = 0
    """Prompt blocks the index says the prefill instance can reuse (local or pulled)."""
    pulled_from: str = ""
    """The instance whose prefix is pulled ('' when the local prefix is used)."""
    pulled_from_node: str = ""
    """... and the store node it runs on."""
    priority: int = 0
    """Queue position within the prefill instance: lower runs first (longest prefix first)."""


class PrefillResult(msgspec.Struct, frozen=True):
    """What the prefill worker reports once the prompt's KV is in the store."""

    request_id: str
    instance_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_stored_blocks: int
    prefill_ms: float
    num_loaded_tokens: int = 0
    """Of ``num_cached_tokens``, those loaded from the KV store (host tier) rather than found in
    the engine's own device cache."""
    node_id: str = ""
    """The store node now holding the prompt's blocks (the prefill instance's node)."""
    num_pulled_blocks: int = 0
    """Blocks pulled from another node's store before the prefill (``kv_source_node``)."""


class TokenChunk(msgspec.Struct, frozen=True):
    """A slice of the decode stream: new token ids and their text delta.

    The last chunk of a request has ``finish_reason`` set and carries the decode side's
    ``num_loaded_tokens`` (prompt tokens whose KV was loaded from the store, not recomputed).
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    num_loaded_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens the decode engine did not compute (its prefix cache plus loaded KV)."""
    num_pulled_blocks: int = 0
    """Prompt blocks the decode worker pulled from another node's store (last chunk only)."""


class InstanceStats(msgspec.Struct, frozen=True):
    """A worker's load, as the conductor's snapshot holds it."""

    instance_id: str
    role: str
    num_running_reqs: int
    num_waiting_reqs: int
    num_finished_reqs: int
    ready: bool
    kv_usage_frac: float = 0.0
    """Fraction of the engine's KV cache in use, 0..1."""
    kv_loaded_bytes: int = 0
    """KV bytes the engine's connector has loaded from the node's store, since start."""
    kv_load_seconds: float = 0.0
    """... and the seconds those loads took: the measured same-node transfer bandwidth."""
    node_id: str = ""
    """The KV store node (machine) the instance runs on."""
    num_prompt_tokens: int = 0
    """Prompt tokens this instance has processed (prefix-cache queries, in tokens)."""
    num_cached_tokens: int = 0
    """Of those, tokens it did not compute (prefix-cache hits: device cache or store)."""
    recent_ttft_ms: float | None = None
    """Median time to first token over its recent requests, as the instance sees it (ms)."""
    recent_itl_ms: float | None = None
    """Median inter-token latency over its recent requests (decode instances; ms)."""
