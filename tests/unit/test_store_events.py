"""The store node's KV events: vLLM's wire format (decoded here with vLLM's own decoder),
consecutive sequence numbers, and replay of missed batches."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from kvstore.config import KVStoreConfig
from kvstore.keys import KeyExtras, block_keys
from kvstore.node import KVStoreNode
from kvstore.redis_server import free_port

BLOCK_BYTES = 256 * 1024


@pytest.fixture
def node_and_sub(tmp_path):
    pub, replay = free_port(), free_port()
    config = KVStoreConfig(host_capacity_bytes=4 * BLOCK_BYTES, arena_dir=str(tmp_path),
                           disk_dir=str(tmp_path / "disk"),
                           events_endpoint=f"tcp://127.0.0.1:{pub}",
                           events_replay_endpoint=f"tcp://127.0.0.1:{replay}")
    node = KVStoreNode("node0", "t", config, BLOCK_BYTES, None, block_size_tokens=128)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"baton.store.node0")
    sub.setsockopt(zmq.RCVTIMEO, 3000)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    time.sleep(0.3)  # let the subscription reach the publisher
    yield node, sub, replay
    sub.close(0)
    node.shutdown()


def write(node, keys):
    slots = node.reserve(keys, [None] + list(keys[:-1]))
    for slot in slots:
        node.arena.slot(slot).fill_(7)
    node.commit(keys)


def receive(sub, decoder):
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decoder.decode(payload)


@pytest.mark.vllm
def test_events_decode_with_vllms_own_types_in_order_with_sequence_numbers(node_and_sub):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    node, sub, _ = node_and_sub
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    a = block_keys(list(range(16)), 4, KeyExtras(model_id="m"))  # 4 blocks: fills the host tier
    b = block_keys(list(range(100, 104)), 4, KeyExtras(model_id="m"))

    write(node, a)
    topic, seq0, batch = receive(sub, decoder)
    assert topic == b"baton.store.node0" and seq0 == 0
    assert [type(e) for e in batch.events] == [BlockStored] * 4
    assert [e.block_hashes for e in batch.events] == [[k] for k in a]
    assert [e.parent_block_hash for e in batch.events] == [None] + a[:3]
    assert {(e.medium, e.block_size) for e in batch.events} == {("CPU", 128)}

    write(node, b)  # evicts a's leaf: removed from host, stored on disk
    seqs, events = [], []
    for _ in range(2):
        _, seq, batch = receive(sub, decoder)
        seqs.append(seq)
        events.extend(batch.events)
    assert seqs == [1, 2]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    stored_disk = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert [(e.block_hashes, e.medium) for e in removed] == [([a[3]], "CPU")]
    assert [(e.block_hashes, e.parent_block_hash) for e in stored_disk] == [([a[3]], a[2])]
    path, offset = node.disk.block_location(a[3])  # the demoted block took the first slot
    assert (path.parent, offset) == (node.disk.directory, 0)
    node.disk.check_invariants()


def test_missed_batches_are_replayed_from_a_sequence_number(node_and_sub):
    node, sub, replay = node_and_sub
    for seed in range(3):
        write(node, block_keys([seed] * 4, 4, KeyExtras(model_id="m")))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    try:
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert topic == b""
                break
            assert topic.startswith(b"baton.store.")
            replayed.append(int.from_bytes(seq, "big"))
    finally:
        dealer.close(0)
    assert replayed == [1, 2]
