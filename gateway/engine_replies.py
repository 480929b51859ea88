"""What Baton answers on the engine gRPC contract (``vllm.grpc.engine``): pure functions from
Baton's own types (token chunks, placements, the conductor's load and KV event batches, the model
folder) to the contract's messages.

The KV events: the conductor receives every engine's batches (vLLM's wire format) and keeps them
under one cluster-wide sequence number (``conductor.kv_feed``); each becomes one ``KvEventBatch``
with that number. Block hashes are per engine (two engines holding the same tokens publish the
same vLLM hash), so a hash here is the engine's hash and its instance id folded into 64 bits:
blocks of different instances stay different nodes to a subscriber, and a removal on one engine
never removes another's copy. Token ids travel as the engine sent them, which is what SMG's
index keys on.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

import msgspec
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2 as cpb

from gateway.router import Placed, cached_by_tier, num_cached_tokens
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from protos.wire import ClusterLoad, KvFeedBatch, PositionLogprobs, TokenChunk

_DECODE_BATCH = msgspec.msgpack.Decoder(KVEventBatch)


# ---------------------------------------------------------------- Generate


def stream_chunk(chunk: TokenChunk, num_prompt_tokens: int, placed: Placed,
                 index: int = 0,
                 prompt_logprobs: vpb.InputLogProbs | None = None) -> vpb.GenerateResponse:
    """One streamed delta: the chunk's new tokens (and their log-probabilities), of choice
    ``index`` (``n`` > 1); the first one carries the prompt's (``input_logprobs``) when asked."""
    return vpb.GenerateResponse(chunk=vpb.GenerateStreamChunk(
        token_ids=chunk.token_ids, prompt_tokens=num_prompt_tokens,
        completion_tokens=len(chunk.token_ids), cached_tokens=_cached_so_far(placed, chunk),
        output_logprobs=output_logprobs(chunk), input_logprobs=prompt_logprobs, index=index))


def _cached_so_far(placed: Placed, chunk: TokenChunk) -> int:
    """Prompt tokens known not computed by this chunk: the prefill's count once it answered
    (a request prefilled on its decode instance learns it with its last chunk)."""
    if chunk.finish_reason:
        return num_cached_tokens(placed, chunk)
    if placed.placement.prefill_instance == placed.placement.decode_instance:
        return 0
    return placed.prefill.num_cached_tokens


def complete(output_ids: list[int], last: TokenChunk, num_prompt_tokens: int,
             num_completion_tokens: int, placed: Placed,
             logprobs: vpb.OutputLogProbs | None = None, index: int = 0,
             prompt_logprobs: vpb.InputLogProbs | None = None) -> vpb.GenerateResponse:
    """The last message of the request's choice ``index`` (0 unless ``n`` > 1): why it ended,
    its usage and where Baton ran it.

    Streamed, ``output_ids`` are the last delta's tokens again and ``completion_tokens`` their
    count, as vLLM's servicer sends them (the router adds up the chunks); not streamed, all of
    them. ``kv_transfer_params_json`` is Baton's own handoff: which prefill and decode instance
    served it and how many prompt tokens came from cache or the KV store (``cached_tokens``, by
    tier in ``cached_tokens_by_tier``: null when not broken down).
    """
    finished = vpb.GenerateComplete(
        output_ids=output_ids, finish_reason=last.finish_reason or "stop",
        prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
        cached_tokens=num_cached_tokens(placed, last), output_logprobs=logprobs,
        input_logprobs=prompt_logprobs,
        kv_transfer_params_json=placement_json(placed, last), index=index)
    if last.stop_sequence:
        finished.matched_stop_str = last.stop_sequence
    return vpb.GenerateResponse(complete=finished)


def aborted(num_prompt_tokens: int, num_completion_tokens: int,
            index: int = 0) -> vpb.GenerateResponse:
    """The last message of a request's choice ``index`` ended by ``Abort``."""
    return vpb.GenerateResponse(complete=vpb.GenerateComplete(
        finish_reason="abort", prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens, index=index))


def placement_json(placed: Placed, last: TokenChunk) -> str:
    placement = placed.placement
    tiers = cached_by_tier(placed, last)
    return json.dumps({"baton": {
        "prefill_instance": placement.prefill_instance,
        "decode_instance": placement.decode_instance, "policy": placement.policy,
        "reason": placement.reason, "cached_tokens": num_cached_tokens(placed, last),
        "loaded_tokens": last.num_loaded_tokens, "pulled_from": placement.pulled_from,
        "cached_tokens_by_tier": msgspec.structs.asdict(tiers) if tiers is not None else None,
    }}, separators=(",", ":"))


def output_logprobs(chunk: TokenChunk) -> vpb.OutputLogProbs | None:
    """The chunk's log-probabilities in the contract's layout (None when none were asked)."""
    if not chunk.logprobs:
        return None
    return vpb.OutputLogProbs(
        token_logprobs=[position.chosen.logprob for position in chunk.logprobs],
        token_ids=[position.chosen.token_id for position in chunk.logprobs],
        top_logprobs=[vpb.TopLogProbs(values=[entry.logprob for entry in position.top],
                                      token_ids=[entry.token_id for entry in position.top])
                      for position in chunk.logprobs])


def input_logprobs(prompt_token_ids: tuple[int, ...],
                   positions: tuple[PositionLogprobs, ...]) -> vpb.InputLogProbs | None:
    """The prompt's log-probabilities in the contract's layout, as vLLM's servicer sends them:
    every prompt token, the first without a value and with no alternatives, each other with
    its log-probability and the most likely tokens (None when none were asked)."""
    if not positions:
        return None
    assert len(positions) == len(prompt_token_ids) - 1, "one position per prompt token but the first"
    return vpb.InputLogProbs(
        token_logprobs=[vpb.InputTokenLogProb()] + [
            vpb.InputTokenLogProb(value=position.chosen.logprob) for position in positions],
        token_ids=list(prompt_token_ids),
        top_logprobs=[vpb.TopLogProbs()] + [
            vpb.TopLogProbs(values=[entry.logprob for entry in position.top],
                            token_ids=[entry.token_id for entry in position.top])
            for position in positions])


def merge_logprobs(parts: list[vpb.OutputLogProbs]) -> vpb.OutputLogProbs | None:
    if not parts:
        return None
    merged = vpb.OutputLogProbs()
    for part in parts:
        merged.token_logprobs.extend(part.token_logprobs)
        merged.token_ids.extend(part.token_ids)
        merged.top_logprobs.extend(part.top_logprobs)
    return merged


# ---------------------------------------------------------------- load


def scheduler_load(load: ClusterLoad) -> vpb.SchedulerLoad:
    """The whole cluster as one scheduler: running and waiting sequences summed over every
    ready engine, KV use the mean over the decode instances (where a request's KV lives while it
    decodes), the prefix-cache hit rate over every prompt token the engines have seen."""
    running = sum(stats.num_running_reqs for stats in load.instances)
    waiting = sum(stats.num_waiting_reqs for stats in load.instances)
    decodes = [stats for stats in load.instances if stats.role == "decode"]
    usage = sum(stats.kv_usage_frac for stats in decodes) / len(decodes) if decodes else 0.0
    prompt_tokens = sum(stats.num_prompt_tokens for stats in load.instances)
    cached_tokens = sum(stats.num_cached_tokens for stats in load.instances)
    return vpb.SchedulerLoad(
        dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
        num_total_reqs=max(running + waiting, load.num_in_flight_decodes),
        token_usage=min(max(usage, 0.0), 1.0),
        cache_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0)


def loads_response(load: ClusterLoad, version: str) -> vpb.GetLoadsResponse:
    return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=version,
                                dp_rank_count=1, loads=[scheduler_load(load)])


# ---------------------------------------------------------------- model


def model_info(model_path: Path, served_model_name: str, max_model_len: int,
               vocab_size: int) -> vpb.GetModelInfoResponse:
    """The served model as ``GetModelInfo`` reports it, from the model folder's ``config.json``
    (and ``generation_config.json`` where there is one)."""
    config = _read_json(model_path / "config.json")
    generation = _read_json(model_path / "generation_config.json")
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    defaults = {key: generation[key] for key in ("temperature", "top_p", "top_k", "min_p",
                                                 "repetition_penalty")
                if generation.get(key) is not None}
    return vpb.GetModelInfoResponse(
        model_path=str(model_path), is_generation=True, max_context_length=max_model_len,
        vocab_size=vocab_size, supports_vision=False, served_model_name=served_model_name,
        tokenizer_path=str(model_path), model_type=config.get("model_type", ""),
        architectures=config.get("architectures", []), eos_token_ids=eos_ids,
        pad_token_id=config.get("pad_token_id") or 0, bos_token_id=config.get("bos_token_id") or 0,
        max_req_input_len=max_model_len - 1,
        default_sampling_params_json=(json.dumps(defaults, separators=(",", ":"))
                                      if defaults else ""))


def eos_token_ids(model_path: Path) -> tuple[int, ...]:
    return tuple(model_info(model_path, "", 1, 0).eos_token_ids)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


# ---------------------------------------------------------------- KV events


def block_hash64(instance_id: str, block_hash: bytes | int) -> int:
    """An engine's block hash with its instance folded in, as the contract's signed int64."""
    raw = block_hash if isinstance(block_hash, bytes) else block_hash.to_bytes(
        (block_hash.bit_length() + 8) // 8, "big", signed=True)
    digest = hashlib.blake2b(raw, digest_size=8, person=b"baton-smg-kv",
                             key=instance_id.encode()[:64]).digest()
    return int.from_bytes(digest, "big", signed=True)


def kv_event_batch(batch: KvFeedBatch) -> cpb.KvEventBatch:
    """One engine batch as the contract's ``KvEventBatch`` under the conductor's sequence number
    (an undecodable one becomes an empty batch, so the numbering stays gap-free)."""
    try:
        decoded = _DECODE_BATCH.decode(batch.payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return cpb.KvEventBatch(sequence_number=batch.seq)
    out = cpb.KvEventBatch(sequence_number=batch.seq, timestamp=decoded.ts)
    for event in decoded.events:
        converted = kv_event(batch.instance_id, event, (batch.seq << 20) + len(out.events))
        if converted is not None:
            out.events.append(converted)
    return out


def kv_event(instance_id: str, event, event_id: int) -> cpb.KvCacheEvent | None:
    """One engine event (None for ``AllBlocksCleared``: the contract's Cleared would drop every
    engine's blocks at once; the conductor drops that engine's from its own index)."""
    if isinstance(event, BlockStored):
        size = event.block_size
        blocks = [cpb.KvBlock(block_hash=block_hash64(instance_id, block_hash),
                              token_ids=event.token_ids[i * size:(i + 1) * size], block_size=size)
                  for i, block_hash in enumerate(event.block_hashes)]
        stored = cpb.KvBlocksStored(blocks=blocks, tier=cpb.KV_CACHE_TIER_DEVICE,
                                    locality=cpb.KV_CACHE_LOCALITY_LOCAL)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = block_hash64(instance_id, event.parent_block_hash)
        if event.medium:
            stored.medium = event.medium
        return cpb.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        return cpb.KvCacheEvent(event_id=event_id, removed=cpb.KvBlocksRemoved(
            block_hashes=[block_hash64(instance_id, h) for h in event.block_hashes],
            tier=cpb.KV_CACHE_TIER_DEVICE, locality=cpb.KV_CACHE_LOCALITY_LOCAL))
    assert isinstance(event, AllBlocksCleared), event
    return None


# ---------------------------------------------------------------- tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
                   "generation_config.json", "config.json")
TOKENIZER_CHUNK_BYTES = 512 * 1024


def tokenizer_zip(model_path: Path) -> bytes:
    """The model folder's tokenizer files in one zip (``GetTokenizer``)."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            if (model_path / name).is_file():
                archive.write(model_path / name, name)
    return buffer.getvalue()


def tokenizer_chunks(data: bytes) -> list[cpb.GetTokenizerChunk]:
    """``data`` in chunks; the last carries the SHA-256 of the whole."""
    digest = hashlib.sha256(data).hexdigest()
    starts = range(0, max(len(data), 1), TOKENIZER_CHUNK_BYTES)
    return [cpb.GetTokenizerChunk(data=data[start:start + TOKENIZER_CHUNK_BYTES],
                                  sha256=digest if start == starts[-1] else "")
            for start in starts]
