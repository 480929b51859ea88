"""The contract between the gRPC gateway and the machinery that serves a request.

The gateway owns the wire (parsing, validation, tokenization, status codes); a ``Router`` owns
placement and the workers. Keeping the two apart lets the gateway be tested against a fake router
and lets the live router be reused by other fronts.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

import msgspec

from protos.wire import CachedByTier, EngineRequest, Placement, PrefillResult, TokenChunk


class Placed(msgspec.Struct, frozen=True):
    """First event of every stream: where the request ran and what prefill found cached."""

    placement: Placement
    prefill: PrefillResult


RouterEvent = Placed | TokenChunk


def num_cached_tokens(placed: Placed, last_chunk: TokenChunk) -> int:
    """Prompt tokens the request did not compute: what its prefill found, or, when it prefilled
    on its decode instance (conditional disaggregation), what the decode engine found."""
    if placed.placement.prefill_instance == placed.placement.decode_instance:
        return last_chunk.num_cached_tokens
    return placed.prefill.num_cached_tokens


def cached_by_tier(placed: Placed, last_chunk: TokenChunk) -> CachedByTier | None:
    """``num_cached_tokens`` by tier, from the same side (the prefill's, or the decode engine's
    when it prefilled itself) and adding up to it exactly (``fit_tiers``); None when that side
    did not break it down."""
    colocated = placed.placement.prefill_instance == placed.placement.decode_instance
    tiers = last_chunk.cached_by_tier if colocated else placed.prefill.cached_by_tier
    if tiers is None:
        return None
    return fit_tiers(tiers, num_cached_tokens(placed, last_chunk))


def fit_tiers(tiers: CachedByTier, num_cached_tokens: int) -> CachedByTier:
    """``tiers`` made to add up to ``num_cached_tokens`` (a count capped after the breakdown,
    e.g. a continuation's to its original prompt): pulled, disk and host each keep what fits
    of what is left, in that order, and device is the rest."""
    left = max(num_cached_tokens, 0)
    pulled = min(max(tiers.pulled, 0), left)
    disk = min(max(tiers.disk, 0), left - pulled)
    host = min(max(tiers.host, 0), left - pulled - disk)
    return CachedByTier(device=left - pulled - disk - host, host=host, disk=disk, pulled=pulled)


class Router(Protocol):
    """Serves tokenized, validated requests.

    ``stream`` yields exactly one ``Placed`` first, then ``TokenChunk``s; the last chunk has a
    ``finish_reason``. It raises ``protos.errors.NoWorkerReady`` when no instance can take the
    request and ``WorkerFailed`` when one dies mid-request. Cancelling the iteration (the client
    went away) aborts the request on the workers.
    """

    def is_ready(self) -> bool: ...

    def stream(self, request: EngineRequest) -> AsyncIterator[RouterEvent]: ...
