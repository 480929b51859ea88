"""The ``baton bench`` group: simulated fleet replay, the KV store's data paths, the conductor's
decision time, live trace replay against a running gateway, and the structure-aware fuzz of a
local cluster's fronts.

Contract: ``bench_app`` is added to the ``baton`` app as ``bench`` by ``cli.main``; each
command only parses its flags and calls its benchmark in ``bench/`` (imported when it runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from cli.common import err, parse_overrides

def _live(label: str, config: Optional[Path], overrides: dict, run, wrote: Optional[Path] = None):
    """Load the config (exit 2 on a bad one), run a live benchmark or drill with ``label``'s
    progress lines, and exit 1 unless its report is ok."""
    from cluster.config import load_config
    from protos.errors import ConfigError

    try:
        report = run(load_config(config, overrides),
                     lambda msg: err.print(f"[cyan]{label}[/cyan] {msg}"))
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    if wrote is not None:
        err.print(f"[dim]wrote {wrote}[/dim]")
    if not report.ok:
        raise typer.Exit(1)


bench_app = typer.Typer(help="Benchmarks: simulated fleets, the live cluster, the KV store, "
                        "the conductor, the fronts' fuzz.",
                        no_args_is_help=True)


@bench_app.command("replay", short_help="SIMULATED: a fleet replaying a trace under each placement policy.")
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
    tune: bool = typer.Option(True, help="Tune each policy's knobs on the trace's first slice, race on the rest."),
    tune_fraction: float = typer.Option(0.25, help="Share of the trace (first requests) held apart for tuning."),
    prediction_error: Optional[float] = typer.Option(
        None, help="Mean relative error of actual prefill/transfer times around the prediction (0.1: "
        "10%). Default: fitted to the live cost model's measured error (--live-error, else the "
        "figure recorded in simulator/live_error.py)."),
    live_error: Optional[Path] = typer.Option(
        None, help="Draw the error fitted to the live prefill error in this 'baton status --json' "
        "output or 'baton bench peers' peers.json (its median)."),
    error_seed: int = typer.Option(0, help="Seed of the per-request prediction errors."),
    coalesce: bool = typer.Option(True, help="Model baton's in-flight prefix coalescing (its live conductor's)."),
) -> None:
    """SIMULATE a fleet replaying a trace under each placement policy (the conductor's own code):
    each tuned on a held-apart slice, then hit ratio, TTFT, TBT, SLO attainment, goodput (to 2%)
    and the ratios to the trace's oracle bound per policy."""
    from bench.replay import replay_command
    from simulator.replay import default_jobs

    replay_command(trace, prefill, decode, policy, out, rate_scale, profile, ttft_slo_ms, tbt_slo_ms,
                   goodput, jobs or default_jobs(), instances_per_node, device_kv_gib, host_gib,
                   disk_gib, admission, err, tune, tune_fraction, prediction_error, error_seed, coalesce,
                   live_error)


@bench_app.command("replay-breakdown", short_help="SIMULATED: where each policy's TTFT above the oracle's goes.")
def bench_replay_breakdown(
    out: Path = typer.Argument(..., help="A 'baton bench replay' output folder (run.json, results.json)."),
    policy: str = typer.Option("baton,mooncake", help="'all' or policy names, comma-separated."),
    rate_scale: Optional[float] = typer.Option(None, help="Arrival-rate multiplier (default: the replay's)."),
) -> None:
    """SIMULATE again the replay's policies with their tuned knobs and split each one's TTFT
    over the oracle's into parts: rejections, holds, queue, prefix transfer, missed blocks,
    hand-off and decode steps."""
    from bench.replay_breakdown import breakdown_command

    breakdown_command(out, policy, rate_scale, err)


@bench_app.command("kvstore", short_help="Each KV store data path against a fair baseline (ABBA runs).")
def bench_kvstore(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    block_bytes: int = typer.Option(368_640, help="Bytes per KV block (SmolLM2, 16 tokens: "
                                    "368,640 in bf16, 737,280 in float32)."),
    blocks: int = typer.Option(
        128, help="Blocks per batch: one prompt's pull (128 x 16 tokens = 2,048 tokens; the "
        "Mooncake trace's median prompt is 11,587)."),
    rounds: int = typer.Option(5, help="Timed rounds per process (after one warm-up)."),
    runs: int = typer.Option(5, help="ABBA runs per path: each side of each run is a fresh "
                             "process."),
    disk_dir: Optional[Path] = typer.Option(None, help="Folder for the disk tier runs "
                                            "(default: the system temp folder)."),
    paths: str = typer.Option("shm,tcp,ucx,disk", help="Comma-separated: shm, tcp, ucx, disk "
                              "(or disk-write, disk-write-nodigest, disk-write-fsync, disk-read)."),
) -> None:
    """Each KV store data path (shared memory, tcp, ucx, disk tier) against a fair baseline."""
    from bench.kvstore import main as run_kvstore_bench

    run_kvstore_bench(str(json_path) if json_path else None, block_bytes, blocks, rounds,
                      str(disk_dir) if disk_dir else None, tuple(paths.split(",")), runs)


@bench_app.command("kvcopy", short_help="The KV copy path alone: arena <-> KV cache GB/s against a raw copy.")
def bench_kvcopy(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
    model: str = typer.Option("smollm2-135m", help="KV shape: smollm2-135m or llama3-8b."),
    layout: str = typer.Option("gpu", help="vLLM's GPU layout ('gpu') or vLLM-CPU's ('cpu')."),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="Tokens per block (default: what Baton's engines run on the "
        "layout's device: 16 gpu, 32 cpu)."),
    blocks: int = typer.Option(128, help="Blocks per copy (one request's load or save)."),
    rounds: int = typer.Option(9, help="Measured rounds (after one warm-up)."),
    staging_blocks: int = typer.Option(64, help="Blocks per staging chunk of the copier."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    requests: int = typer.Option(8, help="A step's loads: the same blocks as this many "
                                 "requests' (one copy call each against one for the step)."),
) -> None:
    """The KV copy path alone: BlockCopier's arena <-> cache GB/s against a raw pinned copy of
    the same bytes (also: python -m bench.kvcopy, which needs only torch)."""
    from bench.kvcopy import main as run_kvcopy_bench

    argv = ["--model", model, "--layout", layout, "--blocks", str(blocks), "--rounds",
            str(rounds), "--staging-blocks", str(staging_blocks), "--device", device,
            "--requests", str(requests)]
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    run_kvcopy_bench(argv + (["--json", str(json_path)] if json_path else []))


@bench_app.command("conductor", short_help="The conductor's placement decision latency and KV-event ingestion rate.")
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


@bench_app.command("serve",
                   short_help="LIVE: replay a trace against a running gateway (vllm bench serve's metrics).",
                   context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
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


@bench_app.command("overload", short_help="LIVE: admission control at 3x and 10x the sustainable rate.")
def bench_overload(
    json_path: Optional[Path] = typer.Option(Path("bench-out/overload.json"), "--json",
                                             help="Write the report here."),
    model: str = typer.Option("smollm2", help="'smollm2' or 'tiny'."),
    ttft_slo_ms: float = typer.Option(2000.0, help="TTFT SLO (ms): admission rejects a request "
                                      "predicted to miss it."),
    tbt_slo_ms: float = typer.Option(200.0, help="Inter-token SLO (ms), admitted the same way."),
    factors: str = typer.Option("3,10", help="Overload factors of the sustainable rate, "
                                "comma-separated."),
    probe: float = typer.Option(15.0, help="Seconds of each bisection probe."),
    burst: float = typer.Option(30.0, help="Seconds of each overload run."),
    max_tokens: int = typer.Option(16, help="Tokens each request generates."),
    prefill: int = typer.Option(1, help="Prefill instances."),
    decode: int = typer.Option(1, help="Decode instances."),
    seed: int = typer.Option(0, help="Seed of the prompts and the arrivals."),
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
) -> None:
    """LIVE overload: a local cluster with admission on and named SLOs; its sustainable rate found
    by bisection, then driven at 3x and 10x that rate. Reports admitted/rejected/other errors,
    SLO attainment and p99 TTFT of the admitted, peak RSS, and the seconds to recover. Exit code
    1 when an admitted run misses 90% attainment, another status than RESOURCE_EXHAUSTED appears,
    a worker dies, or recovery takes over 10 s."""
    from bench.overload import main as run_overload

    overrides = {"prefill.num_instances": prefill, "decode.num_instances": decode,
                 "engine.model": model, "gateway.port": 0, "http.enabled": False,
                 "name": "overload", "conductor.tuning.ttft_slo_ms": ttft_slo_ms,
                 "conductor.tuning.tbt_slo_ms": tbt_slo_ms, **parse_overrides(set_)}
    factor_list = tuple(float(f) for f in factors.split(","))
    _live("overload", None, overrides, lambda cfg, progress: run_overload(
        cfg, json_path, factor_list, probe, burst, max_tokens, seed, progress), json_path)


@bench_app.command("itl", short_help="LIVE: decode streams' inter-token latency while other requests' KV loads.")
def bench_itl(
    json_path: Optional[Path] = typer.Option(Path("bench-out/itl.json"), "--json",
                                             help="Write the report here."),
    model: str = typer.Option("smollm2", help="'smollm2' or 'tiny'."),
    streams: int = typer.Option(8, help="Long generations the decode engine streams throughout."),
    prompt_tokens: int = typer.Option(3000, help="Tokens of each cached prompt the decode loads."),
    pool: Optional[int] = typer.Option(None, help="Cached prompts cycled through (default: "
                                       "enough that the decode engine's own KV cache cannot "
                                       "hold them, so each is loaded from the host tier)."),
    load_clients: int = typer.Option(16, help="Clients sending cached prompts back to back."),
    idle: float = typer.Option(15.0, help="Seconds of the idle phase (streams only)."),
    loaded: float = typer.Option(30.0, help="Seconds of the loaded phase."),
    order: str = typer.Option("async,sync", help="Which configuration runs first."),
    repeats: int = typer.Option(1, help="Runs of each configuration (ABBA order)."),
    seed: int = typer.Option(0, help="Seed of the prompts and the streams' sampling."),
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
) -> None:
    """LIVE: the decode streams' inter-token latency while the decode engine loads other
    requests' KV from the host tier, against the same streams idle; the shipped asynchronous KV
    path and the synchronous baseline (engine.async_kv_transfers false) in the same run.
    Reports ITL p50/p99 idle and loaded, their ratio, the loads, their rate and GB/s. Exit code
    1 when the shipped path's ratio is over 1.1 or fewer than 10 loads a second were under way."""
    from bench.itl import main as run_itl

    overrides = {"engine.model": model, "gateway.port": 0, "http.enabled": False, "name": "itl",
                 "prefill.num_instances": 1, "decode.num_instances": 1,
                 "kvstore.host_capacity_bytes": 3 << 30, **parse_overrides(set_)}
    _live("itl", None, overrides, lambda cfg, progress: run_itl(
        cfg, json_path, progress, streams=streams, prompt_tokens=prompt_tokens, pool=pool,
        load_clients=load_clients, idle_s=idle, loaded_s=loaded, order=order, repeats=repeats,
        seed=seed), json_path)


@bench_app.command("sessions", short_help="LIVE: agent sessions across tool pauses, KV retention off and on.")
def bench_sessions(
    json_path: Optional[Path] = typer.Option(Path("bench-out/sessions.json"), "--json",
                                             help="Write the report here."),
    model: str = typer.Option("smollm2", help="'smollm2' or 'tiny'."),
    sessions: int = typer.Option(6, help="Concurrent agent sessions."),
    steps: int = typer.Option(6, help="Steps per session (a tool pause between two)."),
    trunk_tokens: int = typer.Option(1024, help="Tokens of the system prompt every session shares."),
    think: float = typer.Option(8.0, help="Median tool pause (s; log-normal, long-tailed)."),
    max_tokens: int = typer.Option(32, help="Tokens of each step's reply."),
    noise_clients: int = typer.Option(1, help="Background clients sending unique prompts back "
                                      "to back (they churn the caches)."),
    noise_tokens: int = typer.Option(512, help="Tokens of each background prompt."),
    noise_rate: float = typer.Option(1.0, help="Background prompts a second per client "
                                     "(0: back to back)."),
    device_blocks: int = typer.Option(192, help="Blocks of each engine's own KV cache (fewer "
                                      "than the sessions' working set; 192 blocks of 32 tokens, "
                                      "the 6,144 tokens 48 blocks of 128 held before "
                                      "engine.block_size_tokens)."),
    host_factor: float = typer.Option(1.0, help="The store's host tier, as a multiple of the "
                                      "sessions' working set (the lease caps are the whole tier)."),
    order: str = typer.Option("off,on", help="Which configuration runs first."),
    repeats: int = typer.Option(1, help="Runs of each configuration (ABBA order)."),
    seed: int = typer.Option(0, help="Seed of the workload."),
    prefetch: bool = typer.Option(False, help="Also measure what the session prefetch saves: "
                                  "retention on with a disk tier and half the host tier, the "
                                  "prefetch on and off (two more runs)."),
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
) -> None:
    """LIVE: agent sessions with tool pauses on a cluster whose caches are under pressure,
    session retention off (today's behaviour) and on, in the same run. Reports the hit ratio
    against the workload's infinite-cache ceiling, TTFT mean/p90 of the steps after a pause,
    recomputed tokens, leased bytes and lease evictions. Exit code 1 unless retention reaches
    0.95 of the ceiling and at most 0.5x the post-pause TTFT p90 of retention off."""
    from bench.sessions import main as run_sessions

    overrides = {"engine.model": model, "gateway.port": 0, "http.enabled": False,
                 "name": "sessions", "prefill.num_instances": 1, "decode.num_instances": 1,
                 **parse_overrides(set_)}
    _live("sessions", None, overrides, lambda cfg, progress: run_sessions(
        cfg, json_path, progress, sessions=sessions, steps=steps, trunk_tokens=trunk_tokens,
        think_s=think, max_tokens=max_tokens, noise_clients=noise_clients,
        noise_tokens=noise_tokens, noise_rate=noise_rate, device_blocks=device_blocks, host_factor=host_factor,
        order=order, repeats=repeats, seed=seed, prefetch=prefetch), json_path)


@bench_app.command("fuzz", short_help="Fuzz both fronts with mutated requests: defined statuses, nothing leaked.")
def bench_fuzz(
    requests: int = typer.Option(1_000, help="Fuzz cases to send."),
    seed: Optional[int] = typer.Option(None, help="Seed of the cases (unset: a fresh one, "
                                       "printed)."),
    concurrency: int = typer.Option(12, help="Cases in flight at once."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Cluster config YAML."),
    model: str = typer.Option("tiny", help="'tiny' (fast) or 'smollm2'."),
    ttft_slo_ms: float = typer.Option(2_000.0, help="Admission's TTFT SLO (ms; 0: none): with "
                                      "the placeholder cost model it refuses the longest prompts."),
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
) -> None:
    """Structure-aware fuzz of both fronts through a local cluster's router: valid gRPC, OpenAI
    and Anthropic requests with 1 to 3 seeded mutations each, every answer counted by the stage
    that ended it (parse, validation, admission, engine, served, other), then a normal request
    per front and the leak check. Exit code 1 when an answer is 'other', fewer than half get past
    validation, the conductor's books disagree with the counts, a normal request fails or
    something leaked."""
    from bench.chaos import fresh_seed
    from bench.fuzz import main as run_fuzz

    overrides = {"engine.model": model, "gateway.port": 0, "http.port": 0, "name": "fuzz",
                 **parse_overrides(set_)}
    if ttft_slo_ms > 0:
        overrides.setdefault("conductor.tuning.ttft_slo_ms", ttft_slo_ms)
    if seed is None:
        seed = fresh_seed()
    err.print(f"[cyan]fuzz[/cyan] seed {seed} (replay with --seed {seed})")
    _live("fuzz", config, overrides, lambda cfg, progress: run_fuzz(
        cfg, requests, seed, concurrency, json_path, progress))


@bench_app.command("soak", short_help="LIVE soak: agent sessions for minutes; pins, leases, RSS and fds over time.")
def bench_soak(
    duration: float = typer.Option(1200.0, help="Seconds of traffic (the issue's bound: 20 min)."),
    json_path: Optional[Path] = typer.Option(Path("bench-out/soak.json"), "--json",
                                             help="Write the report here."),
    model: str = typer.Option("tiny", help="'tiny' (fast) or 'smollm2'."),
    sessions: int = typer.Option(8, help="Concurrent agent sessions."),
    sample_every: float = typer.Option(30.0, help="Seconds between samples."),
    seed: int = typer.Option(0, help="Seed of the prompts, think times, cancels and drops."),
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
) -> None:
    """LIVE soak: agent sessions with growing histories, long-tailed think times, cancels and
    HTTP disconnects; RSS and open fds of every cluster process (RSS also per role and kind:
    heap, mapped files, shared memory), store blocks, Redis keys and the index sampled over time,
    each series' growth per hour over the second half. Exit code 1 when
    a step fails or something is left pinned or booked after the load."""
    from bench.soak import main as run_soak

    overrides = {"engine.model": model, "gateway.port": 0, "http.port": 0, "name": "soak",
                 **parse_overrides(set_)}
    _live("soak", None, overrides, lambda cfg, progress: run_soak(
        cfg, duration, sessions, sample_every, json_path, seed, progress), json_path)


@bench_app.command("peers", short_help="LIVE: SMG + vLLM against Baton on agent workloads, on the same cores.")
def bench_peers(
    out_dir: Path = typer.Option(Path("bench-out/peers"), "--out", help="Folder for peers.json, "
                                 "peers.md, peers.png and records.jsonl."),
    runs: int = typer.Option(3, help="Runs of every stack, interleaved (1: a quick look)."),
    stacks: str = typer.Option("smg-cache_aware,smg-round_robin,baton-1p1d,baton-0p2d",
                               help="Comma-separated stacks, in run 1's order."),
    workloads: str = typer.Option("private_prefix,agent_fleet", help="Comma-separated workloads: "
                                  "private_prefix, agent_fleet, mooncake_slice (a slice of the "
                                  "Mooncake trace; ~40 s per stack and run, not in the default)."),
    agents: int = typer.Option(4, help="Agents per workload."),
    steps: int = typer.Option(4, help="Steps per agent."),
    prefix_words: int = typer.Option(1_500, help="private_prefix: words (~tokens) of each "
                                     "agent's private prefix."),
    step_words: int = typer.Option(100, help="private_prefix: words each step appends."),
    system_words: int = typer.Option(600, help="agent_fleet: prose words of the shared system "
                                     "prompt (the tool definitions come on top)."),
    fanout_width: int = typer.Option(3, help="agent_fleet: parallel sub-requests of the fan-out "
                                     "step (step 3)."),
    trace: Optional[Path] = typer.Option(None, help="mooncake_slice: a Mooncake-format trace "
                                         "(.jsonl); default: the repository's copy of the shared "
                                         "synthetic trace, tests/data/mooncake_synthetic_trace.jsonl."),
    trace_start: int = typer.Option(0, help="mooncake_slice: index of the slice's first request. "
                                    "The synthetic trace reuses blocks from far back: 58% of its "
                                    "32-request slices, the first one too, share no block within "
                                    "themselves (ceiling 0); 3944 starts one with ceiling ~0.5."),
    trace_requests: int = typer.Option(16, help="mooncake_slice: consecutive requests (the "
                                       "default slice: ~2,800 prompt tokens mean, 7,050 max)."),
    trace_block_words: int = typer.Option(64, help="mooncake_slice: words (~tokens) per 512-token "
                                          "trace block (8x shorter, to fit SmolLM2's window)."),
    trace_time_scale: float = typer.Option(12.0, help="mooncake_slice: arrival times are the "
                                           "trace's times this (x12: 16 requests over 41 s)."),
    max_tokens: int = typer.Option(32, help="Tokens each request generates (ignore_eos)."),
    model: str = typer.Option("smollm2", help="'smollm2' or 'tiny' (a smoke test)."),
    seed: int = typer.Option(0, help="Seed of every prompt and think time."),
    seed_per_run: bool = typer.Option(False, "--seed-per-run", help="Run k draws its workloads "
                                      "from seed + k (every stack of a run the same draw): "
                                      "medians over draws, where one seed's think times decide "
                                      "how many agents' steps arrive together."),
    vllm_omp_bind: str = typer.Option("auto", help="SMG's vLLM servers' OpenMP binding: 'auto' "
                                      "(one core each, as Baton binds its engines) or one value "
                                      "for all, e.g. 'nobind'."),
    tune: bool = typer.Option(True, "--tune/--no-tune", help="Before the race, run each SMG "
                              "stack once per setting on a tuning set (the same workloads, seed "
                              "+ 1000): cache_aware's balance thresholds (the guide's, or early "
                              "balance) x vLLM's --max-num-batched-tokens (2048, 512); each "
                              "races with its least TTFT mean. ~3 min per setting and workload."),
    tuned_from: Optional[Path] = typer.Option(None, "--tuned-from", metavar="<peers.json>",
                                               help="Skip tuning: each SMG stack races with the "
                                               "setting an earlier run's tuning chose (that "
                                               "run's peers.json; the report says so)."),
) -> None:
    """LIVE, several minutes of both cores: SMG (cache_aware, round_robin) over two co-located
    vLLM servers against `baton serve --prefill 1 --decode 1` and `--prefill 0 --decode 2`,
    each started fresh per run on the same cores, model and engine arguments, on the same seeded
    agent workloads. Reports `vllm bench serve` metrics, hit ratio against the workload's
    ceiling and fan-out TTFT, medians over runs, and Baton's ratios against the better SMG."""
    from bench.peers import PeersOptions, run_peers
    from bench.peers_workloads import (
        DEFAULT_TRACE,
        AgentFleetOptions,
        PrivatePrefixOptions,
        TraceSliceOptions,
    )
    from protos.errors import BatonError

    options = PeersOptions(
        runs=runs, stacks=tuple(stacks.split(",")), workloads=tuple(workloads.split(",")),
        private=PrivatePrefixOptions(num_agents=agents, num_steps=steps, prefix_words=prefix_words,
                                     step_words=step_words, max_tokens=max_tokens, seed=seed),
        fleet=AgentFleetOptions(num_agents=agents, num_steps=steps, system_words=system_words,
                                fanout_width=fanout_width, max_tokens=max_tokens, seed=seed),
        trace=TraceSliceOptions(trace_path=str(trace or DEFAULT_TRACE), start=trace_start,
                                num_requests=trace_requests,
                                block_words=trace_block_words, time_scale=trace_time_scale,
                                max_tokens=max_tokens, seed=seed),
        model=model, vllm_omp_bind=vllm_omp_bind, tune=tune,
        tuned_from=str(tuned_from) if tuned_from else None, seed_per_run=seed_per_run)
    try:
        run_peers(options, out_dir, echo=lambda m: err.print(m, highlight=False))
    except BatonError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
