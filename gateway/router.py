"""The contract between the gRPC gateway and the machinery that serves a request.

The gateway owns the wire (parsing, validation, tokenization, status codes); a ``Router`` owns
placement and the workers. Keeping the two apart lets the gateway be tested against a fake router
and lets the live router be reused by other fronts.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

import msgspec

from protos.wire import EngineRequest, Placement, PrefillResult, TokenChunk


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


class Router(Protocol):
    """Serves tokenized, validated requests.

    ``stream`` yields exactly one ``Placed`` first, then ``TokenChunk``s; the last chunk has a
    ``finish_reason``. It raises ``protos.errors.NoWorkerReady`` when no instance can take the
    request and ``WorkerFailed`` when one dies mid-request. Cancelling the iteration (the client
    went away) aborts the request on the workers.
    """

    def is_ready(self) -> bool: ...

    def stream(self, request: EngineRequest) -> AsyncIterator[RouterEvent]: ...
