"""One side of one ``baton bench kvstore`` pair, measured in a process of its own.

``python -m bench.kvstore_measure '<Measurement as JSON>'`` prints one JSON line: the seconds of
each timed round (after one warm-up round) moving ``num_blocks`` blocks of ``block_bytes``. The
orchestrator (``bench.kvstore``) starts a fresh process for every side of every run, so a path
and its baseline never share a process, an import (UCX) or a warm cache.

Paths (Baton's code) and their baselines (what a competent engineer would write for the same
bytes, with no checksums, pins or protocol):

- ``shm``: ``TransferClient.read(path="shm")`` from a store node in another process (pin round
  trip, one copy out of its arena, XXH3 checks, release) vs ``np.copyto`` of the same blocks out
  of a shared-memory file into the same kind of destinations;
- ``tcp``: the same read over TCP vs a raw server in another process sending the blocks straight
  from a shared-memory file (``sendfile``, or ``sendall`` of memoryviews), socket buffers left
  to the kernel's autotuning, into per-block destinations with ``recv_into``;
- ``ucx``: the same read over UCX vs a raw ucxx server sending the same blocks (one tagged send
  per block, all in flight) into the same destinations;
- ``disk-write``: ``DiskTier.put_many`` of fresh blocks with their parents and their XXH3s, as
  the node demotes the blocks one store call evicted (their writer sent the XXH3s with its
  commit, hashed in its save: that cost is the save's, not timed here), vs one ``pwritev`` of
  the same blocks into a preallocated file, page cache dropped before each round;
  ``disk-write-nodigest`` the same without the XXH3s (the tier hashes each payload: a block
  committed without them);
  ``disk-write-fsync`` the same as ``disk-write``, made durable (``DiskTier(fsync=True)``:
  one ``fdatasync`` per batch; the baseline's ``pwritev`` then ``fdatasync``);
- ``disk-read``: ``DiskTier.get_into`` vs one ``preadv`` of the same blocks, each round after
  ``fsync`` and ``posix_fadvise(DONTNEED)``: the bytes come from the disk, not the page cache.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

PATHS = ("shm", "tcp", "ucx", "disk-write", "disk-write-nodigest", "disk-write-fsync",
         "disk-read")
SIDES = ("path", "baseline")
UCX_ENV = {"UCX_TLS": "tcp", "UCXPY_PROGRESS_MODE": "blocking", "UCX_WARN_UNUSED_ENV_VARS": "n"}


class Measurement(msgspec.Struct, frozen=True):
    path: str
    side: str
    block_bytes: int
    num_blocks: int
    rounds: int
    disk_dir: str | None = None


def measure(m: Measurement) -> list[float]:
    """Seconds of each of ``m.rounds`` timed rounds, after one untimed warm-up round."""
    if m.path not in PATHS or m.side not in SIDES:
        raise ValueError(f"unknown measurement {m.path}/{m.side}")
    if m.path.startswith("disk"):
        return _disk(m)
    if m.side == "path":
        return _transfer_path(m)
    return {"shm": _shm_baseline, "tcp": _tcp_baseline, "ucx": _ucx_baseline}[m.path](m)


def _rounds(m: Measurement, action: Callable[[], object],
            before: Callable[[], object] | None = None) -> list[float]:
    seconds = []
    for round_index in range(m.rounds + 1):
        if before is not None:
            before()
        started = time.perf_counter()
        action()
        if round_index:
            seconds.append(time.perf_counter() - started)
    return seconds


def _destinations(m: Measurement) -> list[np.ndarray]:
    """Per-block destinations, scattered like a consumer's arena slots, touched once."""
    return [np.ones(m.block_bytes, dtype=np.uint8) for _ in range(m.num_blocks)]


# -- shared memory and the network: Baton's transfer engine ------------------------------------


def _transfer_path(m: Measurement) -> list[float]:
    from kvstore.config import KVStoreConfig, TransferConfig
    from kvstore.standalone import synthetic_block, synthetic_chain
    from kvstore.transfer import PeerAddress, TransferClient

    os.environ.setdefault("BATON_TRANSFER_TOKEN", "baton-bench-" + os.urandom(8).hex())
    if m.path == "ucx":
        os.environ.update(UCX_ENV)
    transfer = TransferConfig(backend="ucx" if m.path == "ucx" else "tcp")
    config = KVStoreConfig(host_capacity_bytes=max(1 << 20, 2 * m.num_blocks * m.block_bytes),
                           transfer=transfer)
    argv = [sys.executable, "-m", "kvstore.standalone", "--node-id", "bench-server",
            "--block-bytes", str(m.block_bytes), "--config-json", config.model_dump_json(),
            "--fill", f"7:{m.num_blocks}"]
    server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = None
    try:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark's store node exited with {server.wait()}")
        address = msgspec.convert(json.loads(line)["address"], PeerAddress)
        client = TransferClient(transfer, "bench-client")
        keys = synthetic_chain(7, m.num_blocks)
        dests = _destinations(m)
        result = client.read(address, keys, dests, path=m.path)
        if result.num_blocks != m.num_blocks or not all(
                np.array_equal(d, synthetic_block(k, m.block_bytes)) for d, k in zip(dests, keys)):
            raise RuntimeError(f"benchmark read over {m.path} returned wrong bytes")

        def read() -> None:
            if client.read(address, keys, dests, path=m.path).num_blocks != m.num_blocks:
                raise RuntimeError(f"benchmark read over {m.path} came back short")

        return _rounds(m, read)
    finally:
        if client is not None:
            client.close()
        server.stdin.close()
        server.wait(timeout=30)


# -- shared memory: the baseline ---------------------------------------------------------------


class _ShmBlocks:
    """``num_blocks`` random blocks in a shared-memory file, as a store's arena holds them."""

    def __init__(self, m: Measurement) -> None:
        base = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
        self.path = Path(base) / f"baton-bench-raw-{os.getpid()}.arena"
        self.num_bytes = m.block_bytes * m.num_blocks
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, self.num_bytes)
        self.map = mmap.mmap(self.fd, self.num_bytes)
        self.blocks = np.frombuffer(self.map, dtype=np.uint8).reshape(m.num_blocks, m.block_bytes)
        self.blocks[:] = np.random.default_rng(0).integers(0, 256, self.blocks.shape, np.uint8)

    def close(self) -> None:
        self.blocks = None
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


def _shm_baseline(m: Measurement) -> list[float]:
    source = _ShmBlocks(m)
    dests = _destinations(m)
    try:
        return _rounds(m, lambda: [np.copyto(d, s) for d, s in zip(dests, source.blocks)])
    finally:
        source.close()


# -- TCP: the baseline -------------------------------------------------------------------------


def _tune(sock: socket.socket, num_bytes: int) -> None:
    """No delay; buffer sizes left to the kernel's autotuning, which grows them to
    ``net.ipv4.tcp_[rw]mem``'s maximum (32 MiB here), where an explicit ``SO_RCVBUF`` is capped
    at ``net.core.rmem_max`` (4 MiB here) and turns autotuning off: setting them measured slower."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def raw_tcp_server(port_file: str, block_bytes: int, num_blocks: int, mode: str) -> None:
    """Serve the blocks of a shared-memory file per 8-byte request (its block count), with
    ``sendfile`` from the file or ``sendall`` of memoryviews over its mapping."""
    m = Measurement("tcp", "baseline", block_bytes, num_blocks, 0)
    source = _ShmBlocks(m)
    listener = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    _tune(conn, source.num_bytes)
    view = memoryview(source.map)
    request = bytearray(8)
    try:
        while conn.recv_into(request, 8) == 8:
            count = struct.unpack("<Q", request)[0]
            if mode == "sendfile":
                offset, end = 0, count * block_bytes
                while offset < end:
                    offset += os.sendfile(conn.fileno(), source.fd, offset, end - offset)
            else:
                for i in range(count):
                    conn.sendall(view[i * block_bytes:(i + 1) * block_bytes])
    finally:
        view.release()
        conn.close()
        source.close()


def _tcp_baseline(m: Measurement, mode: str | None = None) -> list[float]:
    mode = mode or os.environ.get("BATON_BENCH_RAW_TCP", "sendfile")
    with tempfile.TemporaryDirectory() as folder:
        port_file = Path(folder) / "port"
        code = (f"from bench.kvstore_measure import raw_tcp_server; raw_tcp_server("
                f"{str(port_file)!r}, {m.block_bytes}, {m.num_blocks}, {mode!r})")
        server = subprocess.Popen([sys.executable, "-c", code])
        try:
            _wait_for(port_file, server)
            sock = socket.create_connection(("127.0.0.1", int(port_file.read_text())))
            _tune(sock, m.block_bytes * m.num_blocks)
            dests = [memoryview(d) for d in _destinations(m)]
            request = struct.pack("<Q", m.num_blocks)

            def read() -> None:
                sock.sendall(request)
                for dest in dests:
                    view = dest
                    while view:
                        n = sock.recv_into(view)
                        if not n:
                            raise ConnectionResetError("the raw TCP server went away")
                        view = view[n:]

            try:
                return _rounds(m, read)
            finally:
                sock.close()
        finally:
            server.wait(timeout=30)


# -- UCX: the baseline -------------------------------------------------------------------------


def raw_ucx_server(port_file: str, block_bytes: int, num_blocks: int) -> None:
    """Serve the blocks of a shared-memory file over UCX: per request (a u64 block count), one
    tagged send per block, all in flight at once; until the client goes away."""
    import asyncio

    os.environ.update(UCX_ENV)
    import ucxx

    ucxx.init(options={"TLS": "tcp"}, progress_mode="blocking")
    source = _ShmBlocks(Measurement("ucx", "baseline", block_bytes, num_blocks, 0))

    async def main() -> None:
        finished = asyncio.Event()

        async def serve(endpoint) -> None:
            request = np.empty(1, dtype=np.uint64)
            try:
                while True:
                    await endpoint.recv(request)
                    await asyncio.gather(*(endpoint.send(source.blocks[i])
                                           for i in range(int(request[0]))))
            except Exception:  # noqa: BLE001 - the client closed
                pass
            finally:
                finished.set()

        listener = ucxx.create_listener(serve)
        Path(port_file).write_text(str(listener.port))
        await finished.wait()
        listener.close()

    try:
        asyncio.run(main())
    finally:
        source.close()


def _ucx_baseline(m: Measurement) -> list[float]:
    import asyncio

    os.environ.update(UCX_ENV)
    import ucxx

    ucxx.init(options={"TLS": "tcp"}, progress_mode="blocking")
    dests = _destinations(m)
    seconds: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        port_file = Path(folder) / "port"
        code = (f"from bench.kvstore_measure import raw_ucx_server; raw_ucx_server("
                f"{str(port_file)!r}, {m.block_bytes}, {m.num_blocks})")
        server = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
        try:
            _wait_for(port_file, server)

            async def main() -> None:
                endpoint = await ucxx.create_endpoint("127.0.0.1", int(port_file.read_text()))
                request = np.array([m.num_blocks], dtype=np.uint64)
                for round_index in range(m.rounds + 1):
                    started = time.perf_counter()
                    await endpoint.send(request)
                    await asyncio.gather(*(endpoint.recv(d) for d in dests))
                    if round_index:
                        seconds.append(time.perf_counter() - started)
                await endpoint.close()

            asyncio.run(main())
        finally:
            server.wait(timeout=30)
    expected = np.random.default_rng(0).integers(0, 256, (m.num_blocks, m.block_bytes), np.uint8)
    if not all(np.array_equal(d, e) for d, e in zip(dests, expected)):
        raise RuntimeError("the raw UCX baseline returned wrong bytes")
    return seconds


def _wait_for(port_file: Path, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the raw baseline server did not start")
        time.sleep(0.01)


# -- disk --------------------------------------------------------------------------------------


def drop_page_cache(path: Path) -> None:
    """Write back and drop ``path``'s pages, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _disk(m: Measurement) -> list[float]:
    root = Path(tempfile.mkdtemp(prefix="baton-bench-disk-", dir=m.disk_dir))
    blocks = [np.random.default_rng(i).integers(0, 256, m.block_bytes, dtype=np.uint8)
              for i in range(m.num_blocks)]
    dests = _destinations(m)
    durable = m.path == "disk-write-fsync"
    try:
        if m.side == "path":
            return _disk_tier(m, root, blocks, dests, durable)
        return _plain_file(m, root, blocks, dests, durable)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _disk_tier(m: Measurement, root: Path, blocks: list[np.ndarray], dests: list[np.ndarray],
               durable: bool) -> list[float]:
    from kvstore.disk_tier import DiskTier
    from kvstore.keys import BlockKey
    from kvstore.transfer_wire import block_checksum

    slot_bytes_guess = m.block_bytes + 4096
    tier = DiskTier(root / "tier", 2 * m.num_blocks * slot_bytes_guess, m.block_bytes,
                    fsync=durable)
    keys: list[BlockKey] = []
    # the XXH3s the writer sent with its commit (hashed in its save, not here)
    digests = None if m.path == "disk-write-nodigest" else [block_checksum(b) for b in blocks]
    try:
        def fresh_keys() -> None:  # an empty tier each round, the same slots rewritten
            for key in keys:
                tier.remove(key)
            keys[:] = [BlockKey(os.urandom(16)) for _ in blocks]
            drop_page_cache(tier.path)

        def write() -> None:  # the node's demotion: one put_many of the blocks one store
            # call evicted, parents named, with their writer's XXH3s (but for nodigest);
            # durable: the batch synced once
            stored = tier.put_many(list(zip(keys, [None, *keys[:-1]], blocks)),
                                   payload_xxh3s=digests)
            if not all(stored):
                raise RuntimeError("the disk tier refused a benchmark block")

        if m.path != "disk-read":
            return _rounds(m, write, before=fresh_keys)
        fresh_keys()
        write()

        def read() -> None:
            for key, dest in zip(keys, dests):
                if not tier.get_into(key, dest):
                    raise RuntimeError("the disk tier missed a benchmark block")

        seconds = _rounds(m, read, before=lambda: drop_page_cache(tier.path))
        if not all(np.array_equal(d, b) for d, b in zip(dests, blocks)):
            raise RuntimeError("the disk tier returned wrong bytes")
        return seconds
    finally:
        tier.close()


def _plain_file(m: Measurement, root: Path, blocks: list[np.ndarray], dests: list[np.ndarray],
                durable: bool) -> list[float]:
    path = root / "plain.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, m.block_bytes * m.num_blocks)

        def write() -> None:
            _pwritev_all(fd, [memoryview(b) for b in blocks], 0)
            if durable:
                os.fdatasync(fd)

        if m.path != "disk-read":
            return _rounds(m, write, before=lambda: drop_page_cache(path))
        write()
        views = [memoryview(d) for d in dests]

        def read() -> None:
            if _preadv_all(fd, views, 0) != m.block_bytes * m.num_blocks:
                raise RuntimeError("the plain file came back short")

        seconds = _rounds(m, read, before=lambda: drop_page_cache(path))
        if not all(np.array_equal(d, b) for d, b in zip(dests, blocks)):
            raise RuntimeError("the plain file returned wrong bytes")
        return seconds
    finally:
        os.close(fd)


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    iov_max = os.sysconf("SC_IOV_MAX")
    for start in range(0, len(views), iov_max):
        batch = views[start:start + iov_max]
        offset += os.pwritev(fd, batch, offset)  # regular files: whole unless the disk fails


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    iov_max = os.sysconf("SC_IOV_MAX")
    total = 0
    for start in range(0, len(views), iov_max):
        n = os.preadv(fd, views[start:start + iov_max], offset + total)
        total += n
    return total


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    m = msgspec.json.decode(args[0], type=Measurement)
    seconds = measure(m)
    print(json.dumps({"seconds": seconds, "median_s": statistics.median(seconds)}), flush=True)


if __name__ == "__main__":
    main()
