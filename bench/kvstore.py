"""``baton bench kvstore``: each KV store data path against a fair baseline of the same bytes.

A batch is what one request pulls: 128 blocks (2,048 tokens) of one SmolLM2 block each by default
(16 tokens x 23,040 B/token in bf16 = 368,640 B; float32 doubles it), while the Mooncake trace's
median prompt is 11,587 tokens. The paths and their baselines are described in
``bench.kvstore_measure``.

Fairness: every side of every run is a fresh process (its own server process where it has one),
so a path and its baseline never share a process, an import or a warm cache; the order alternates
run by run (path first, then baseline first: ABBA), and there are ``runs`` (>= 5 by default)
runs. A run's figure is the median of its timed rounds (after one warm-up round); a row reports
the median over runs with the spread (min, max), and its ratio is the median path figure over
the median baseline figure, with the spread of the runs' pair ratios. Disk reads come from the
disk (page cache dropped before each round), and the durable-write row syncs both sides.

GB/s are 10^9 bytes per second.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from bench.kvstore_measure import PATHS, UCX_ENV, Measurement

SMOLLM2_BLOCK_BYTES = 16 * 23_040
TARGET_RATIO = 0.8
PATH_GROUPS = {"disk": ("disk-write", "disk-write-nodigest", "disk-write-fsync", "disk-read")}
BASELINES = {
    "shm": "numpy copy from shared memory",
    "tcp": "raw socket, sendfile from shared memory",
    "ucx": "raw ucxx, one send per block",
    "disk-write": "one pwritev, preallocated file",
    "disk-write-nodigest": "one pwritev, preallocated file",
    "disk-write-fsync": "one pwritev + fdatasync",
    "disk-read": "one preadv, page cache dropped",
}
MEASURE_TIMEOUT_S = 180


class PathResult(msgspec.Struct, frozen=True):
    path: str
    gbps: float
    baseline_gbps: float
    ratio: float
    baseline: str
    target_ratio: float
    runs: int
    gbps_spread: tuple[float, float]  # (min, max) over runs
    baseline_gbps_spread: tuple[float, float]
    ratio_spread: tuple[float, float]  # (min, max) of the runs' path/baseline pairs


def expand_paths(paths: tuple[str, ...]) -> list[str]:
    """Row names for ``paths`` (``disk`` stands for its four rows), in ``PATHS`` order."""
    wanted: set[str] = set()
    for path in paths:
        wanted.update(PATH_GROUPS.get(path, (path,)))
    unknown = wanted - set(PATHS)
    if unknown:
        raise ValueError(f"unknown benchmark paths {sorted(unknown)}: choose from shm, tcp, "
                         f"ucx, disk ({', '.join(PATH_GROUPS['disk'])})")
    return [p for p in PATHS if p in wanted]


def measure_side(m: Measurement) -> float:
    """GB/s of one side of one run: a fresh ``bench.kvstore_measure`` process."""
    env = {**os.environ, **UCX_ENV}
    env.setdefault("BATON_TRANSFER_TOKEN", "baton-bench-" + os.urandom(8).hex())
    done = subprocess.run([sys.executable, "-m", "bench.kvstore_measure",
                           msgspec.json.encode(m).decode()], capture_output=True, text=True,
                          env=env, timeout=MEASURE_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measuring {m.path} ({m.side}) failed with {done.returncode}:\n"
                           f"{done.stderr[-2000:]}")
    return m.block_bytes * m.num_blocks / json.loads(lines[-1])["median_s"] / 1e9


def run_benchmark(block_bytes: int = SMOLLM2_BLOCK_BYTES, num_blocks: int = 128,
                  rounds: int = 5, disk_dir: str | None = None,
                  paths: tuple[str, ...] = ("shm", "tcp", "ucx", "disk"), runs: int = 5,
                  progress: Callable[[str], None] | None = None) -> list[PathResult]:
    """Every row of ``paths`` against its baseline, ``runs`` ABBA-ordered runs of fresh
    processes, each of ``rounds`` timed rounds."""
    if runs < 1 or rounds < 1:
        raise ValueError("runs and rounds must be at least 1")
    results = []
    for path in expand_paths(paths):
        figures: dict[str, list[float]] = {"path": [], "baseline": []}
        for run in range(runs):
            for side in ("path", "baseline") if run % 2 == 0 else ("baseline", "path"):
                m = Measurement(path, side, block_bytes, num_blocks, rounds, disk_dir)
                figures[side].append(measure_side(m))
                if progress is not None:
                    progress(f"{path} run {run + 1}/{runs} {side}: {figures[side][-1]:.2f} GB/s")
        results.append(_row(path, figures["path"], figures["baseline"]))
    return results


def _row(path: str, measured: list[float], base: list[float]) -> PathResult:
    gbps, baseline_gbps = statistics.median(measured), statistics.median(base)
    pairs = [a / b for a, b in zip(measured, base)]

    def spread(values: list[float]) -> tuple[float, float]:
        return round(min(values), 3), round(max(values), 3)

    return PathResult(path, round(gbps, 3), round(baseline_gbps, 3),
                      round(gbps / baseline_gbps, 3), BASELINES[path], TARGET_RATIO,
                      len(measured), spread(measured), spread(base), spread(pairs))


def print_table(results: list[PathResult], block_bytes: int, num_blocks: int) -> None:
    from rich.console import Console
    from rich.table import Table

    runs = results[0].runs if results else 0
    table = Table(title=f"KV store paths vs fair baselines ({num_blocks} blocks of "
                        f"{block_bytes:,} B per batch; GB/s = 10^9 B/s, median [min-max] of "
                        f"{runs} ABBA runs in fresh processes)")
    for column in ("path", "GB/s", "baseline", "baseline GB/s", "ratio", "target"):
        table.add_column(column, justify="left" if column in ("path", "baseline") else "right")
    for r in results:
        met = "[green]" if r.ratio >= r.target_ratio else "[red]"
        table.add_row(
            r.path, f"{r.gbps:.2f} [{r.gbps_spread[0]:.2f}-{r.gbps_spread[1]:.2f}]", r.baseline,
            f"{r.baseline_gbps:.2f} [{r.baseline_gbps_spread[0]:.2f}-"
            f"{r.baseline_gbps_spread[1]:.2f}]",
            f"{met}{r.ratio:.2f}[/] [{r.ratio_spread[0]:.2f}-{r.ratio_spread[1]:.2f}]",
            f">= {r.target_ratio}")
    Console().print(table)


def main(json_path: str | None, block_bytes: int, num_blocks: int, rounds: int,
         disk_dir: str | None, paths: tuple[str, ...], runs: int = 5) -> list[PathResult]:
    from rich.console import Console

    console = Console(stderr=True)
    results = run_benchmark(block_bytes, num_blocks, rounds, disk_dir, paths, runs,
                            progress=lambda line: console.print(f"[dim]{line}[/dim]"))
    print_table(results, block_bytes, num_blocks)
    if json_path:
        Path(json_path).write_text(
            json.dumps([msgspec.to_builtins(r) for r in results], indent=2) + "\n"
        )
    return results
