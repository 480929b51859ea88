"""``baton bench conductor``: how fast the conductor decides and how fast its index ingests.

Builds the conductor's real state (``ConductorState`` + ``KvIndex``) without Ray: N prefill
instances (and N/4 decode instances) on nodes of 8, an index filled through the engine-event path
(msgpack ``KVEventBatch``es of ``BlockStored``, exactly as vLLM publishes them) until it holds the
target number of blocks, plus host-tier store events for a quarter of the chains. Then it times
``place`` for requests of 64 blocks (half extend an indexed chain, half are new), the whole
decision: block-key lookup in the index, snapshot, policy, pricing, admission, booking.

Then the agent case (``decision_us_shared_trunk``): a system prompt with tool definitions (a
trunk of ``TRUNK_BLOCKS``) is added to every instance of both pools, and each of 2 agents per
prefill instance has a private history of ``AGENT_BLOCKS`` past it on one prefill instance. Every
instance is then a holder of every request, so every one is priced with a hit: half the requests
are warm agents (the trunk, part of their history, new tokens), half are new agents (the trunk and
new tokens).

The ingest rate is measured on that fill. Figures are wall time on this machine, single thread.
"""

from __future__ import annotations

import array
import json
import random
import time
from pathlib import Path

import msgspec
import numpy as np

from conductor.kv_index import KvIndex
from conductor.policy import PolicyConfig
from conductor.state import ConductorState
from kvstore.events import MEDIUM_HOST, BlockStored, KVEventBatch
from kvstore.keys import KeyExtras, block_keys
from protos.wire import PlacementRequest

MODEL, LAYOUT = "bench-model", "bfloat16:16"
BLOCK_TOKENS = 16
CHAIN_BLOCKS = 64
INSTANCES_PER_NODE = 8
TRUNK_BLOCKS = 32
"""The shared system prompt with tool definitions (512 tokens), held by every instance."""
AGENT_BLOCKS = 16
"""Each agent's private history past the trunk, held by one prefill instance."""
AGENTS_PER_INSTANCE = 2
TRUNK_HASHES = 1 << 40
"""vLLM block hashes of the trunk and the agents' histories start here (past the fill's)."""


def _fill(index: KvIndex, prefill_ids: list[str], num_blocks: int, rng: random.Random,
          progress=None) -> tuple[list[array.array], float, float]:
    """Publish chains of ``CHAIN_BLOCKS`` blocks to random instances until ``num_blocks`` blocks
    are indexed, and a quarter of them to their node's host tier; returns the chains' tokens and
    the ingest rates (blocks/s) of the engine streams and of the store streams."""
    encoder = msgspec.msgpack.Encoder()
    chains: list[array.array] = []
    seqs = {i: 0 for i in prefill_ids}
    batches: list[tuple[str, int, bytes]] = []
    num_chains = -(-num_blocks // CHAIN_BLOCKS)
    for c in range(num_chains):
        tokens = rng.choices(range(50_000), k=CHAIN_BLOCKS * BLOCK_TOKENS)
        # kept as arrays: a million ints in lists would be the garbage collector's biggest job
        # during the timed decisions (~200 ms per full pass), which the conductor never has
        chains.append(array.array("I", tokens))
        holder = prefill_ids[c % len(prefill_ids)]
        base = c * CHAIN_BLOCKS
        # one event per 16 blocks, chained by vLLM-style hashes (ints here, as vLLM may send)
        events = []
        for start in range(0, CHAIN_BLOCKS, 16):
            events.append(BlockStored(
                block_hashes=list(range(base + start + 1, base + start + 17)),
                parent_block_hash=None if start == 0 else base + start,
                token_ids=tokens[start * BLOCK_TOKENS:(start + 16) * BLOCK_TOKENS],
                block_size=BLOCK_TOKENS, lora_id=None, medium="GPU", lora_name=None))
        batches.append((holder, seqs[holder], encoder.encode(KVEventBatch(ts=0.0, events=events))))
        seqs[holder] += 1
    started = time.perf_counter()
    for n, (holder, seq, payload) in enumerate(batches):
        assert index.ingest_engine(holder, seq, payload) is None
        if progress and n % 1000 == 0:
            progress(n * CHAIN_BLOCKS)
    rate = num_chains * CHAIN_BLOCKS / (time.perf_counter() - started)
    # a quarter of the chains also sit in their holder's node's host tier (the store keeps what
    # the engines evict), announced by the store's own stream, already in Baton keys
    node_of = {i: f"node-{n // INSTANCES_PER_NODE}" for n, i in enumerate(prefill_ids)}
    store_batches: dict[str, list[bytes]] = {}
    extras = KeyExtras(MODEL, "", "", LAYOUT)
    for c in range(0, num_chains, 4):
        keys = block_keys(chains[c], BLOCK_TOKENS, extras)
        event = BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[],
                            block_size=BLOCK_TOKENS, lora_id=None, medium=MEDIUM_HOST, lora_name=None)
        node = node_of[prefill_ids[c % len(prefill_ids)]]
        store_batches.setdefault(node, []).append(encoder.encode(KVEventBatch(ts=0.0, events=[event])))
    num_store_blocks = 0
    started = time.perf_counter()
    for node, payloads in store_batches.items():
        index.add_node(node)
        for seq, payload in enumerate(payloads):
            assert index.ingest_store(node, seq, payload) is None
            num_store_blocks += CHAIN_BLOCKS
    store_rate = num_store_blocks / (time.perf_counter() - started)
    return chains, rate, store_rate


def _stored(hashes: list[int], parent: int | None, tokens) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens),
                       block_size=BLOCK_TOKENS, lora_id=None, medium="GPU", lora_name=None)


def _add_shared_trunk(index: KvIndex, prefill_ids: list[str], decode_ids: list[str],
                      rng: random.Random) -> tuple[list[int], list[list[int]]]:
    """Publish a trunk of ``TRUNK_BLOCKS`` on every instance and each agent's history of
    ``AGENT_BLOCKS`` past it on one prefill instance (agent ``a`` on instance ``a mod N``), through
    the engine-event path; returns the trunk's tokens and each agent's history tokens."""
    encoder = msgspec.msgpack.Encoder()
    trunk = rng.choices(range(50_000), k=TRUNK_BLOCKS * BLOCK_TOKENS)
    trunk_hashes = list(range(TRUNK_HASHES, TRUNK_HASHES + TRUNK_BLOCKS))
    agents = [rng.choices(range(50_000), k=AGENT_BLOCKS * BLOCK_TOKENS)
              for _ in range(AGENTS_PER_INSTANCE * len(prefill_ids))]
    seqs = index.last_seqs()
    for instance_id in prefill_ids + decode_ids:
        events = [_stored(trunk_hashes, None, trunk)]
        if instance_id in prefill_ids:
            n = prefill_ids.index(instance_id)
            for a in range(n, len(agents), len(prefill_ids)):
                first = TRUNK_HASHES + TRUNK_BLOCKS + a * AGENT_BLOCKS
                events.append(_stored(list(range(first, first + AGENT_BLOCKS)), trunk_hashes[-1], agents[a]))
        seq = seqs[instance_id] + 1
        assert index.ingest_engine(instance_id, seq, encoder.encode(KVEventBatch(ts=0.0, events=events))) is None
    return trunk, agents


def _time_decisions(state: ConductorState, requests: list[PlacementRequest], num_prefill: int) -> dict:
    """p50 and p99 of ``place`` over ``requests`` (µs), with at most ``num_prefill`` of them in
    the books at a time; the books are emptied afterwards."""
    latencies_us = []
    in_flight: list[str] = []
    for request in requests:
        started = time.perf_counter()
        state.place(request)
        latencies_us.append((time.perf_counter() - started) * 1e6)
        in_flight.append(request.request_id)
        if len(in_flight) > num_prefill:  # keep a realistic number of requests in the books
            state.finished(in_flight.pop(0))
    for request_id in in_flight:
        state.finished(request_id)
    lat = np.asarray(latencies_us)
    return {"p50": round(float(np.percentile(lat, 50)), 1),
            "p99": round(float(np.percentile(lat, 99)), 1)}


def bench_decisions(num_prefill: int, num_blocks: int, num_decisions: int, seed: int = 0,
                    progress=None) -> dict:
    rng = random.Random(seed)
    config = PolicyConfig(block_size_tokens=BLOCK_TOKENS, kv_bytes_per_token=160 * 1024)
    state = ConductorState("baton", config)
    prefill_ids = [f"prefill-{i}" for i in range(num_prefill)]
    decode_ids = [f"decode-{i}" for i in range(max(1, num_prefill // 4))]
    for n, instance_id in enumerate(prefill_ids + decode_ids):
        state.register(instance_id, "prefill" if instance_id in prefill_ids else "decode",
                       f"node-{n // INSTANCES_PER_NODE}", MODEL, LAYOUT)
        state.set_ready(instance_id, True)
    chains, ingest_rate, store_ingest_rate = _fill(state.index, prefill_ids, num_blocks, rng, progress)
    extras = KeyExtras(MODEL, "", "", LAYOUT)
    requests = []
    for i in range(num_decisions):
        if i % 2 == 0:  # extends an indexed chain by a random amount
            shared = rng.randrange(1, CHAIN_BLOCKS) * BLOCK_TOKENS
            tokens = list(rng.choice(chains)[:shared]) + rng.choices(range(50_000), k=CHAIN_BLOCKS * BLOCK_TOKENS - shared)
        else:
            tokens = rng.choices(range(50_000), k=CHAIN_BLOCKS * BLOCK_TOKENS)
        keys = tuple(block_keys(tokens, BLOCK_TOKENS, extras))
        requests.append(PlacementRequest(f"r{i}", len(tokens), keys, 128))
    timed = _time_decisions(state, requests, num_prefill)
    num_blocks_indexed = state.index.num_blocks()
    trunk, agents = _add_shared_trunk(state.index, prefill_ids, decode_ids, rng)
    trunk_requests = []
    for i in range(num_decisions):
        tokens = list(trunk)
        if i % 2 == 0:  # a warm agent's next step: part of its history, then new tokens
            tokens += rng.choice(agents)[:rng.randrange(1, AGENT_BLOCKS + 1) * BLOCK_TOKENS]
        tokens += rng.choices(range(50_000), k=CHAIN_BLOCKS * BLOCK_TOKENS - len(tokens))
        trunk_requests.append(PlacementRequest(f"t{i}", len(tokens), tuple(block_keys(tokens, BLOCK_TOKENS, extras)), 128))
    timed_trunk = _time_decisions(state, trunk_requests, num_prefill)
    return {
        **timed,
        "shared_trunk": timed_trunk,
        "num_decode_instances": len(decode_ids),
        "indexed_blocks": num_blocks_indexed["device"],
        "host_indexed_blocks": num_blocks_indexed["host"],
        "ingest_blocks_per_s": round(ingest_rate),
        "store_ingest_blocks_per_s": round(store_ingest_rate),
    }


def run(json_path: Path | None, num_blocks: int = 1_000_000, num_decisions: int = 2_000,
        sizes: tuple[int, ...] = (64, 256, 1024), echo=print) -> dict:
    results: dict = {"decision_us": {}, "decision_us_shared_trunk": {}, "ingest_blocks_per_s": 0, "policy": "baton",
                     "request_blocks": CHAIN_BLOCKS, "indexed_blocks": num_blocks}
    rates, store_rates = [], []
    for size in sizes:
        r = bench_decisions(size, num_blocks, num_decisions)
        results["decision_us"][str(size)] = {"p50": r["p50"], "p99": r["p99"],
                                             "num_decode_instances": r["num_decode_instances"]}
        results["decision_us_shared_trunk"][str(size)] = {
            **r["shared_trunk"], "num_decode_instances": r["num_decode_instances"]}
        rates.append(r["ingest_blocks_per_s"])
        store_rates.append(r["store_ingest_blocks_per_s"])
        echo(f"{size:5d} prefill instances ({r['num_decode_instances']} decode), "
             f"{r['indexed_blocks']:,} device + {r['host_indexed_blocks']:,} host blocks indexed: "
             f"decision p50 {r['p50']:.0f} us, p99 {r['p99']:.0f} us; shared trunk (every instance "
             f"a holder) p50 {r['shared_trunk']['p50']:.0f} us, p99 {r['shared_trunk']['p99']:.0f} us; ingest "
             f"{r['ingest_blocks_per_s']:,} blocks/s (engine events), "
             f"{r['store_ingest_blocks_per_s']:,} blocks/s (store events)")
    results["ingest_blocks_per_s"] = round(float(np.median(rates)))
    results["ingest_runs_blocks_per_s"] = rates
    results["store_ingest_blocks_per_s"] = round(float(np.median(store_rates)))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2) + "\n")
    return results
