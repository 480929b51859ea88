"""The ``baton`` command line: the typer app, assembled from the rooms its verbs live in.

``cli.serving`` runs Baton on this machine or talks to it (serve, generate, chaos, profile,
``model prepare``), ``cli.operate`` operates a deployment on a Ray cluster (up, down, status,
scale, drain, pin, unpin), ``cli.bench_commands`` is the ``bench`` group. Contract: verbs are
registered here in the order ``baton --help`` lists them; ``main`` is the console script
(``baton = "cli.main:main"``) and ``python -m cli.main`` runs the same app.
"""

from __future__ import annotations

import typer

from cli import operate, serving
from cli.bench_commands import bench_app

app = typer.Typer(
    help="Baton: disaggregated prefill/decode LLM serving on Ray.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(serving.model_app, name="model")
app.add_typer(bench_app, name="bench")

# (verb, its line in ``baton --help``'s list; the verb's own --help has its whole docstring)
for verb, summary in (
    (serving.serve, "Run a local cluster and its gRPC and HTTP fronts in the foreground."),
    (serving.generate, "Send one request to a running gateway; stream the answer, then usage."),
    (serving.chaos, "Failure drill: workers and store nodes killed, Redis restarted, under load."),
    (serving.profile, "Measure prefill, decode and KV transfer times here; fit the cost model."),
    (operate.up, "Start Baton on an existing Ray cluster as detached named actors."),
    (operate.down, "Remove everything `baton up` started."),
    (operate.status, "Pools, instances, KV store nodes and the conductor's placement counters."),
    (operate.scale, "Resize the prefill and/or decode pool while serving."),
    (operate.drain, "Stop placing on one instance, let its requests finish, remove it."),
    (operate.pin, "Soft-pin a prompt prefix (a shared system prompt) on every KV store node."),
    (operate.unpin, "End a soft pin: its blocks age out like any others."),
    (operate.autoscale, "Turn the SLO autoscaling planner on or off, live."),
    (operate.close_session, "End an agent session now: its KV leases are released."),
):
    app.command(short_help=summary)(verb)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
