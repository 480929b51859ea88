"""``baton bench replay-breakdown``: where each policy's TTFT goes beyond the oracle's, for a
replay already written: its policies re-simulated on the same race slice, fleet, profile and
errors with the knobs they were tuned to (``simulator.breakdown``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer
from rich.console import Console

from protos.errors import BatonError
from simulator.breakdown import COMPONENTS, mean_parts, ttft_over_oracle
from simulator.fleet import FleetConfig
from simulator.oracle import oracle_ttft_ms
from simulator.profile import load_profile
from simulator.replay import parse_policies, with_knobs
from simulator.sim import Simulation, Workload
from simulator.trace import load_trace
from simulator.tuning import split_trace


def breakdown_table(out_dir: Path, policies: list[str], rate_scale: float | None) -> str:
    """The markdown table: per part (``COMPONENTS``) the mean ms per request over the oracle,
    split where the request prefilled (on its decode instance or not), per policy."""
    try:
        meta = json.loads((out_dir / "run.json").read_text())
        results = json.loads((out_dir / "results.json").read_text())
    except (OSError, ValueError) as e:
        raise BatonError(f"{out_dir} holds no readable replay (run.json, results.json): {e}") from e
    missing = [p for p in policies if p not in results]
    if missing:
        raise BatonError(f"{out_dir} has no results for {', '.join(missing)}; it has "
                         f"{', '.join(k for k in results if k != 'oracle')}")
    requests = load_trace(Path(meta["trace"]))
    num_tune = meta["num_tune_requests"]
    race = split_trace(requests, num_tune / len(requests))[1] if num_tune else requests
    workload = Workload(race, f"{meta['trace_name']}[race]")
    fleet = FleetConfig(**meta["fleet"])
    profile = load_profile(meta["profile_name"])
    scale = meta["rate_scale"] if rate_scale is None else rate_scale
    oracle_raw_ms, _ = oracle_ttft_ms(workload, fleet, profile)
    columns, notes = {}, []
    for policy in policies:
        sim = Simulation(workload, with_knobs(fleet, results[policy]["tuned"]), profile, policy, scale,
                         meta["profile_name"]).run()
        parts = ttft_over_oracle(sim)
        columns[policy] = (mean_parts(parts), mean_parts(parts, sim.colocated),
                           mean_parts(parts, sim.served & ~sim.colocated))
        ttft_ms = np.where(sim.served, sim.ttft_ms, fleet.ttft_slo_ms)
        missed = ~sim.served | (ttft_ms > fleet.ttft_slo_ms)
        notes.append(
            f"{policy}: TTFT mean {ttft_ms.mean():,.0f} ms; {int((~sim.served).sum())} rejected or unservable "
            f"({int((~sim.served & (oracle_raw_ms <= fleet.ttft_slo_ms)).sum())} within the oracle's reach); "
            f"{int((sim.served & missed).sum())} served over the TTFT SLO, "
            f"{int((sim.served & (sim.max_gap_ms > fleet.tbt_slo_ms)).sum())} over the TBT SLO; "
            f"{int(sim.colocated.sum())} prefilled "
            f"on their decode instance; {int(sim.coalesced.sum())} coalesced")
    oracle_mean_ms = float(np.minimum(oracle_raw_ms, fleet.ttft_slo_ms).mean())
    header = " | ".join(f"{p} (all / on decode / disaggregated)" for p in policies)
    lines = [f"SIMULATED, {out_dir} at x{scale:g}: mean ms per request over the oracle's "
             f"{oracle_mean_ms:,.0f} ms (parts of all requests; split by where each prefilled)", "",
             f"| part | {header} |", "| --- |" + " ---: |" * len(policies)]
    for name, label in COMPONENTS.items():
        cells = [" / ".join(f"{c[name]:,.0f}" for c in columns[p]) for p in policies]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    totals = [" / ".join(f"{sum(c.values()):,.0f}" for c in columns[p]) for p in policies]
    lines += ["| **total over the oracle** | " + " | ".join(totals) + " |", ""]
    return "\n".join(lines + [f"- {note}" for note in notes]) + "\n"


def breakdown_command(out_dir: Path, policy: str, rate_scale: float | None, console: Console) -> None:
    """Prints the table; raises ``typer.Exit(2)`` with a message for anything the user can fix."""
    try:
        table = breakdown_table(out_dir, parse_policies(policy), rate_scale)
    except BatonError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e
    print(table)
