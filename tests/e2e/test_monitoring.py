"""The chart's alerts and Grafana dashboard against a real Prometheus (Debian's `prometheus`
package) scraping a release's pods on the local cluster: it returns series for every dashboard
query and every metric the alerts select. What they render, and `promtool` on them, is
tests/unit/chart/test_monitoring.py's."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from lora_demo import manifests, release
from lora_demo.manifests import RELEASE, AdapterSource
from lora_devcluster.harness import Harness

from tests.support.chart import FULLNAME, Obj, unavailable
from tests.support.http import free_port
from tests.support.monitoring import METRIC, alert_rules, dashboard, dashboard_queries
from tests.support.phases import Phase

# The release the cluster test installs (the demo's): its fullname is the release name.
OP_LIVE, INF_LIVE, RT_LIVE = (f"{RELEASE}-{c}" for c in ("operator", "inference", "router"))


def _live(text: str) -> str:
    """A query rendered for release `demo`, for the cluster test's release."""
    return text.replace(FULLNAME, RELEASE)


def _prometheus_config(targets: dict[str, list[str]]) -> Obj:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics", "static_configs": [{"targets": t}]}
            for job, t in targets.items()
        ],
    }


def _query(port: int, expr: str) -> list[Obj]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    result: list[Obj] = body["data"]["result"]
    return result


def test_a_real_prometheus_returns_series_for_every_dashboard_and_alert_query(
    devcluster: Harness,
    devcluster_namespace: str,
    helm: str,
    tmp_path: Path,
    phase: Phase,
) -> None:
    h, ns = devcluster, devcluster_namespace
    prometheus = shutil.which("prometheus")
    if not prometheus:
        unavailable("no prometheus: run `make install` (Debian's prometheus package)")
    sources = (AdapterSource("a", seed=1, folder=f"{ns}/sources"),)
    try:
        phase("install the chart, an adapter Ready, generation through the Service")
        release.prepare_model(h, ns)
        release.install_crd(h)
        release.install_chart(h, ns, manifests.local_values(ns, replicas=1), tmp_path)
        release.prepare_adapters(h, ns, sources, "prepare-sources")
        release.ready_inference_pods(h, ns, 1)
        h.apply({**manifests.adapter(sources[0]), "metadata": {"name": "pixel-art"}}, ns)
        release.wait_adapter_ready(h, ns, "pixel-art", "1/1")
        for model in ("pixel-art", manifests.MODEL_NAME, "pixel-art"):
            release.generate(h, ns, release.service_target(), model)

        phase("Prometheus scrapes the operator, the inference pod and the routers")
        jobs = {"operator": OP_LIVE, "inference": INF_LIVE, "router": RT_LIVE}
        ports = {"operator": 9090, "inference": 8000, "router": 9090}

        def ready(component: str) -> bool:
            pods = h.pods(ns, f"app.kubernetes.io/component={component}")
            return any(release.is_ready(p) for p in pods)

        # An adapter can be Ready before the operator's own readiness probe has passed.
        for component in jobs:
            h.wait_for(f"a ready {component} pod", functools.partial(ready, component), timeout=60)
        targets = {
            jobs[c]: [
                f"{p['status']['podIP']}:{ports[c]}"
                for p in h.pods(ns, f"app.kubernetes.io/component={c}")
                if release.is_ready(p)
            ]
            for c in jobs
        }
        assert all(targets.values()), targets
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(_prometheus_config(targets)))
        port = free_port()
        log = (tmp_path / "prometheus.log").open("w")
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=log,
        )
        try:
            h.wait_for(
                "every target scraped twice",
                lambda: (
                    len(_query(port, "count_over_time(up[1m]) >= 2"))
                    == len([t for ts in targets.values() for t in ts])
                    or None
                ),
                timeout=90,
                interval=1,
            )
            assert len(_query(port, "up == 1")) == sum(map(len, targets.values()))

            phase("every dashboard query and every metric the alerts select returns series")
            empty = [
                title
                for title, query in dashboard_queries(dashboard(helm))
                if not _query(port, _live(query))
            ]
            assert empty == [], f"dashboard panels without series: {empty}"
            missing = []
            for r in alert_rules(helm):
                for metric in METRIC.findall(r["expr"]):
                    job = re.search(rf'{re.escape(metric)}\{{job="([^"]+)"', r["expr"])
                    assert job, (r["alert"], metric)
                    live_job = _live(job.group(1))
                    if not _query(port, f'{metric}{{job="{live_job}"}}'):
                        missing.append(f"{r['alert']}: {metric}{{job={live_job}}}")
            assert missing == [], missing
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    finally:
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)
