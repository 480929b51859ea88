"""The prefill worker: turns a prompt into KV blocks in the node's store.

Runs vLLM as KV producer. A prefill is a generation of one token whose output is thrown away:
what matters is the side effect, the connector writing every full prompt block to the store.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from engine.runner import engine_prefill_ms
from protos.wire import EngineRequest, PrefillResult
from worker.base import EngineWorker

log = logging.getLogger(__name__)

COMMIT_WAIT_S = 30.0
"""Longest a prefill result waits for the store to answer its blocks' commits."""


class PrefillWorker(EngineWorker):
    role = "prefill"

    async def prefill(self, request: EngineRequest, priority: int = 0) -> PrefillResult:
        """Compute ``request``'s prompt KV and store it; returns once the blocks are committed.

        ``priority``: lower runs first among waiting prefills (the conductor passes minus the
        matched prefix length, so the cheapest-to-finish requests go first)."""
        from kvstore.connector import request_transfer, save_ledger

        started = time.perf_counter()
        num_pulled = await self._pull_remote_kv(request)
        num_cached_tokens = 0
        last = None
        # The one token is thrown away: no logprobs for it, no grammar to compile first, no
        # bias to apply (the decode engine samples every token the client sees).
        sampling = msgspec.structs.replace(request.sampling, num_logprobs=None, json_schema="",
                                           json_object=False, regex="", choice=(),
                                           logit_bias=(), num_prompt_logprobs=None)
        prefill = msgspec.structs.replace(request, sampling=sampling)
        async for output in self.runner.generate(prefill, max_tokens=1, priority=priority):
            if output.num_cached_tokens is not None:
                num_cached_tokens = output.num_cached_tokens
            last = output
        await self._saves_readable()
        self.apply_leases(request)
        done = request_transfer(last)  # what the connector did, with the last output
        # asynchronous saves: counted once written (the baseline counts them with the output)
        num_stored_blocks = done.num_stored_blocks + save_ledger(self.instance_id).take_stored(
            request.request_id)
        num_loaded_tokens = done.num_loaded_tokens
        _, block_size = self.runner.kv_layout()
        prefill_ms = (time.perf_counter() - started) * 1000.0
        self._record_request(len(request.prompt_token_ids), num_cached_tokens, prefill_ms)
        return PrefillResult(
            request_id=request.request_id,
            instance_id=self.instance_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=num_cached_tokens,
            num_stored_blocks=num_stored_blocks,
            prefill_ms=prefill_ms,
            num_loaded_tokens=min(num_loaded_tokens, num_cached_tokens),
            node_id=self.node_id,
            num_pulled_blocks=num_pulled,
            engine_prefill_ms=engine_prefill_ms(last),
            cached_by_tier=done.cached_by_tier(num_cached_tokens, num_pulled * block_size),
        )

    async def _saves_readable(self) -> None:
        """Wait until every save the engine's connector handed off so far is written and its
        commit answered (both happen off the engine's step): the decode instance that is given
        this result next must find the prompt's blocks committed. A store that does not answer
        is given up on (its blocks are then recomputed, as for a lost store)."""
        if self._store is None:
            return
        from kvstore.client import shared_store_client
        from kvstore.connector import save_ledger

        client = shared_store_client(self._store.store_actor, self._store.namespace)
        saves = [asyncio.wrap_future(job) for job in save_ledger(self.instance_id).pending()]

        async def written_and_committed() -> None:
            # the saving thread copies the blocks, then sends their commits
            await asyncio.gather(*saves, return_exceptions=True)
            commits = client.unsettled_commits()
            if commits:
                await asyncio.gather(*commits, return_exceptions=True)

        if not saves and not client.unsettled_commits():
            return
        try:  # a failed commit is the client's to see (it detaches); here only the wait counts
            await asyncio.wait_for(written_and_committed(), COMMIT_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("the prompt's KV blocks were not written and committed within %.0f s; "
                        "returning the prefill result anyway (its blocks may be recomputed)",
                        COMMIT_WAIT_S)
