"""The ``baton`` verbs that operate a Baton deployed on a Ray cluster: ``up``, ``down``, ``status``,
``scale``, ``drain``, ``pin``, ``unpin`` and ``autoscale``.

Contract: ``cli.main`` registers these functions as typer commands. A verb reaches the cluster
through Ray (``--address``, ``--name``, ``--namespace``) or, where it takes ``--endpoint``,
through the gateway's Admin service. Operator errors exit with a code per kind:
``EXIT_CONFIG`` (fix the config, the options or the key), ``EXIT_NO_CLUSTER``,
``EXIT_UNKNOWN_INSTANCE``, ``EXIT_FAILED``.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Column, Table

from cli.common import err, parse_overrides
from protos.wire import FrontAddresses

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
    from gateway.sessions import UnknownSession
    from protos.errors import ConfigError, InvalidRequest, UnknownInstance

    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    code = EXIT_FAILED
    if isinstance(exc, (ConfigError, NotAuthorized)):  # fix the config, the options or the key
        code = EXIT_CONFIG
    elif isinstance(exc, (NoRayCluster, NotUp)):
        code = EXIT_NO_CLUSTER
    elif isinstance(exc, (UnknownInstance, UnknownSession, InvalidRequest)):  # not there
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
        cfg = load_config(config, parse_overrides(set_))
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
    for line in front_lines(a):
        print(line)
    warning = loopback_warning(a)
    if warning:
        err.print(f"[yellow]warning: {warning}[/yellow]")
    if not ok:
        raise typer.Exit(EXIT_FAILED)


def front_lines(a: FrontAddresses) -> list[str]:
    """Where clients connect: each front at the address it listens on (the node's own address
    when it listens on every interface)."""
    lines = []
    if a.grpc_port is not None:
        lines.append(f"gRPC  {a.reachable(a.grpc_host)}:{a.grpc_port}")
    if a.http_port is not None:
        base = f"{'https' if a.http_tls else 'http'}://{a.reachable(a.http_host)}:{a.http_port}"
        lines.append(f"HTTP  {base}/v1   metrics: {base}/metrics")
    return lines


def loopback_warning(a: FrontAddresses) -> str | None:
    """What an operator of a cluster deployment must hear when a front serves loopback only."""
    only = a.loopback_only()
    if not only:
        return None
    return (f"{' and '.join(only)} listen{'s' if len(only) == 1 else ''} on loopback only: "
            "clients on other machines cannot connect. To serve them, set gateway.host and "
            "http.host to 0.0.0.0 (or this node's address) and turn on TLS and API keys "
            "(docs/operating.md, 'Exposing the fronts').")


def down(address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE) -> None:
    """Remove everything `baton up` started for this cluster (fronts first, then workers,
    stores, conductor, Redis). Nothing up: nothing to do (exit 0)."""
    from cluster.deployment import down as run_down

    _connected(address, namespace)
    removed = run_down(name, namespace, lambda msg: err.print(f"[cyan]baton[/cyan] {msg}"))
    print(f"removed {len(removed)} actors" if removed else f"Baton '{name}' was not up; nothing to remove")


def _fmt_ms(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


INSTANCE_COLUMNS = ("instance", "pool", "node", "state", "waiting", "running", "booked",
                    "KV used", "prefix hits", "TTFT ms", "ITL ms")
INSTANCE_DROPPED_FIRST = ("booked", "node", "ITL ms", "prefix hits", "TTFT ms", "waiting")
STORE_COLUMNS = ("store node", "host blocks used", "pinned", "disk blocks", "evicted", "pulled",
                 "pull failures")
STORE_DROPPED_FIRST = ("pull failures", "evicted", "pulled", "disk blocks")


def fitted_table(out: Console, columns: tuple[str, ...], rows: list[tuple[str, ...]],
                 dropped_first: tuple[str, ...], wide: bool) -> tuple[Table, int]:
    """The table with as many columns as fit ``out``'s width (all of them when ``wide``),
    dropping the least needed first, and how many were dropped. Values fold, never truncate."""
    shown = list(columns)
    droppable = [] if wide else list(dropped_first)
    while True:
        table = Table(*(Column(name, overflow="fold") for name in shown))
        for row in rows:
            table.add_row(*(value for name, value in zip(columns, row) if name in shown))
        natural = out.measure(table, options=out.options.update(max_width=10_000)).maximum
        if not droppable or natural <= out.width:
            return table, len(columns) - len(shown)
        shown.remove(droppable.pop(0))


def status(
    address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE,
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of tables."),
    endpoint: Optional[str] = _ENDPOINT, admin_key_file: Optional[Path] = _ADMIN_KEY_FILE,
    tls_ca: Optional[Path] = _ADMIN_TLS_CA,
    wide: bool = typer.Option(False, "--wide", help="Every column, however wide the terminal "
                              "(by default the least needed columns give way to fit it)."),
) -> None:
    """Pools and instances (node, state, queue depth, running sequences, KV use, prefix hits,
    recent TTFT/ITL), KV store nodes, and the conductor's placement counters."""
    import msgspec

    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        view = operator.status()
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    pools, addresses = view.pools, view.fronts
    if as_json:
        print(msgspec.json.encode({"status": pools, "fronts": addresses}).decode())
        return
    out = Console(width=max(Console().width, 200)) if wide else Console()
    sizes = ", ".join(
        f"{pool} {sum(p.values())} ({', '.join(f'{n} {k}' for k, n in sorted(p.items())) or 'none'})"
        for pool, p in pools.pool_sizes.items())
    out.print(f"[bold]Baton '{view.cluster_name}'[/bold]  policy {pools.policy}  pools: {sizes}")
    if addresses is not None:
        for line in front_lines(addresses):
            out.print(line, highlight=False)
    rows = [(r.instance_id, r.role, r.node_id or "-", r.phase, str(r.num_waiting_reqs),
             str(r.num_running_reqs), str(r.num_booked_reqs), f"{r.kv_usage_frac:.0%}",
             (f"{r.num_cached_tokens / r.num_prompt_tokens:.0%} of {r.num_prompt_tokens:,}"
              if r.num_prompt_tokens else "-"),
             _fmt_ms(r.recent_ttft_ms), _fmt_ms(r.recent_itl_ms)) for r in pools.instances]
    table, hidden = fitted_table(out, INSTANCE_COLUMNS, rows, INSTANCE_DROPPED_FIRST, wide)
    out.print(table)
    if pools.stores:
        rows = [(s.node_id, f"{s.host_used_blocks}/{s.host_capacity_blocks}",
                 str(s.host_pinned_blocks), str(s.disk_used_blocks), str(s.evicted_blocks),
                 str(s.counters.pulled_blocks), str(s.counters.pull_failures))
                for s in pools.stores]
        stores, hidden_stores = fitted_table(out, STORE_COLUMNS, rows, STORE_DROPPED_FIRST, wide)
        hidden += hidden_stores
        out.print(stores)
    if hidden:
        out.print(f"[dim]{hidden} columns hidden to fit {out.width} columns; --wide shows them[/dim]")
    c = pools.counters
    out.print(f"placements: {c.placed} placed, {c.rejected} rejected early, {c.coalesced} coalesced "
              f"({c.queued_behind} queued at once behind the prefill, "
              f"{c.coalesce_declined} declined as slower, {c.pooled} of {c.pool_waits} then "
              f"loadable from the store), "
              f"{c.colocated} colocated, {c.pulled} pulled, {c.index_corrections} index corrections")
    if pools.cost_model is not None:
        out.print(cost_model_line(pools.cost_model), highlight=False)
    for line in autoscale_lines(pools.autoscale):
        out.print(line, highlight=False)
    for line in pools.recent_events[-5:]:
        out.print(f"[dim]{line}[/dim]")


def cost_model_line(cost_model) -> str:
    """The cost model for ``baton status``: calibrating or fixed, and its error on requests it
    was not fitted on."""
    def error(name: str, e) -> str:
        if e is None:
            return f"{name} not measured yet"
        return (f"{name} error median {e.median_pct:.1f}%, p90 {e.p90_pct:.1f}% "
                f"(last {e.num_predictions} held out)")

    if not cost_model.calibrating:
        return "cost model: fixed (conductor.calibrate_cost_model false); error not measured"
    source = f" (prefill model: {cost_model.prefill_source})" if cost_model.prefill_source else ""
    line = (f"cost model: calibrating from measured timings{source}; "
            f"{error('prefill', cost_model.prefill)}; {error('decode', cost_model.decode)}")
    if cost_model.decode_per_request is not None:
        line += f"; {error('decode per request', cost_model.decode_per_request)}"
    if cost_model.mixed_step is not None:
        line += f"; {error('decode beside prompt chunks, per step', cost_model.mixed_step)}"
    if cost_model.decode_per_request_all_steps is not None:
        line += (f"; {error('decode per request, all steps', cost_model.decode_per_request_all_steps)}")
    if cost_model.handoff is not None or cost_model.handoff_overhead_ms:
        line += (f"; KV hand-off overhead {cost_model.handoff_overhead_ms:.1f} ms, "
                 f"{error('hand-off', cost_model.handoff)}")
    return line


def autoscale_lines(autoscale) -> list[str]:
    """The planner's state for ``baton status``: on or off, each pool's last decision and why,
    the last changes it made."""
    import time

    if autoscale is None:
        return []
    state = "on" if autoscale.enabled else "off (decides, does not apply)"
    lines = [f"autoscale: {state}"]
    for d in autoscale.last:
        lines.append(f"  {d.pool}: {d.action} {d.size_before} -> {d.size_after}: {d.reason}")
    for d in autoscale.changes[-3:]:
        at = time.strftime("%H:%M:%S", time.localtime(d.at_s)) if d.at_s else "-"
        outcome = f" ({d.outcome})" if d.outcome and d.outcome != "done" else ""
        lines.append(f"  changed {at} {d.pool} {d.size_before} -> {d.size_after}{outcome}: "
                     f"{d.reason}")
    return lines


def autoscale(
    state: str = typer.Argument(..., metavar="on|off", help="on: apply the planner's decisions; "
                                "off: only make and show them (pools keep their size)."),
    address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE,
    endpoint: Optional[str] = _ENDPOINT, admin_key_file: Optional[Path] = _ADMIN_KEY_FILE,
    tls_ca: Optional[Path] = _ADMIN_TLS_CA,
) -> None:
    """Turn the autoscaling planner's loop on or off, live (config `autoscale`). Off is the
    incident switch: no pool changes by itself until it is on again; `baton scale` still works.
    Changes already under way (a worker starting, a drain) finish."""
    if state not in ("on", "off"):
        err.print(f"[red]error:[/red] '{state}': give on or off")
        raise typer.Exit(EXIT_CONFIG)
    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        result = operator.set_autoscale(state == "on")
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    for line in autoscale_lines(result):
        print(line)


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
    from protos.wire import PoolSizes

    sizes = PoolSizes(prefill=prefill, decode=decode)
    if not sizes.requested():
        err.print("[red]error:[/red] give --prefill N and/or --decode M")
        raise typer.Exit(EXIT_CONFIG)
    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        results = operator.scale(sizes, timeout)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    if not _print_scale(results):
        raise typer.Exit(EXIT_FAILED)


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


def close_session(
    session_id: str = typer.Argument(..., metavar="SESSION_ID", help="The id the agent's "
                                     "requests named (X-Session-Id / session_id)."),
    tenant: str = typer.Option("", help="The cache_salt (tenant) its requests carried."),
    api_key: str = typer.Option("", envvar="BATON_SESSION_API_KEY", show_default=False,
                                help="The API key its requests were sent with (a session is "
                                "scoped to it; '' when the fronts run without keys; or "
                                "$BATON_SESSION_API_KEY)."),
    address: Optional[str] = _ADDRESS, name: str = _NAME, namespace: str = _NAMESPACE,
    endpoint: Optional[str] = _ENDPOINT, admin_key_file: Optional[Path] = _ADMIN_KEY_FILE,
    tls_ca: Optional[Path] = _ADMIN_TLS_CA,
) -> None:
    """End an agent session now: its KV leases are released on every store node and its blocks
    age out like any others. Exit code 3 when no such session is live."""
    operator = _operator(address, name, namespace, endpoint, admin_key_file, tls_ca)
    try:
        ended = operator.close_session(session_id, tenant, api_key)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    print(f"closed session '{session_id}' after {ended.num_steps} steps; "
          f"{ended.released_blocks} leased blocks released")
