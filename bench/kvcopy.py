"""``baton bench kvcopy`` (also ``python -m bench.kvcopy``): the KV copy path alone.

Moves one request's blocks between a host arena (a shared-memory file, as the store's
``HostArena`` maps it) and an engine's paged KV cache through ``kvstore.kv_copy.BlockCopier``,
and compares its GB/s with a raw copy of the same bytes in one contiguous ``copy_``: pinned host
memory <-> device memory on CUDA, the physical bound of the bus. Per layer the cache is shaped
as vLLM's GPU layout, ``[2, num_blocks, block_size=16, kv_heads, head_dim]`` and viewed
block-first, with the request's blocks and slots scattered at random (as a long-running
engine's free lists leave them). ``--layout cpu`` uses vLLM-CPU's layout instead
(``[num_blocks, kv_heads, block_size, 2 * head_dim]``). ``--block-size`` defaults to the block
size Baton's engines run with on that layout's device (``engine.block_size_tokens`` unset: 16 on
CUDA, 32 on a CPU; ``BLOCK_TOKENS`` here, checked against ``engine.config`` by the tests).

Also timed: the connector's former copy (``layer[ids] = arena[slots, i].to(device)`` per
layer, and the reverse), so the gain is visible side by side. On CUDA the copier runs twice:
with the arena page-locked in place (``cudaHostRegister``) and through pinned staging. And a
step's loads (``per_step`` in the report): the same blocks as ``--requests`` requests' loads,
copied with one ``load`` call each (as the connector did) and with one call for the step (as
it does: ``ConnectorWorkerHalf._copy_in``).

Imports only torch and the standard library (and ``kvstore.kv_copy``/``host_arena``, which do
the same), so it runs on a bare GPU machine. CPU-only torch cannot pin memory: there the raw
copy is host to host and the run measures the code path only, not a bus.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvstore.host_arena import HostArena
from kvstore.kv_copy import BlockCopier

MODELS = {  # name: (layers, kv heads, head dim)
    "smollm2-135m": (30, 3, 64),
    "llama3-8b": (32, 8, 128),
}
BLOCK_TOKENS = {"gpu": 16, "cpu": 32}
"""Tokens per KV block by layout: what Baton's engines run unless ``engine.block_size_tokens``
is set (``engine.config.CUDA_KV_BLOCK_TOKENS``, ``CPU_KV_BLOCK_TOKENS``; not imported: this
module needs only torch)."""
CPU_NOTE = ("CPU-only torch cannot pin memory: the raw copy is host to host and this run "
            "measures the code path only, not a bus")


@dataclass(frozen=True)
class CopyRow:
    op: str  # load (arena -> cache) or save (cache -> arena)
    mode: str  # registered, staged (CUDA) or direct (CPU)
    gbps: float
    raw_gbps: float
    ratio: float
    legacy_gbps: float
    gbps_min: float
    gbps_max: float
    rounds: int


def _layers(layout: str, model: str, num_blocks: int, device: torch.device,
            dtype: torch.dtype, block_size: int) -> list[torch.Tensor]:
    num_layers, heads, head_dim = MODELS[model]
    if layout == "gpu":
        return [torch.zeros(2, num_blocks, block_size, heads, head_dim, dtype=dtype, device=device)
                .transpose(0, 1) for _ in range(num_layers)]
    return [torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(action: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    action()
    _sync(device)
    return time.perf_counter() - started


@dataclass(frozen=True)
class StepRow:
    """A step's loads: ``requests`` requests' blocks (``blocks`` in all) loaded with one call
    each against one call for the step."""

    mode: str
    requests: int
    per_request_gbps: float
    one_call_gbps: float
    ratio: float
    """one call / per request."""


def split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` consecutive runs of near-equal length (none empty)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for index in range(parts):
        end = start + size + (index < extra)
        out.append(items[start:end])
        start = end
    return out


def run(model: str = "smollm2-135m", layout: str = "gpu", blocks: int = 128,
        rounds: int = 9, staging_blocks: int = 64, device_name: str = "auto",
        seed: int = 0, block_size: int | None = None, requests: int = 8) -> dict:
    """Time every copy ``rounds`` times, interleaved round by round (after one warm-up).
    ``block_size``: tokens per block (None: ``BLOCK_TOKENS[layout]``); ``requests``: how many
    requests a step's loads of the same blocks come from (the ``per_step`` rows)."""
    block_size = block_size or BLOCK_TOKENS[layout]
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    dtype = torch.bfloat16
    rng = random.Random(seed)
    num_gpu_blocks, num_slots = 4 * blocks, 4 * blocks
    layers = _layers(layout, model, num_gpu_blocks, device, dtype, block_size)
    block_shape = tuple(layers[0].shape[1:])
    block_bytes = layers[0][0].numel() * layers[0].element_size() * len(layers)
    num_bytes = block_bytes * blocks
    arena_dir = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    arena = HostArena(Path(arena_dir) / f"baton-kvcopy-{os.getpid()}.arena", block_bytes,
                      num_slots, create=True)
    try:
        arena_layers = arena.slots.view(dtype).view(num_slots, len(layers), *block_shape)
        arena_layers.copy_(torch.randn(arena_layers.shape, dtype=torch.float32).to(dtype))
        slots = rng.sample(range(num_slots), blocks)
        block_ids = rng.sample(range(num_gpu_blocks), blocks)
        cuda = device.type == "cuda"
        modes = {"registered": True, "staged": False} if cuda else {"direct": False}
        copiers = {mode: BlockCopier(layers, staging_blocks, register_arena=register)
                   for mode, register in modes.items()}
        _check(copiers, arena_layers, layers, slots, block_ids)
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)
        dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        actions: dict[tuple[str, str], Callable[[], object]] = {
            ("raw", "load"): lambda: dev.copy_(host, non_blocking=cuda),
            ("raw", "save"): lambda: host.copy_(dev, non_blocking=cuda),
            ("legacy", "load"): lambda: _legacy_load(layers, arena_layers, slots, block_ids),
            ("legacy", "save"): lambda: _legacy_save(layers, arena_layers, block_ids, slots),
        }
        parts = list(zip(split(slots, requests), split(block_ids, requests)))
        for mode, copier in copiers.items():
            actions[(mode, "load")] = (lambda c=copier: c.load(arena_layers, slots, block_ids).wait())
            actions[(mode, "save")] = (lambda c=copier: c.save(arena_layers, block_ids, slots).wait())
            actions[(mode, "per-request")] = (
                lambda c=copier: [c.load(arena_layers, s, b).wait() for s, b in parts])
        seconds: dict[tuple[str, str], list[float]] = {key: [] for key in actions}
        order = list(actions)
        for round_index in range(rounds + 1):
            for key in (order if round_index % 2 else order[::-1]):  # alternate the order
                took = _seconds(actions[key], device)
                if round_index:
                    seconds[key].append(took)
        for copier in copiers.values():
            copier.close()
        registered = cuda and copiers["registered"]._registered and all(
            copiers["registered"]._registered.values())
    finally:
        arena.close()
        arena.unlink()

    def gbps(key: tuple[str, str], pick: Callable[[list[float]], float]) -> float:
        return round(num_bytes / pick(seconds[key]) / 1e9, 3)

    rows, step_rows = [], []
    for mode in modes:
        for op in ("load", "save"):
            median, raw = gbps((mode, op), statistics.median), gbps(("raw", op), statistics.median)
            rows.append(CopyRow(op, mode, median, raw, round(median / raw, 3),
                                gbps(("legacy", op), statistics.median),
                                gbps((mode, op), max), gbps((mode, op), min), rounds))
        one, each = gbps((mode, "load"), statistics.median), gbps((mode, "per-request"),
                                                                  statistics.median)
        step_rows.append(StepRow(mode, len(parts), each, one, round(one / each, 3)))
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "model": model, "layout": layout, "dtype": str(dtype),
        "block_size": block_size, "blocks": blocks, "block_bytes": block_bytes,
        "bytes_per_copy": num_bytes,
        "staging_blocks": staging_blocks, "arena_page_locked": bool(registered),
        "note": "" if cuda else CPU_NOTE,
        "rows": [asdict(r) for r in rows],
        "per_step": [asdict(r) for r in step_rows],
    }


def _check(copiers: dict[str, BlockCopier], arena_layers: torch.Tensor,
           layers: list[torch.Tensor], slots: list[int], block_ids: list[int]) -> None:
    """Every copier's load lands the arena's bytes and its save writes them back exactly."""
    expected = arena_layers[slots].clone()
    for mode, copier in copiers.items():
        for layer in layers:
            layer.zero_()
        copier.load(arena_layers, slots, block_ids).wait()
        arena_layers[slots] = 0
        copier.save(arena_layers, block_ids, slots).wait()
        if not torch.equal(arena_layers[slots], expected):
            raise RuntimeError(f"BlockCopier ({mode}) did not round-trip the blocks")


def _legacy_load(layers, arena_layers, slots, block_ids) -> None:
    index = torch.tensor(slots, dtype=torch.long)
    ids = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    for i, layer in enumerate(layers):
        layer[ids] = arena_layers[index, i].to(layer.device)


def _legacy_save(layers, arena_layers, block_ids, slots) -> None:
    dst = torch.tensor(slots, dtype=torch.long)
    src = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    for i, layer in enumerate(layers):
        arena_layers[dst, i] = layer[src].to("cpu")


def print_report(report: dict, out=sys.stdout) -> None:
    print(f"KV copy path on {report['device']} (torch {report['torch']}): {report['model']}, "
          f"{report['layout']} layout, {report['blocks']} blocks of {report['block_size']} "
          f"tokens x {report['block_bytes']:,} B "
          f"= {report['bytes_per_copy'] / 1e6:.1f} MB per copy; GB/s = 10^9 B/s, median "
          f"[min-max] of {report['rows'][0]['rounds']} rounds", file=out)
    if report["note"]:
        print(f"note: {report['note']}", file=out)
    print(f"{'op':<5} {'mode':<11} {'GB/s':>8} {'[min-max]':>15} {'raw GB/s':>9} {'ratio':>6} "
          f"{'legacy GB/s':>12}", file=out)
    for r in report["rows"]:
        spread = f"[{r['gbps_min']:.2f}-{r['gbps_max']:.2f}]"
        print(f"{r['op']:<5} {r['mode']:<11} {r['gbps']:>8.2f} {spread:>15} {r['raw_gbps']:>9.2f} "
              f"{r['ratio']:>6.2f} {r['legacy_gbps']:>12.2f}", file=out)
    for r in report.get("per_step", ()):
        print(f"a step's loads from {r['requests']} requests ({r['mode']}): one call "
              f"{r['one_call_gbps']:.2f} GB/s, one call a request {r['per_request_gbps']:.2f} "
              f"GB/s: {r['ratio']:.2f}x", file=out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.kvcopy", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    parser.add_argument("--layout", choices=("gpu", "cpu"), default="gpu",
                        help="vLLM's GPU layout or vLLM-CPU's")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block (default: what Baton's engines run on the "
                        "layout's device: 16 gpu, 32 cpu)")
    parser.add_argument("--blocks", type=int, default=128, help="blocks per copy (one request)")
    parser.add_argument("--requests", type=int, default=8,
                        help="a step's loads: the same blocks as this many requests' (the "
                        "per_step rows: one call each against one for the step)")
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds")
    parser.add_argument("--staging-blocks", type=int, default=64)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.block_size is not None and args.block_size < 1:
        parser.error(f"--block-size must be at least 1 (got {args.block_size})")
    if args.requests < 1:
        parser.error(f"--requests must be at least 1 (got {args.requests})")
    report = run(args.model, args.layout, args.blocks, args.rounds, args.staging_blocks,
                 args.device, block_size=args.block_size, requests=args.requests)
    print_report(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
