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

for verb in (
    serving.serve, serving.generate, serving.chaos, serving.profile,
    operate.up, operate.down, operate.status, operate.scale, operate.drain, operate.pin,
    operate.unpin, operate.autoscale, operate.close_session,
):
    app.command()(verb)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
