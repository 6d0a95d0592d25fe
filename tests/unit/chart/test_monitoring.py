"""The chart's alerts and Grafana dashboard, rendered with no cluster and checked by Prometheus'
own `promtool` (Debian's `prometheus` package): every expression parses, each alert fires on the
series it is written for and stays quiet on a healthy fleet (`promtool test rules`), each links
to its runbook, and the dashboard names only metrics the code registers. A real Prometheus
scraping a release is tests/e2e/test_monitoring.py's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT
from tests.support.chart import FULLNAME, of_kind, registered_metrics, render, unavailable
from tests.support.monitoring import (
    DASHBOARD,
    METRIC,
    RULES,
    alert_rules,
    dashboard,
    dashboard_queries,
)

OP, INF, RT = (f"{FULLNAME}-{c}" for c in ("operator", "inference", "router"))


@pytest.fixture(scope="session")
def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        unavailable("no promtool: run `make install` (Debian's prometheus package)")
    return found


def _promtool(promtool: str, *args: str, cwd: Path) -> None:
    proc = subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- the dashboard ConfigMap


def test_the_dashboard_is_off_by_default(helm: str) -> None:
    assert of_kind(render(helm), "ConfigMap") == []


def test_the_dashboard_configmap_carries_the_sidecar_label_and_the_release_jobs(
    helm: str,
) -> None:
    docs = render(
        helm, *DASHBOARD, "--set", "metrics.grafanaDashboard.annotations.grafana_folder=LoRA"
    )
    [cm] = of_kind(docs, "ConfigMap")
    assert cm["metadata"]["name"] == f"{FULLNAME}-dashboard"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LoRA"}
    text = cm["data"]["lora-operator.json"]
    assert "LORA_" not in text, "every job placeholder is replaced"
    board = json.loads(text)
    assert board["uid"] == "lora-operator"
    jobs = {m for _, q in dashboard_queries(board) for m in re.findall(r'job=~?"([^"]+)"', q)}
    assert jobs == {OP, INF, RT, f"{OP}|{INF}|{RT}"}


def test_the_dashboard_covers_the_fleet_and_names_only_registered_metrics(
    helm: str,
) -> None:
    board = dashboard(helm)
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [
        "Fleet: generation",
        "Adapters: residency and misses",
        "Staging",
        "Operator: loads and reconciles",
    ]
    registered = registered_metrics()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for title, query in dashboard_queries(board):
        for metric in METRIC.findall(query):
            if metric == "up":
                continue
            assert any(
                metric == name + sfx for name, (t, _) in registered.items() for sfx in suffixes[t]
            ), f"{title}: {metric} is not registered in code"


# ---- promtool


def test_every_alert_and_dashboard_expression_parses(
    helm: str,
    promtool: str,
    tmp_path: Path,
) -> None:
    recorded = [
        {"record": f"dashboard:query_{i}", "expr": q}
        for i, (_, q) in enumerate(dashboard_queries(dashboard(helm)))
    ]
    groups = {
        "groups": [
            {"name": "alerts", "rules": alert_rules(helm)},
            {"name": "dashboard", "rules": recorded},
        ]
    }
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    _promtool(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)


def test_every_alert_links_to_its_runbook(helm: str) -> None:
    headings = set(re.findall(r"^## (\w+)$", (ROOT / "docs" / "runbooks.md").read_text(), re.M))
    for r in alert_rules(helm):
        assert r["annotations"]["runbook_url"] == f"docs/runbooks.md#{r['alert'].lower()}"
        assert r["alert"] in headings, f"docs/runbooks.md has no section for {r['alert']}"
    base = "https://docs.example.com/lora/runbooks.html"
    flags = ["--set", f"metrics.prometheusRule.runbookBaseUrl={base}"]
    [rule] = of_kind(render(helm, *RULES, *flags), "PrometheusRule")
    first = rule["spec"]["groups"][0]["rules"][0]
    assert first["annotations"]["runbook_url"] == f"{base}#{first['alert'].lower()}"


# Per alert: the series that make it fire, when it is evaluated, and the value its summary shows.
FIRING: dict[str, tuple[list[tuple[str, str]], str, str]] = {
    "LoRAOperatorDown": ([(f'up{{job="{OP}"}}', "0x20")], "6m", ""),
    "LoRAAdapterFailed": (
        [(f'lora_operator_adapters{{job="{OP}", phase="Failed"}}', "2x20")],
        "6m",
        "2",
    ),
    "LoRAAdapterDegraded": (
        [(f'lora_operator_adapters{{job="{OP}", phase="Degraded"}}', "1x30")],
        "16m",
        "1",
    ),
    "LoRAAdapterStuckStaging": (
        [(f'lora_operator_adapters{{job="{OP}", phase="Staging"}}', "1x40")],
        "31m",
        "",
    ),
    "LoRAPodLoadsFailing": (
        [
            (f'lora_operator_pod_loads_total{{job="{OP}", result="ok"}}', "0+1x40"),
            (f'lora_operator_pod_loads_total{{job="{OP}", result="transient"}}', "0+1x40"),
        ],
        "25m",
        "",
    ),
    "LoRAStagingsFailing": (
        [(f'lora_operator_stagings_total{{job="{OP}", result="transient"}}', "0+1x80")],
        "65m",
        "",
    ),
    "LoRAPodLoadSlow": (
        [
            (f'lora_operator_pod_load_seconds_bucket{{job="{OP}", le="10"}}', "0x40"),
            (f'lora_operator_pod_load_seconds_bucket{{job="{OP}", le="60"}}', "0+1x40"),
            (f'lora_operator_pod_load_seconds_bucket{{job="{OP}", le="+Inf"}}', "0+1x40"),
        ],
        "35m",
        "",
    ),
    "LoRAInferenceDown": ([(f'up{{job="{INF}"}}', "0x20")], "6m", ""),
    "LoRAInferenceQueueFull": (
        [(f'lora_generation_requests_total{{job="{INF}", outcome="rejected"}}', "0+5x30")],
        "20m",
        "",
    ),
    "LoRARouterDown": ([(f'up{{job="{RT}"}}', "0x20")], "6m", ""),
    "LoRARouterNoPods": (
        [(f'lora_router_requests_total{{job="{RT}", reason="none", code="503"}}', "0+1x30")],
        "20m",
        "",
    ),
}
# A healthy fleet: everything up, adapters Ready, loads and stagings succeed, quick loads.
HEALTHY = [
    (f'up{{job="{OP}"}}', "1x80"),
    (f'up{{job="{INF}"}}', "1x80"),
    (f'up{{job="{RT}"}}', "1x80"),
    (f'lora_operator_adapters{{job="{OP}", phase="Ready"}}', "3x80"),
    (f'lora_operator_adapters{{job="{OP}", phase="Failed"}}', "0x80"),
    (f'lora_operator_pod_loads_total{{job="{OP}", result="ok"}}', "0+1x80"),
    (f'lora_operator_stagings_total{{job="{OP}", result="ok"}}', "0+1x80"),
    (f'lora_operator_pod_load_seconds_bucket{{job="{OP}", le="1"}}', "0+1x80"),
    (f'lora_operator_pod_load_seconds_bucket{{job="{OP}", le="+Inf"}}', "0+1x80"),
    (f'lora_generation_requests_total{{job="{INF}", outcome="ok"}}', "0+9x80"),
    (f'lora_router_requests_total{{job="{RT}", reason="gpu-resident", code="200"}}', "0+9x80"),
]


def test_alerts_fire_on_their_series_and_not_on_a_healthy_fleet(
    helm: str,
    promtool: str,
    tmp_path: Path,
) -> None:
    rules = alert_rules(helm)
    assert {r["alert"] for r in rules} == set(FIRING)
    tests = []
    for r in rules:
        series, at, value = FIRING[r["alert"]]
        annotations = {k: v.replace("{{ $value }}", value) for k, v in r["annotations"].items()}
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": r["alert"],
                        "exp_alerts": [{"exp_labels": r["labels"], "exp_annotations": annotations}],
                    }
                ],
            }
        )
    tests.append(
        {
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in HEALTHY],
            "alert_rule_test": [
                {"eval_time": "70m", "alertname": r["alert"], "exp_alerts": []} for r in rules
            ],
        }
    )
    (tmp_path / "rules.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "alerts", "rules": rules}]})
    )
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    _promtool(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)


# ---- a real Prometheus scraping a release on the local cluster
