"""What the deploy files promise, read from the files themselves (shared by unit and integration
tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "baton-dashboard.json"


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def dashboard_metric_names() -> set[str]:
    """Every ``baton_*`` series name the dashboard's queries use."""
    return {name for expr in dashboard_exprs() for name in re.findall(r"\bbaton_[a-z0-9_]+\b", expr)}
