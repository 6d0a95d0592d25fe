"""The chart under a GitOps tool (Argo CD, Flux) or `helm template | kubectl apply`: applying the
rendered chart twice leaves the admin token as it was (docs/tasks/gitops.md). What it renders is
tests/unit/chart/test_gitops.py's."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml
from lora_demo import manifests
from lora_devcluster.harness import Harness

from tests.support.chart import CHART, FULLNAME, run_helm

JOB = f"{FULLNAME}-admin-token-create"
SECRET = f"{FULLNAME}-admin-token"


def test_template_applied_twice_keeps_the_token(
    crds: Harness,
    devcluster_namespace: str,
    helm: str,
    tmp_path: Path,
) -> None:
    h, ns = crds, devcluster_namespace
    values = {
        "crds": {"enabled": False},  # the session's CRD (the crds fixture)
        "adapterVolume": {"accessModes": ["ReadWriteOnce"]},
        "operator": {"watchNamespaces": [ns], "image": manifests.LOCAL_IMAGES["operator"]},
        "inference": {"enabled": False},
    }
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    proc = run_helm(helm, "template", "demo", str(CHART), "-n", ns, "-f", str(values_file))
    assert proc.returncode == 0, proc.stderr
    rendered = proc.stdout
    secret_path = f"/api/v1/namespaces/{ns}/secrets/{SECRET}"
    try:
        h.apply(rendered, ns)
        secret = h.wait_for(
            "the hook Job to create the token", lambda: h.get_or_none(secret_path), timeout=180
        )
        token = base64.b64decode(secret["data"]["token"])
        assert len(token) >= 32
        # The operator starts with it mounted.
        h.kubectl(
            "rollout", "status", "-n", ns, f"deploy/{FULLNAME}-operator", "--timeout=180s"
        )  # fmt: skip

        second = h.apply(rendered, ns)
        assert f"job.batch/{JOB} unchanged" in second, second
        again = h.get(secret_path)
        assert base64.b64decode(again["data"]["token"]) == token
        assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
        assert "app.kubernetes.io/instance" not in again["metadata"]["labels"]
        log = h.kubectl("logs", "-n", ns, f"job/{JOB}")
        assert "created with a new token" in log, log
    finally:
        # The cluster-scoped objects (the operator's ClusterRole and binding) go too.
        h.kubectl("delete", "-n", ns, "--ignore-not-found", "--wait=false", "-f", "-",
                  input=rendered, check=False)  # fmt: skip
