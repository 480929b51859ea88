"""What the ``baton`` verbs share: the stderr console and ``--set KEY=VALUE`` parsing.

Contract: messages for people go to ``err`` (stderr), so stdout carries only a verb's result;
``parse_overrides`` turns ``--set`` items into ``load_config`` overrides, or exits with code 2
and says what to type.
"""

from __future__ import annotations

import typer
from rich.console import Console

err = Console(stderr=True)


def parse_overrides(items: list[str]) -> dict[str, object]:
    import yaml

    overrides: dict[str, object] = {}
    for item in items:
        if "=" not in item:
            err.print(f"[red]--set expects KEY=VALUE (e.g. prefill.num_instances=2), got '{item}'")
            raise typer.Exit(2)
        key, raw = item.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(raw)
    return overrides
