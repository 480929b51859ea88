"""The decode worker: loads a request's prompt KV from the store and streams its tokens.

Runs vLLM as KV consumer inside an asyncio Ray actor: many requests share the engine's
continuous batch. A gateway gets their tokens through one Ray stream per instance, a batch per
engine step (``outbox`` / ``start`` / ``cancel``, ``decode_worker.outbox``), or one Ray stream
per request (``generate``).
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from decode_worker.outbox import Item, Outboxes
from engine.runner import engine_prefill_ms
from protos.wire import EngineRequest, EnginePrefill, PositionLogprobs, TokenChunk, TokenLogprob
from worker.base import EngineWorker


def position_logprobs(token_ids, logprobs, num_top: int | None) -> tuple[PositionLogprobs, ...]:
    """vLLM's per-position logprobs of ``token_ids`` (one ``{token_id: Logprob}`` per token:
    the sampled token and the ``num_top`` most likely) as wire structs, the top ones by rank.
    Empty when the request asked for none (``num_top`` None)."""
    if num_top is None or not token_ids:
        return ()
    assert logprobs is not None and len(logprobs) == len(token_ids), "vLLM sent no logprobs"

    def one(token_id: int, logprob) -> TokenLogprob:
        return TokenLogprob(token_id, logprob.decoded_token or "", logprob.logprob, logprob.rank)

    positions = []
    for token_id, by_id in zip(token_ids, logprobs):
        top = sorted((one(i, lp) for i, lp in by_id.items() if lp.rank <= num_top),
                     key=lambda entry: entry.rank)
        positions.append(PositionLogprobs(one(token_id, by_id[token_id]), tuple(top)))
    return tuple(positions)


def _matched_stop(stop_reason: int | str | None) -> str:
    """The stop string vLLM reports as the reason a completion stopped ('' for a stop token id,
    end of sequence or length)."""
    return stop_reason if isinstance(stop_reason, str) else ""


class DecodeWorker(EngineWorker):
    role = "decode"

    def _outboxes(self) -> Outboxes:
        outboxes = getattr(self, "_outboxes_", None)
        if outboxes is None:
            outboxes = self._outboxes_ = Outboxes(self.generate)
        return outboxes

    async def outbox(self, subscriber: str) -> AsyncIterator[list[Item]]:
        """Call with ``num_returns="streaming"``: the chunks of every request ``subscriber``
        starts here, a batch per engine step, until the caller closes the stream."""
        async for batch in self._outboxes().stream(subscriber):
            yield batch

    async def start(self, request: EngineRequest, subscriber: str) -> None:
        """Serve ``request`` as ``generate`` does; its chunks (or the error that ends it) go
        out on ``subscriber``'s outbox. Returns at once."""
        self._outboxes().start(request, subscriber)

    async def cancel(self, request_id: str, subscriber: str) -> bool:
        """Stop a request started with ``start`` (the engine aborts it)."""
        return self._outboxes().cancel(request_id, subscriber)

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        """Yield ``TokenChunk``s as the engine produces them; the last one has a finish reason
        and the number of prompt tokens whose KV was loaded instead of recomputed."""
        from kvstore.connector import request_transfer

        started = last = time.perf_counter()
        num_pulled = await self._pull_remote_kv(request)
        first_token_ms: float | None = None
        num_tokens = 0
        num_top = request.sampling.num_logprobs
        num_prompt_top = request.sampling.num_prompt_logprobs
        generated: list[int] = []
        async for output in self.runner.generate(request, computes_prompt=request.computes_prompt):
            completion = output.outputs[0]
            generated.extend(completion.token_ids)
            logprobs = position_logprobs(completion.token_ids, completion.logprobs, num_top)
            prompt_logprobs = ()
            if num_prompt_top is not None and output.prompt_logprobs:  # the first output only
                prompt_logprobs = position_logprobs(request.prompt_token_ids[1:],
                                                    output.prompt_logprobs[1:], num_prompt_top)
                num_prompt_top = None
            now = time.perf_counter()
            engine_prefill = None
            if completion.token_ids:
                if first_token_ms is None:
                    first_token_ms = (now - started) * 1000.0
                    prefill_ms = engine_prefill_ms(output)
                    if prefill_ms is not None:
                        engine_prefill = EnginePrefill(output.num_cached_tokens or 0, prefill_ms)
                num_tokens += len(completion.token_ids)
                last = now
            if output.finished:
                done = request_transfer(output)
                num_cached_tokens = output.num_cached_tokens or 0
                _, block_size = self.runner.kv_layout()
                first_ms = first_token_ms or 0.0
                itl_ms = ((last - started) * 1000.0 - first_ms) / (num_tokens - 1) if (
                    num_tokens > 1) else None
                self._record_request(len(request.prompt_token_ids), num_cached_tokens,
                                     first_token_ms, itl_ms)
                self.apply_leases(request, generated)
                yield TokenChunk(
                    token_ids=tuple(completion.token_ids),
                    text=completion.text,
                    finish_reason=completion.finish_reason or "stop",
                    num_loaded_tokens=done.num_loaded_tokens,
                    num_cached_tokens=num_cached_tokens,
                    num_pulled_blocks=num_pulled,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    stop_sequence=_matched_stop(completion.stop_reason),
                    engine_prefill=engine_prefill,
                    # what a request it prefilled itself reused (else the hand-off's loads)
                    cached_by_tier=done.cached_by_tier(num_cached_tokens, num_pulled * block_size),
                )
            elif completion.token_ids or completion.text or prompt_logprobs:
                yield TokenChunk(token_ids=tuple(completion.token_ids), text=completion.text,
                                 logprobs=logprobs, engine_prefill=engine_prefill,
                                 prompt_logprobs=prompt_logprobs)
