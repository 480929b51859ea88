"""What ``baton bench replay`` does once typer has parsed it: check the inputs, run with a
progress bar, write the results, print the table."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from protos.errors import BatonError
from simulator.fleet import GIB, FleetConfig
from simulator.live_error import LIVE_PREFILL_ERROR, DrawnError, read_measured_error
from simulator.profile import load_profile
from simulator.replay import estimated_sims, parse_policies, replay, write_results
from simulator.sim import Workload
from simulator.trace import load_trace


def drawn_error(prediction_error: float | None, live_error: Path | None) -> DrawnError:
    """What the error factors are drawn with: ``prediction_error`` as given, else fitted to the
    live measurement in ``live_error``, else to the recorded one."""
    if prediction_error is not None:
        if live_error is not None:
            raise BatonError("--prediction-error and --live-error both say which error to draw; give one")
        if not 0 <= prediction_error < 2:
            raise BatonError(f"--prediction-error must be in [0, 2), got {prediction_error:g}")
        return DrawnError.given(prediction_error)
    return DrawnError.fitted(read_measured_error(live_error) if live_error is not None else LIVE_PREFILL_ERROR)


def replay_command(trace: Path, num_prefill: int, num_decode: int, policy: str, out: Path,
                   rate_scale: float, profile_spec: str, ttft_slo_ms: float, tbt_slo_ms: float,
                   goodput: bool, jobs: int, instances_per_node: int, device_kv_gib: float | None,
                   host_gib_per_node: float | None, disk_gib_per_node: float | None,
                   admission: bool, console: Console, tune: bool = True, tune_fraction: float = 0.25,
                   prediction_error: float | None = None, error_seed: int = 0, coalesce: bool = True,
                   live_error: Path | None = None) -> None:
    """Raises ``typer.Exit(2)`` with a message for anything the user can fix. A
    ``prediction_error`` of None draws the error fitted to the live one: ``live_error``'s, else
    ``LIVE_PREFILL_ERROR``."""
    try:
        policies = parse_policies(policy)
        drawn = drawn_error(prediction_error, live_error)
        profile = load_profile(profile_spec)
        if rate_scale <= 0:
            raise BatonError(f"--rate-scale must be positive, got {rate_scale:g}")
        if not 0 < tune_fraction < 1:
            raise BatonError(f"--tune-fraction must be between 0 and 1, got {tune_fraction:g}")
        overrides: dict = {}
        if device_kv_gib is not None:
            overrides["device_kv_bytes"] = device_kv_gib * GIB
        if host_gib_per_node is not None:
            overrides["host_kv_bytes_per_node"] = host_gib_per_node * GIB
        if disk_gib_per_node is not None:
            overrides["disk_kv_bytes_per_node"] = disk_gib_per_node * GIB
        fleet = FleetConfig(num_prefill_instances=num_prefill, num_decode_instances=num_decode,
                            instances_per_node=instances_per_node, ttft_slo_ms=ttft_slo_ms,
                            tbt_slo_ms=tbt_slo_ms, admission=admission, prediction_error=drawn.mean_abs_error,
                            error_seed=error_seed, coalesce_policies=("baton",) if coalesce else (),
                            **overrides)
        workload = Workload(load_trace(trace), trace.name)
    except ValidationError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e
    except BatonError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e
    started = time.perf_counter()
    columns = (TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("simulations"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        tasks = {p: progress.add_task(p, total=estimated_sims(p, goodput, tune)) for p in policies}

        def on_sim(p: str) -> None:
            task = progress.tasks[tasks[p]]
            if task.completed + 1 > (task.total or 0):
                progress.update(tasks[p], total=task.completed + 1)
            progress.advance(tasks[p])

        outcome = replay(trace, fleet, profile, profile_spec, policies, rate_scale, goodput, jobs, on_sim,
                         tune, tune_fraction)
        runs = outcome.runs
        for p, task_id in tasks.items():
            progress.update(task_id, total=progress.tasks[task_id].completed)
    wall_s = time.perf_counter() - started
    meta = {
        "trace": str(trace), "trace_name": trace.name, "num_requests": len(workload),
        "ceiling_hit_ratio": outcome.oracle.hit_ratio, "rate_scale": rate_scale,
        "simulated": True, "profile_name": profile_spec, "profile": profile.model_dump(exclude={"samples"}),
        "fleet": fleet.model_dump(), "prediction_error": drawn.model_dump() | {"drawn_with": drawn.describe()},
        "policies": policies, "wall_s": wall_s, "jobs": jobs,
        "per_policy_wall_s": {p: run.wall_s for p, run in runs.items()},
        "per_policy_cpu_s": {p: run.cpu_s for p, run in runs.items()},
        "num_tune_requests": outcome.num_tune_requests, "num_race_requests": outcome.num_race_requests,
        "tuned_on": (f"the first {outcome.num_tune_requests} requests" if outcome.num_tune_requests
                     else "nothing (untuned defaults)"),
        "raced_on": (f"the last {outcome.num_race_requests} requests" if outcome.num_tune_requests
                     else "the whole trace"),
        "num_simulations": sum(task.completed for task in progress.tasks),
        "ttft_note": "TTFT percentiles cover every request; rejected and unservable ones count at the "
                     "TTFT SLO bound and as misses in every SLO figure",
    }
    written = write_results(out, outcome, meta)
    print((out / "results.md").read_text())
    cpu_s = sum(run.cpu_s for run in runs.values())  # the race's; tuning ran before it
    console.print(f"[dim]{len(policies)} policies, {meta['num_simulations']} simulations in {wall_s:.1f} s "
                  f"(race {cpu_s:.1f} CPU-s); wrote "
                  f"{', '.join(str(p) for p in written)}[/dim]")
