"""The metric names k8s/grafana-dashboard.json reads, for the tests that check they are exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana-dashboard.json"


def dashboard_metrics() -> set[str]:
    """Every series name the dashboard's queries read (a histogram by its base name)."""
    exprs = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]
    return {re.sub(r"_bucket$", "", name) for expr in exprs for name in re.findall(r"\bray_[a-z_]+", expr)}
