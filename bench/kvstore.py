"""``baton bench kvstore``: each KV store data path against the raw baseline of the same bytes.

Moves batches of real-sized KV blocks (default: one SmolLM2 block, 16 tokens x 23,040 B/token in
bf16 = 368,640 B; float32 doubles it) and measures, interleaved round by round in one run. A
batch is what one request pulls: 128 blocks (2,048 tokens) by default, while the Mooncake trace's
median prompt is 11,587 tokens; smaller batches weigh the fixed round trip (~1 ms here) more.

- ``shm``: a same-machine read through the transfer engine (pin, checksums, one copy out of the
  peer's arena, verify, release) vs a plain numpy copy of the same blocks;
- ``tcp`` and ``ucx``: a read from a store node in another process vs a raw blocking-socket
  loopback of the same number of bytes between two processes;
- ``disk-write`` and ``disk-read``: the disk tier (checksummed block files, atomic renames) vs
  plain sequential writes and reads of one file of the same size, in the same folder.

Each figure is the median over rounds of bytes / seconds, in GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
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

from kvstore.config import KVStoreConfig, TransferConfig
from kvstore.disk_tier import DiskTier
from kvstore.keys import BlockKey
from kvstore.standalone import synthetic_block, synthetic_chain
from kvstore.transfer import PeerAddress, TransferClient

SMOLLM2_BLOCK_BYTES = 16 * 23_040
TARGET_RATIOS = {"shm": 0.5, "tcp": 0.6, "ucx": 0.5, "disk-write": 0.6, "disk-read": 0.6}
BASELINES = {"shm": "numpy copy", "tcp": "raw socket", "ucx": "raw socket",
             "disk-write": "plain file write", "disk-read": "plain file read"}
_BENCH_ENV = {"UCX_TLS": "tcp", "UCXPY_PROGRESS_MODE": "blocking",
              "UCX_WARN_UNUSED_ENV_VARS": "n"}


class PathResult(msgspec.Struct, frozen=True):
    path: str
    gbps: float
    baseline_gbps: float
    ratio: float
    baseline: str
    target_ratio: float


# -- the raw socket baseline -------------------------------------------------------------------


def _raw_socket_server(port_pipe, num_bytes: int) -> None:
    """Serve ``num_bytes`` per 8-byte request on a plain blocking socket (another process)."""
    payload = memoryview(np.random.default_rng(0).integers(0, 256, num_bytes, dtype=np.uint8))
    listener = socket.create_server(("127.0.0.1", 0))
    port_pipe.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = bytearray(8)
    while conn.recv_into(request, 8) == 8:
        conn.sendall(payload[: struct.unpack("<Q", request)[0]])


class RawSocketBaseline:
    def __init__(self, num_bytes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=_raw_socket_server, args=(child, num_bytes),
                                    daemon=True)
        self._process.start()
        self._sock = socket.create_connection(("127.0.0.1", parent.recv()))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = np.empty(num_bytes, dtype=np.uint8)

    def read(self) -> None:
        view = memoryview(self._buffer)
        self._sock.sendall(struct.pack("<Q", len(view)))
        while view:
            view = view[self._sock.recv_into(view):]

    def close(self) -> None:
        self._sock.close()
        self._process.join(timeout=5)


# -- the store node under test -----------------------------------------------------------------


class ServingNode:
    """A ``kvstore.standalone`` store node in another process, holding one synthetic chain."""

    def __init__(self, block_bytes: int, num_blocks: int, transfer: TransferConfig,
                 env: dict[str, str]) -> None:
        config = KVStoreConfig(host_capacity_bytes=max(1 << 20, 2 * num_blocks * block_bytes),
                               transfer=transfer)
        argv = [sys.executable, "-m", "kvstore.standalone", "--node-id", "bench-server",
                "--block-bytes", str(block_bytes), "--config-json", config.model_dump_json(),
                "--fill", f"7:{num_blocks}"]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env)
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark's store node exited with {self.process.wait()}")
        self.address = msgspec.convert(json.loads(line)["address"], PeerAddress)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


# -- measurements ------------------------------------------------------------------------------


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


class _Series:
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def gbps(self, num_bytes: int) -> float:
        return num_bytes / statistics.median(self.seconds) / 1e9


def run_benchmark(block_bytes: int = SMOLLM2_BLOCK_BYTES, num_blocks: int = 128,
                  rounds: int = 21, disk_dir: str | None = None,
                  paths: tuple[str, ...] = ("shm", "tcp", "ucx", "disk")) -> list[PathResult]:
    """Measure every path in ``paths`` against its baseline, interleaved, ``rounds`` times
    (after one warm-up round)."""
    unknown = set(paths) - {"shm", "tcp", "ucx", "disk"}
    if unknown:
        raise ValueError(f"unknown benchmark paths {sorted(unknown)}: choose from shm, tcp, "
                         "ucx, disk")
    env = {**os.environ, **_BENCH_ENV}
    env.setdefault("BATON_TRANSFER_TOKEN", "baton-bench-" + os.urandom(8).hex())
    os.environ.update({k: env[k] for k in (*_BENCH_ENV, "BATON_TRANSFER_TOKEN")})
    num_bytes = block_bytes * num_blocks
    keys = synthetic_chain(7, num_blocks)
    expected = [synthetic_block(k, block_bytes) for k in keys]
    dests = [np.empty(block_bytes, dtype=np.uint8) for _ in keys]
    network = [p for p in ("shm", "tcp", "ucx") if p in paths]
    transfer = TransferConfig(backend="ucx" if "ucx" in paths else "tcp")
    node = ServingNode(block_bytes, num_blocks, transfer, env) if network else None
    client = TransferClient(transfer, "bench-client") if network else None
    raw = RawSocketBaseline(num_bytes) if {"tcp", "ucx"} & set(paths) else None
    disk = _DiskBench(block_bytes, num_blocks, disk_dir) if "disk" in paths else None
    series: dict[str, tuple[_Series, _Series]] = {}
    try:
        for path in network:  # connect, and check the bytes once
            result = client.read(node.address, keys, dests, path=path)
            if result.num_blocks != num_blocks or not all(
                    np.array_equal(d, e) for d, e in zip(dests, expected)):
                raise RuntimeError(f"benchmark read over {path} returned wrong bytes")
        for round_index in range(rounds + 1):
            record = round_index > 0  # round 0 warms caches and connections
            for path in network:
                baseline = (lambda: [np.copyto(d, e) for d, e in zip(dests, expected)]) if (
                    path == "shm") else raw.read
                measured = _timed(lambda: client.read(node.address, keys, dests, path=path))
                base = _timed(baseline)
                if record:
                    pair = series.setdefault(path, (_Series(), _Series()))
                    pair[0].seconds.append(measured)
                    pair[1].seconds.append(base)
            if disk is not None:
                for path, measured, base in disk.round():
                    if record:
                        pair = series.setdefault(path, (_Series(), _Series()))
                        pair[0].seconds.append(measured)
                        pair[1].seconds.append(base)
    finally:
        for closable in (client, raw, node, disk):
            if closable is not None:
                closable.close()
    results = []
    for path, (measured, base) in series.items():
        gbps, baseline_gbps = measured.gbps(num_bytes), base.gbps(num_bytes)
        results.append(PathResult(path, round(gbps, 3), round(baseline_gbps, 3),
                                  round(gbps / baseline_gbps, 3), BASELINES[path],
                                  TARGET_RATIOS[path]))
    return results


class _DiskBench:
    """Disk tier writes and reads of fresh blocks each round vs one plain file of the same size."""

    def __init__(self, block_bytes: int, num_blocks: int, disk_dir: str | None) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="baton-bench-disk-", dir=disk_dir))
        self._tier = DiskTier(self._root / "tier", 4 * block_bytes * num_blocks + (1 << 20),
                              block_bytes)
        self._blocks = [np.random.default_rng(i).integers(0, 256, block_bytes, dtype=np.uint8)
                        for i in range(num_blocks)]
        self._dest = np.empty(block_bytes, dtype=np.uint8)
        self._plain = self._root / "plain.bin"
        self._round = 0

    def round(self) -> list[tuple[str, float, float]]:
        self._round += 1
        keys = [BlockKey(os.urandom(16)) for _ in self._blocks]
        for key in list(self._tier._entries):  # keep the folder's size steady between rounds
            self._tier.remove(key)
        self._plain.unlink(missing_ok=True)
        # each timed step starts with no dirty pages, so none pays for another's writeback
        os.sync()
        write = _timed(lambda: [self._tier.put(k, None, b) for k, b in zip(keys, self._blocks)])
        os.sync()
        plain_write = _timed(self._plain_write)
        os.sync()
        read = _timed(lambda: [self._tier.get_into(k, self._dest) for k in keys])
        plain_read = _timed(self._plain_read)
        return [("disk-write", write, plain_write), ("disk-read", read, plain_read)]

    def _plain_write(self) -> None:
        with open(self._plain, "wb", buffering=0) as f:
            for block in self._blocks:
                f.write(block)

    def _plain_read(self) -> None:
        with open(self._plain, "rb", buffering=0) as f:
            for _ in self._blocks:
                f.readinto(self._dest)

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


def print_table(results: list[PathResult], block_bytes: int, num_blocks: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV store paths vs raw baselines ({num_blocks} blocks of "
                        f"{block_bytes:,} B per batch; GB/s = 10^9 B/s, median of rounds)")
    for column in ("path", "GB/s", "baseline", "baseline GB/s", "ratio", "target"):
        table.add_column(column, justify="left" if column in ("path", "baseline") else "right")
    for r in results:
        met = "[green]" if r.ratio >= r.target_ratio else "[red]"
        table.add_row(r.path, f"{r.gbps:.2f}", r.baseline, f"{r.baseline_gbps:.2f}",
                      f"{met}{r.ratio:.2f}", f">= {r.target_ratio}")
    Console().print(table)


def main(json_path: str | None, block_bytes: int, num_blocks: int, rounds: int,
         disk_dir: str | None, paths: tuple[str, ...]) -> list[PathResult]:
    results = run_benchmark(block_bytes, num_blocks, rounds, disk_dir, paths)
    print_table(results, block_bytes, num_blocks)
    if json_path:
        Path(json_path).write_text(
            json.dumps([msgspec.to_builtins(r) for r in results], indent=2) + "\n"
        )
    return results
