"""Request traces in the Mooncake FAST'25 format and their infinite-cache hit ceiling.

One JSON object a line: ``timestamp`` (ms from the start), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``, one id per ``TRACE_BLOCK_TOKENS``-token prompt block, the last one
possibly partial. An id names its block *and everything before it*, so a shared id is a shared
prefix: the ids are the block keys.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

from protos.errors import BatonError

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the published traces."""


class TraceError(BatonError):
    """The trace file is missing or not in the Mooncake trace format; the message says where."""


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of the trace, as the file spells it."""

    timestamp: float
    """Arrival time from the start of the trace (ms)."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens."""
    hash_ids: tuple[int, ...]
    """Block keys of the prompt, one per ``TRACE_BLOCK_TOKENS`` tokens (the last may be partial)."""


_decoder = msgspec.json.Decoder(TraceRequest)


def load_trace(path: Path) -> list[TraceRequest]:
    """Every request of the trace at ``path``, in arrival order.

    Raises ``TraceError`` naming the line when a record is malformed, has negative lengths, or
    has a number of hash ids other than ``ceil(input_length / 512)``.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist; pass --trace a Mooncake-format .jsonl file")
    requests: list[TraceRequest] = []
    with path.open("rb") as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                request = _decoder.decode(line)
            except msgspec.DecodeError as e:
                raise TraceError(
                    f"{path}:{line_no}: not a trace record ({e}); expected an object with timestamp, "
                    "input_length, output_length and hash_ids"
                ) from e
            if request.input_length <= 0 or request.output_length < 0 or request.timestamp < 0:
                raise TraceError(f"{path}:{line_no}: lengths and timestamp must be non-negative, "
                                 "input_length positive")
            expected = math.ceil(request.input_length / TRACE_BLOCK_TOKENS)
            if len(request.hash_ids) != expected:
                raise TraceError(
                    f"{path}:{line_no}: {len(request.hash_ids)} hash_ids for {request.input_length} "
                    f"tokens; the format has ceil(input_length / {TRACE_BLOCK_TOKENS}) = {expected}"
                )
            requests.append(request)
    if not requests:
        raise TraceError(f"trace file {path} holds no requests")
    requests.sort(key=lambda r: r.timestamp)
    return requests


def ceiling_hit_ratio(requests: list[TraceRequest]) -> float:
    """The hit ratio of an infinite cache shared by every instance: the share of all prompt blocks
    whose id appeared in an earlier request (0.640 for the shared synthetic trace)."""
    seen: set[int] = set()
    num_hits = num_blocks = 0
    for request in requests:
        num_blocks += len(request.hash_ids)
        num_hits += sum(1 for key in request.hash_ids if key in seen)
        seen.update(request.hash_ids)
    return num_hits / num_blocks
