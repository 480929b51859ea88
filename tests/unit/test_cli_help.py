"""``baton --help`` and each group's ``--help`` list every verb with its one-line summary (the
verb's own ``--help`` keeps its whole docstring): without one, typer printed the docstring's
first paragraph with its source line breaks, a ragged block per verb."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from cli.bench_commands import bench_app
from cli.main import app
from cli.serving import model_app

GROUPS = [([], app), (["bench"], bench_app), (["model"], model_app)]


def _summaries(group: typer.Typer) -> dict[str, str]:
    """Each verb's name as the command line spells it, and its summary."""
    return {info.name or info.callback.__name__.replace("_", "-"): info.short_help
            for info in group.registered_commands}


@pytest.mark.parametrize(("argv", "group"), GROUPS, ids=["baton", "bench", "model"])
def test_every_verb_is_listed_with_its_one_line_summary(argv, group):
    summaries = _summaries(group)
    assert summaries and all(summaries.values()), summaries  # every verb has one
    for name, summary in summaries.items():
        assert "\n" not in summary and len(summary) <= 80, name
    result = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for name, summary in summaries.items():
        listed = [line for line in lines if line.strip("│ ").startswith(name + " ")]
        assert len(listed) == 1, (name, listed)
        assert listed[0].strip("│ ").split(None, 1)[1].strip() == summary, (name, listed[0])


def test_a_verbs_own_help_keeps_its_whole_description():
    result = CliRunner().invoke(app, ["bench", "kvstore", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "Each KV store data path (shared memory, tcp, ucx, disk tier) against a fair baseline" in result.output
