"""The chart's monitoring as the tests read it: the flags that turn on the monitors, the alerts and
the dashboard; the rendered alert rules and dashboard; the dashboard's queries as Prometheus
receives them. Shared by the rendering tests (tests/unit/chart) and the real Prometheus on the
local cluster (tests/e2e/test_monitoring.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tests.support.chart import Obj, of_kind, render

MONITORING = ["--set", "metrics.serviceMonitor.enabled=true"]
RULES = [*MONITORING, "--set", "metrics.prometheusRule.enabled=true"]
DASHBOARD = ["--set", "metrics.grafanaDashboard.enabled=true"]
# Grafana's own variable; Prometheus is given what Grafana would put there.
RATE_INTERVAL = "1m"
METRIC = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")


def alert_rules(helm: str) -> list[Obj]:
    [rule] = of_kind(render(helm, *RULES), "PrometheusRule")
    rules: list[Obj] = rule["spec"]["groups"][0]["rules"]
    return rules


def dashboard(helm: str, *flags: str) -> dict[str, Any]:
    [cm] = of_kind(render(helm, *MONITORING, *DASHBOARD, *flags), "ConfigMap")
    board: dict[str, Any] = json.loads(cm["data"]["lora-operator.json"])
    return board


def dashboard_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the dashboard, as Prometheus receives it."""
    return [
        (p["title"], t["expr"].replace("$__rate_interval", RATE_INTERVAL))
        for p in board["panels"]
        for t in p.get("targets", [])
    ]
