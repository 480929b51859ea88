"""The decode worker: loads a request's prompt KV from the store and streams its tokens.

Runs vLLM as KV consumer inside an asyncio Ray actor: many requests share the engine's
continuous batch, each streamed back through a Ray streaming generator.
"""

from __future__ import annotations

from typing import AsyncIterator

from engine.messages import EngineRequest, TokenChunk
from engine.worker_base import EngineWorker


class DecodeWorker(EngineWorker):
    role = "decode"

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        """Yield ``TokenChunk``s as the engine produces them; the last one has a finish reason
        and the number of prompt tokens whose KV was loaded instead of recomputed."""
        from kvstore.connector import connector_stats

        loaded = connector_stats(self.instance_id).loaded_tokens_by_request
        try:
            async for output in self.runner.generate(request):
                completion = output.outputs[0]
                if output.finished:
                    yield TokenChunk(
                        token_ids=tuple(completion.token_ids),
                        text=completion.text,
                        finish_reason=completion.finish_reason or "stop",
                        num_loaded_tokens=loaded.get(request.request_id, 0),
                        num_cached_tokens=output.num_cached_tokens or 0,
                    )
                elif completion.token_ids or completion.text:
                    yield TokenChunk(token_ids=tuple(completion.token_ids), text=completion.text)
        finally:
            loaded.pop(request.request_id, None)
