"""The transfer engine in one process: a store node's block server and a client reading from it.

Pins held while a block is being sent, checksums, the handshake, bandwidth statistics, and clear
errors for bad input. The multi-process cases (two nodes, UCX, dead peers, corruption in flight)
are in tests/integration/test_transfer_nodes.py."""

from __future__ import annotations

import socket
import time

import numpy as np
import pydantic
import pytest
import torch

from kvstore.config import KVStoreConfig, TransferConfig
from kvstore.node import KVStoreNode
from kvstore.standalone import synthetic_block, synthetic_chain, write_chain
from kvstore.transfer import PeerRefused, TransferClient, TransferConfigError, copy_and_hash
from kvstore.transfer_server import BlockServer
from kvstore.transfer_wire import (
    FRAME_HEADER,
    Hello,
    ReadReply,
    ReadRequest,
    Release,
    Welcome,
    block_checksum,
    decode,
    encode,
    load_secret,
    proof,
)

BLOCK_BYTES = 64 * 1024
SECRET = b"unit-test-secret"
CONFIG = TransferConfig(request_timeout_s=2.0, connect_timeout_s=1.0, max_retries=1)


@pytest.fixture
def node(tmp_path):
    config = KVStoreConfig(host_capacity_bytes=16 * BLOCK_BYTES, arena_dir=str(tmp_path))
    n = KVStoreNode("a", "t", config, BLOCK_BYTES, redis_url=None)
    n.transfer_server = BlockServer(n, CONFIG, secret=SECRET)
    n.transfer_server.start()
    yield n
    n.shutdown()


@pytest.fixture
def client():
    c = TransferClient(CONFIG, "b", secret=SECRET)
    yield c
    c.close()


def wait_for_unpinned(node: KVStoreNode, timeout_s: float = 2.0) -> None:
    """The server unpins a read's blocks when it is done with them (shm: when the client's
    ``Release`` reaches it; stream: once the bytes are handed to the kernel), on its own loop;
    the client's ``read`` returns without waiting for that. Give it those moments."""
    deadline = time.monotonic() + timeout_s
    while node.stats().pinned_blocks and time.monotonic() < deadline:
        time.sleep(0.005)


def empty_blocks(n: int) -> list[torch.Tensor]:
    return [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in range(n)]


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_batch_arrives_byte_for_byte_and_is_counted_per_path(node, client, path):
    keys = synthetic_chain(1, 6)
    write_chain(node, keys)
    dests = empty_blocks(7)

    result = client.read(node.transfer_address(), keys + synthetic_chain(2, 1), dests, path=path)

    assert (result.num_blocks, result.corrupt_blocks, result.path) == (6, 0, path)
    assert result.from_disk == [False] * 6
    for key, dest in zip(keys, dests):
        assert np.array_equal(dest.numpy(), synthetic_block(key, BLOCK_BYTES))
    assert int(dests[6].sum()) == 0
    [stats] = client.path_stats()
    assert (stats.peer, stats.path, stats.requests, stats.blocks) == ("a", path, 1, 6)
    assert stats.num_bytes == 6 * BLOCK_BYTES and stats.ewma_bytes_per_s > 0
    wait_for_unpinned(node)
    assert node.stats().pinned_blocks == 0
    assert node.transfer_server.stats().served_blocks == 6


def test_auto_path_on_the_same_machine_is_shared_memory(node, client):
    keys = synthetic_chain(1, 2)
    write_chain(node, keys)
    assert client.read(node.transfer_address(), keys, empty_blocks(2)).path == "shm"


def test_only_the_leading_run_is_served(node, client):
    keys = synthetic_chain(1, 4)
    write_chain(node, keys[:2])
    result = client.read(node.transfer_address(), keys, empty_blocks(4), path="tcp")
    assert result.num_blocks == 2
    # a key the node lacks ends the run even if later keys are present
    result = client.read(node.transfer_address(), [keys[3], keys[0]], empty_blocks(2), path="tcp")
    assert result.num_blocks == 0


def test_copy_and_hash_lands_each_slot_in_its_destination_and_hashes_what_landed():
    source = np.arange(6 * 64, dtype=np.uint32).astype(np.uint8).reshape(6, 64)
    source += np.arange(6, dtype=np.uint8)[:, None] * 7  # every slot's bytes differ
    dests = [np.zeros(64, dtype=np.uint8) for _ in range(4)]

    landed = copy_and_hash(source, [4, 0, 5], dests)

    for dest, slot in zip(dests, [4, 0, 5]):
        assert np.array_equal(dest, source[slot])
    assert not dests[3].any()  # no slot for it: untouched
    assert landed == [block_checksum(source[4]), block_checksum(source[0]),
                      block_checksum(source[5])]


def test_a_shared_memory_block_corrupted_in_the_arena_ends_the_run(node, client):
    keys = synthetic_chain(1, 4)
    write_chain(node, keys)
    address = node.transfer_address()
    assert client.read(address, keys, empty_blocks(4), path="shm").num_blocks == 4  # hashed
    slot = node.acquire(keys[2:3])[0]
    node.release(keys[2:3])
    node.arena.slot(slot)[100] ^= 0xFF  # a bit flip after the block was hashed

    dests = empty_blocks(4)
    result = client.read(address, keys, dests, path="shm")

    assert (result.num_blocks, result.corrupt_blocks) == (2, 1)
    assert result.checksums == [block_checksum(synthetic_block(k, BLOCK_BYTES)) for k in keys[:2]]
    for key, dest in zip(keys[:2], dests):
        assert np.array_equal(dest.numpy(), synthetic_block(key, BLOCK_BYTES))


def _raw_connect(address, secret: bytes, rcvbuf_bytes: int = 0) -> tuple[socket.socket, Welcome]:
    sock = socket.socket()
    sock.settimeout(5)
    if rcvbuf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
    sock.connect((address.host, address.tcp_port))
    challenge = _recv_frame(sock)
    _send_frame(sock, Hello("raw", proof(secret, challenge.nonce)))
    return sock, _recv_frame(sock)


def _send_frame(sock, message) -> None:
    body = encode(message)
    sock.sendall(FRAME_HEADER.pack(len(body)) + body)


def _recv_exactly(sock, n: int) -> bytes:
    data = bytearray(n)
    view = memoryview(data)
    while view:
        received = sock.recv_into(view)
        assert received, "server closed the connection"
        view = view[received:]
    return bytes(data)


def _recv_frame(sock):
    (length,) = FRAME_HEADER.unpack(_recv_exactly(sock, FRAME_HEADER.size))
    return decode(_recv_exactly(sock, length))


def test_shared_memory_blocks_stay_pinned_until_the_reader_releases_them(node):
    keys = synthetic_chain(1, 3)
    write_chain(node, keys)
    sock, _ = _raw_connect(node.transfer_address(), SECRET)
    try:
        _send_frame(sock, ReadRequest(7, [bytes(k) for k in keys], "shm"))
        reply = _recv_frame(sock)
        assert isinstance(reply, ReadReply) and len(reply.slots) == 3
        assert node.stats().pinned_blocks == 3
        assert node.store.evict(10) == []  # nothing can go while the reader copies
        slots = node.arena.slots.numpy()
        assert [block_checksum(slots[s]) for s in reply.slots] == reply.checksums

        _send_frame(sock, Release(7))
        _send_frame(sock, ReadRequest(8, [], "shm"))  # a round trip: the release is processed
        assert _recv_frame(sock).checksums == []
        assert node.stats().pinned_blocks == 0
        assert node.store.evict(10) == list(reversed(keys))  # leaves first
    finally:
        sock.close()


def test_streamed_blocks_stay_pinned_while_the_socket_is_full(tmp_path):
    big_block_bytes = 1 << 20  # 16 MiB in all: more than both socket buffers can take
    config = KVStoreConfig(host_capacity_bytes=16 * big_block_bytes, arena_dir=str(tmp_path))
    node = KVStoreNode("a", "t", config, big_block_bytes, redis_url=None)
    node.transfer_server = BlockServer(node, CONFIG, secret=SECRET)
    node.transfer_server.start()
    keys = synthetic_chain(1, 16)
    write_chain(node, keys)
    sock, _ = _raw_connect(node.transfer_address(), SECRET, rcvbuf_bytes=256 * 1024)
    try:
        _send_frame(sock, ReadRequest(1, [bytes(k) for k in keys], "stream"))
        reply = _recv_frame(sock)
        assert len(reply.checksums) == 16
        assert node.stats().pinned_blocks == 16  # the sender is stuck on a full socket
        assert node.store.evict(16) == []

        for key, expected in zip(keys, reply.checksums):
            payload = _recv_exactly(sock, big_block_bytes)
            assert block_checksum(payload) == expected
            assert payload == synthetic_block(key, big_block_bytes).tobytes()
        _send_frame(sock, ReadRequest(2, [], "stream"))
        _recv_frame(sock)
        assert node.stats().pinned_blocks == 0
    finally:
        sock.close()
        node.shutdown()


def test_a_reader_that_disconnects_mid_read_leaves_no_pins(node):
    keys = synthetic_chain(1, 16)
    write_chain(node, keys)
    sock, _ = _raw_connect(node.transfer_address(), SECRET)
    _send_frame(sock, ReadRequest(1, [bytes(k) for k in keys], "shm"))
    _recv_frame(sock)
    assert node.stats().pinned_blocks == 16
    sock.close()
    probe = TransferClient(CONFIG, "probe", secret=SECRET)
    try:
        for _ in range(100):  # the server notices the closed socket on its loop
            probe.read(node.transfer_address(), [], [], path="tcp")
            if node.stats().pinned_blocks == 0:
                break
        assert node.stats().pinned_blocks == 0
    finally:
        probe.close()


def test_a_wrong_secret_is_refused_and_counted(node):
    intruder = TransferClient(CONFIG, "intruder", secret=b"not-the-secret")
    try:
        with pytest.raises(PeerRefused, match="same kvstore.transfer secret"):
            intruder.read(node.transfer_address(), synthetic_chain(1, 1), empty_blocks(1),
                          path="tcp")
    finally:
        intruder.close()
    assert node.transfer_server.stats().refused_handshakes == 1


def test_bad_input_gives_clear_errors(node, client, tmp_path, monkeypatch):
    address = node.transfer_address()
    with pytest.raises(TransferConfigError, match="unknown transfer path 'rdma'"):
        client.read(address, [], [], path="rdma")
    with pytest.raises(ValueError, match="one destination per key"):
        client.read(address, synthetic_chain(1, 2), empty_blocks(1), path="tcp")
    with pytest.raises(ValueError, match=f"writable buffer of {BLOCK_BYTES} bytes"):
        client.read(address, synthetic_chain(1, 1), [bytearray(10)], path="tcp")
    with pytest.raises(TransferConfigError, match="serves no UCX listener"):
        client.read(address, synthetic_chain(1, 1), empty_blocks(1), path="ucx")
    with pytest.raises(pydantic.ValidationError, match="backend"):
        TransferConfig(backend="rdma")

    taken = TransferConfig(listen_port=address.tcp_port)
    with pytest.raises(TransferConfigError, match="port is in use"):
        BlockServer(node, taken, secret=SECRET).start()

    monkeypatch.delenv("BATON_TRANSFER_TOKEN", raising=False)
    with pytest.raises(TransferConfigError, match="no transfer secret"):
        load_secret(TransferConfig())
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file-secret\n")
    assert load_secret(TransferConfig(token_file=str(token_file))) == b"from-a-file-secret"
    monkeypatch.setenv("BATON_TRANSFER_TOKEN", "from-the-env-secret")
    assert load_secret(TransferConfig()) == b"from-the-env-secret"


def test_bandwidth_ewma_weighs_the_newest_read(node):
    keys = synthetic_chain(1, 4)
    write_chain(node, keys)
    client = TransferClient(CONFIG.model_copy(update={"bandwidth_ewma_alpha": 0.5}), "b",
                            secret=SECRET)
    try:
        samples = []
        for _ in range(3):
            result = client.read(node.transfer_address(), keys, empty_blocks(4), path="tcp")
            samples.append(result.num_bytes / result.seconds)
        [stats] = client.path_stats()
        expected = samples[0]
        for sample in samples[1:]:
            expected = 0.5 * sample + 0.5 * expected
        assert stats.ewma_bytes_per_s == pytest.approx(expected)
        assert stats.requests == 3 and stats.num_bytes == 12 * BLOCK_BYTES
        assert stats.seconds == pytest.approx(sum(4 * BLOCK_BYTES / s for s in samples))
    finally:
        client.close()

