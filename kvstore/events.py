"""The store's KV events, in vLLM's KV-event wire format, over ZMQ with sequence numbers.

A subscriber that already reads vLLM's engine events (``KVEventBatch`` of ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``, msgpack, frames ``topic | 8-byte big-endian seq |
payload``) reads the store's too: ``medium`` is ``CPU`` for the host tier and ``DISK`` for the SSD
tier, and block hashes are Baton's 16-byte keys. A ROUTER socket serves missed batches: send
``[b"", start_seq (8 bytes big-endian)]`` and receive every buffered batch from ``start_seq`` on as
``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]`` (vLLM's replay framing).

The structs mirror vLLM's (``vllm.distributed.kv_events``) field for field; they are declared here
so the store node does not import vLLM (17 s and 0.5 GB here). A test decodes our bytes with vLLM's
own decoder.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

from kvstore.config import KVStoreConfig

MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event union (the tag is the class name, as in vLLM)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    """Baton keys from a store; vLLM's own hashes (bytes or int) from an engine."""
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list | None] | None = None
    """vLLM's per-block extra hash inputs, untagged: the LoRA name (when ``lora_name`` is set),
    multimodal ``(identifier, offset)`` pairs, then the ``cache_salt`` string (first block only)."""


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def with_event_endpoints(config: KVStoreConfig, host: str) -> KVStoreConfig:
    """``config`` with free event and replay endpoints on ``host`` when none is configured: the
    conductor's KV index needs every store's tier events."""
    from kvstore.redis_server import free_port

    if config.events_endpoint is not None:
        return config
    return config.model_copy(update={
        "events_endpoint": f"tcp://{host}:{free_port(host)}",
        "events_replay_endpoint": f"tcp://{host}:{free_port(host)}",
    })


class StoreEventPublisher:
    """PUB socket (bound) for live batches plus a ROUTER socket (bound) for replay.

    ``publish`` is called from one thread (the store actor's); replay requests are answered by a
    background thread from a bounded buffer of recent batches.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 buffer_batches: int = 10_000) -> None:
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self._running = True
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint:
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(replay_endpoint,), name="baton-store-replay",
                daemon=True,
            )
            self._replay_thread.start()

    def publish(self, events: list[KVCacheEvent]) -> int | None:
        """Send one batch; returns its sequence number (None when there was nothing to send)."""
        if not events:
            return None
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        with self._lock:
            seq = next(self._seq)
            self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        return seq

    def _serve_replay(self, endpoint: str) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while self._running:
                if not dict(poller.poll(100)):
                    continue
                client, _, start_bytes = router.recv_multipart()
                start = int.from_bytes(start_bytes, "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for seq, payload in batches:
                    router.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                router.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            router.close()

    def close(self) -> None:
        self._running = False
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=1)
        self._pub.close()
