"""Two store nodes as separate processes on this machine, one real redis-server: node B (this
test process) finds blocks written on node A (a ``python -m kvstore.standalone`` child) in Redis
and pulls them into its own arena over ``ucx`` and over ``tcp``; a wrong secret is refused; a
block corrupted in flight or on A's disk is counted and never returned; a dead or hung peer gives
a clear error fast."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvstore.config import KVStoreConfig, TransferConfig
from kvstore.disk_tier import HEADER_BYTES, find_block
from kvstore.metadata import BlockDirectory
from kvstore.node import KVStoreNode
from kvstore.redis_server import start_local_redis
from kvstore.standalone import synthetic_block, synthetic_chain
from kvstore.transfer import PeerAddress, PeerRefused, PeerUnavailable, TransferClient
from kvstore.transfer_wire import block_checksum

BLOCK_BYTES = 368_640  # one SmolLM2 block: 16 tokens x 23,040 bytes in bf16
SECRET = "integration-secret"
UCX_ENV = {"UCX_TLS": "tcp", "UCXPY_PROGRESS_MODE": "blocking", "UCX_WARN_UNUSED_ENV_VARS": "n"}
FAST = TransferConfig(backend="ucx", connect_timeout_s=1.5, request_timeout_s=0.5,
                      max_retries=1, retry_backoff_s=0.02)


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    monkeypatch.setenv("BATON_TRANSFER_TOKEN", SECRET)
    for name, value in UCX_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def redis_url():
    server = start_local_redis()
    yield server.url
    server.stop()


class NodeProcess:
    """A store node in a child process; ``address`` is its block server."""

    def __init__(self, node_id: str, config: KVStoreConfig, fills: list[str],
                 redis_url: str | None = None) -> None:
        argv = [sys.executable, "-m", "kvstore.standalone", "--node-id", node_id,
                "--block-bytes", str(BLOCK_BYTES), "--config-json", config.model_dump_json()]
        argv += [arg for fill in fills for arg in ("--fill", fill)]
        if redis_url:
            argv += ["--redis-url", redis_url]
        env = {**os.environ, "BATON_TRANSFER_TOKEN": SECRET, **UCX_ENV}
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env, cwd=Path(__file__).parents[2])
        ready = self._line(timeout_s=30)
        self.address = msgspec.convert(ready["address"], PeerAddress)

    def _line(self, timeout_s: float) -> dict:
        readable, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        assert readable, "the store node process did not answer"
        line = self.process.stdout.readline()
        assert line, f"the store node process exited with {self.process.wait()}"
        return json.loads(line)

    def stats(self) -> dict:
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        return self._line(timeout_s=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def node_config(tmp_path: Path, host_blocks: int, disk: bool = False,
                arena_dir: str = "/dev/shm") -> KVStoreConfig:
    return KVStoreConfig(
        host_capacity_bytes=host_blocks * BLOCK_BYTES, arena_dir=arena_dir,
        disk_dir=str(tmp_path / "disk") if disk else None, disk_capacity_bytes=64 << 20,
        heartbeat_interval_s=0.2, transfer=FAST,
    )


def empty_blocks(n: int) -> list[np.ndarray]:
    return [np.zeros(BLOCK_BYTES, dtype=np.uint8) for _ in range(n)]


def assert_blocks(keys, blocks) -> None:
    assert len(keys) == len(blocks)
    for key, block in zip(keys, blocks):
        assert np.array_equal(np.asarray(block), synthetic_block(key, BLOCK_BYTES))


@pytest.fixture(scope="module")
def node_a(tmp_path_factory, redis_url):
    node = NodeProcess("a", node_config(tmp_path_factory.mktemp("a"), 32), ["1:12"], redis_url)
    yield node
    node.stop()


@pytest.mark.parametrize("path", ["ucx", "tcp"])
def test_node_b_pulls_a_batch_written_on_node_a(tmp_path, redis_url, node_a, path):
    keys = synthetic_chain(1, 12)
    directory = BlockDirectory.from_url(redis_url)
    assert directory.locate(keys) == [{"a": "host"}] * 12
    address = msgspec.json.decode(directory.transfer_addresses()["a"], type=PeerAddress)
    assert address == node_a.address

    config = KVStoreConfig(host_capacity_bytes=16 * BLOCK_BYTES, arena_dir="/dev/shm",
                           heartbeat_interval_s=0.2)
    node_b = KVStoreNode("b", "t", config, BLOCK_BYTES, redis_url)
    client = TransferClient(FAST, "b")
    try:
        slots = node_b.reserve(keys, [None, *keys[:-1]])
        result = client.read(address, keys, [node_b.arena.slot(s) for s in slots], path=path)
        assert (result.num_blocks, result.corrupt_blocks, result.path) == (12, 0, path)
        node_b.commit(keys)

        held = node_b.acquire(keys)
        assert_blocks(keys, [node_b.arena.slot(s).numpy() for s in held])
        node_b.release(keys)
        assert directory.locate(keys[:1]) == [{"a": "host", "b": "host"}]
        [stats] = client.path_stats()
        assert (stats.peer, stats.path, stats.blocks, stats.num_bytes) == (
            "a", path, 12, 12 * BLOCK_BYTES)
        assert stats.ewma_bytes_per_s > 0 and stats.failures == 0
    finally:
        client.close()
        node_b.shutdown()


@pytest.mark.parametrize("path", ["ucx", "tcp"])
def test_a_wrong_secret_is_refused(node_a, path):
    before = node_a.stats()["refused_handshakes"]
    intruder = TransferClient(FAST, "intruder", secret=b"guessed-secret")
    try:
        with pytest.raises(PeerRefused, match="refused this node"):
            intruder.read(node_a.address, synthetic_chain(1, 1), empty_blocks(1), path=path)
    finally:
        intruder.close()
    assert node_a.stats()["refused_handshakes"] == before + 1


def test_a_corrupt_block_on_the_peers_disk_is_counted_and_not_returned(tmp_path):
    # host holds 4 blocks: chain 2 pushes chain 1's last three blocks down to A's disk
    node = NodeProcess("a-disk", node_config(tmp_path, 4, disk=True), ["1:4", "2:3"])
    client = TransferClient(FAST, "b")
    try:
        keys = synthetic_chain(1, 4)
        [tier_dir] = (tmp_path / "disk").iterdir()  # the node's own folder
        slot_file, offset = find_block(tier_dir, keys[2], BLOCK_BYTES)
        with open(slot_file, "r+b") as f:  # flip a byte mid-slot, in the payload
            f.seek(offset + (HEADER_BYTES + BLOCK_BYTES) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x5A]))

        blocks = empty_blocks(4)
        result = client.read(node.address, keys, blocks, path="tcp")

        assert result.num_blocks == 2 and result.from_disk == [False, True]
        assert_blocks(keys[:2], blocks[:2])
        assert node.stats()["disk_corrupt_blocks"] == 1
        assert find_block(tier_dir, keys[2], BLOCK_BYTES) is None  # dropped: header zeroed
    finally:
        client.close()
        node.stop()


class CorruptingProxy:
    """Forwards one TCP connection to ``target`` and flips one byte of the server's stream at
    ``flip_offset`` (once): corruption in flight."""

    def __init__(self, target: PeerAddress, flip_offset: int) -> None:
        self._target = (target.host, target.tcp_port)
        self._flip_offset = flip_offset
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self._flip_offset),
                             daemon=True).start()
            self._flip_offset = None  # later connections pass through untouched

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, flip_offset: int | None) -> None:
        seen = 0
        try:
            while chunk := bytearray(source.recv(1 << 16)):
                if flip_offset is not None and seen <= flip_offset < seen + len(chunk):
                    chunk[flip_offset - seen] ^= 0x01
                seen += len(chunk)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self._listener.close()


def test_a_block_corrupted_in_flight_is_counted_and_not_returned(node_a):
    # the server's stream: three small frames (< 1 KB), then the blocks; flip a byte of block 2
    proxy = CorruptingProxy(node_a.address, flip_offset=int(2.5 * BLOCK_BYTES))
    via_proxy = msgspec.structs.replace(node_a.address, tcp_port=proxy.port)
    client = TransferClient(FAST, "b")
    try:
        keys = synthetic_chain(1, 4)
        blocks = empty_blocks(4)
        result = client.read(via_proxy, keys, blocks, path="tcp")
        assert (result.num_blocks, result.corrupt_blocks) == (2, 1)
        assert_blocks(keys[:2], blocks[:2])
        assert client.path_stats()[0].corrupt_blocks == 1

        client.close()  # a new connection through the proxy is clean
        result = client.read(via_proxy, keys, blocks, path="tcp")
        assert (result.num_blocks, result.corrupt_blocks) == (4, 0)
        assert_blocks(keys, blocks)
    finally:
        client.close()
        proxy.close()


def _wait_until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP is asynchronous: wait until every thread of ``pid`` is stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for tid in os.listdir(f"/proc/{pid}/task")]
        if all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_a_hung_then_dead_peer_gives_a_clear_error_fast(tmp_path):
    # a killed node cannot remove its arena: keep it out of /dev/shm
    node = NodeProcess("doomed", node_config(tmp_path, 8, arena_dir=str(tmp_path)), ["1:2"])
    client = TransferClient(FAST, "b")
    keys = synthetic_chain(1, 2)
    paths = ["tcp", "ucx"]
    attempts = FAST.max_retries + 1
    try:
        for path in paths:  # connections are open and warm
            assert client.read(node.address, keys, empty_blocks(2), path=path).num_blocks == 2

        node.process.send_signal(signal.SIGSTOP)  # hung: connects, never answers
        _wait_until_stopped(node.process.pid)
        for path in paths:
            started = time.monotonic()
            with pytest.raises(PeerUnavailable, match="timed out 2 times") as caught:
                client.read(node.address, keys, empty_blocks(2), path=path)
            elapsed_s = time.monotonic() - started
            assert elapsed_s < attempts * (FAST.connect_timeout_s + FAST.request_timeout_s) + 0.5
            assert "node doomed" in str(caught.value) and "is its store node running" in str(
                caught.value)

        node.process.kill()  # dead: connections are refused
        node.process.wait()
        for path in paths:
            started = time.monotonic()
            with pytest.raises(PeerUnavailable, match="is its store node running"):
                client.read(node.address, keys, empty_blocks(2), path=path)
            # Refused: no request timeout is waited for, as it is for a hung peer. Usually at
            # once; under a loaded box UCX reported the refused endpoint only at its connect
            # timeout (3.03 s for the two attempts in one CI run), so that is the bound.
            assert time.monotonic() - started < attempts * FAST.connect_timeout_s + 0.5

        assert [(s.path, s.requests, s.failures) for s in client.path_stats()] == [
            ("tcp", 1, 2 * attempts), ("ucx", 1, 2 * attempts)]
    finally:
        client.close()
        node.stop()


def pulling_node(node_id: str, host_blocks: int, redis_url: str,
                 backend: str = "tcp") -> KVStoreNode:
    """Node B in this process, pulling over ``backend`` (never shm, though A is on this machine)."""
    transfer = FAST.model_copy(update={"backend": backend, "same_node_shared_memory": False})
    config = KVStoreConfig(host_capacity_bytes=host_blocks * BLOCK_BYTES, arena_dir="/dev/shm",
                           heartbeat_interval_s=0.2, transfer=transfer)
    return KVStoreNode(node_id, "t", config, BLOCK_BYTES, redis_url)


@pytest.mark.parametrize("backend", ["ucx", "tcp"])
def test_pull_makes_the_run_local_from_the_node_that_holds_it(redis_url, node_a, backend):
    """``KVStoreNode.pull``: B holds the first 3 blocks of chain 1 itself, finds the other 9 on A
    through Redis, reads them over ``backend`` and commits them; a second pull moves nothing."""
    keys = synthetic_chain(1, 12)
    node_b = pulling_node(f"b-{backend}", 16, redis_url, backend)
    try:
        slots = node_b.reserve(keys[:3], [None, *keys[:2]])
        for key, slot in zip(keys[:3], slots):
            node_b.arena.slot(slot).numpy()[:] = synthetic_block(key, BLOCK_BYTES)
        node_b.commit(keys[:3])

        result = node_b.pull(keys, source_node="a")
        assert (result.num_local, result.num_pulled, result.source, result.path, result.error) == (
            3, 9, "a", backend, "")
        # the pulled blocks' checksums, verified on arrival, are kept for serving and demotion
        assert node_b._checksums == {
            key: block_checksum(synthetic_block(key, BLOCK_BYTES)) for key in keys[3:]}
        held = node_b.acquire(keys)
        assert len(held) == 12
        assert_blocks(keys, [node_b.arena.slot(s).numpy() for s in held])
        node_b.release(keys)
        assert node_b.tier_counters().pulled_blocks == 9
        assert node_b.pull(keys) == msgspec.convert(
            {"num_local": 12, "num_pulled": 0}, type=type(result))
    finally:
        node_b.shutdown()


def test_a_pull_from_a_dead_node_reports_why_and_moves_nothing(tmp_path, redis_url):
    doomed = NodeProcess("gone", node_config(tmp_path, 8, arena_dir=str(tmp_path)), ["5:4"],
                         redis_url)
    keys = synthetic_chain(5, 4)
    node_b = pulling_node("b-orphan", 8, redis_url)
    try:
        doomed.process.kill()  # its Redis entries outlive it until the heartbeat expires
        doomed.process.wait()
        result = node_b.pull(keys)
        assert (result.num_local, result.num_pulled, result.source) == (0, 0, "gone")
        assert "is its store node running" in result.error
        assert node_b.acquire(keys) == []  # the reserved slots were given back
        assert node_b.stats().used_blocks == 0
        assert node_b.tier_counters().pull_failures == 1
    finally:
        node_b.shutdown()
        doomed.stop()


def test_a_pull_into_a_full_arena_keeps_what_fits_and_says_so(redis_url, node_a, caplog):
    """B's arena has three slots: the pull stores the first three blocks, logs and counts the
    rest as rejected (to be recomputed), and returns a result instead of failing."""
    keys = synthetic_chain(1, 12)
    node_b = pulling_node("b-full", 3, redis_url)
    try:
        with caplog.at_level("WARNING", logger="kvstore.node"):
            result = node_b.pull(keys, source_node="a")
        assert (result.num_local, result.num_pulled, result.source) == (0, 3, "a")
        assert "room for 3 of 12 blocks from a" in caplog.text
        assert node_b.tier_counters().host_full_rejected_blocks == 9
        held = node_b.acquire(keys)
        assert_blocks(keys[:3], [node_b.arena.slot(s).numpy() for s in held])
        node_b.release(keys[:3])
    finally:
        node_b.shutdown()
