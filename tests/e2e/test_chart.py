"""The Helm chart (charts/lora-operator) on a real API server: every object it renders for the CI
scenarios, the watched namespaces and the examples passes a server-side dry run, and an install
prints its notes. What it renders is tested without a cluster in tests/unit/chart/."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lora_devcluster.harness import Harness

from tests.support.chart import (
    CHART,
    CI_VALUES,
    EXAMPLE_ADAPTERS,
    EXAMPLE_VALUES,
    FULLNAME,
    REGISTRY_FLAGS,
    RELEASE,
    container,
    of_component,
    server_dry_run,
    template_text,
)


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_ci_scenarios_pass_server_side_dry_run(
    crds: Harness, devcluster_namespace: str, helm: str, values: Path
) -> None:
    ns = devcluster_namespace
    rendered = template_text(helm, "-f", str(values), namespace=ns)
    out = server_dry_run(crds, ns, rendered)
    expected = len([d for d in yaml.safe_load_all(rendered) if d])
    assert out.count("(server dry run)") == expected, out


def test_watched_namespaces_pass_server_side_dry_run(
    crds: Harness, devcluster_namespace: str, helm: str
) -> None:
    ns = devcluster_namespace
    rendered = template_text(
        helm,
        "--set",
        f"operator.watchNamespaces={{{ns}}}",
        "--set",
        "operator.replicas=2",
        namespace=ns,
    )
    out = server_dry_run(crds, ns, rendered)
    assert f"kopfpeering.kopf.dev/{FULLNAME} created (server dry run)" in out
    assert f"role.rbac.authorization.k8s.io/{FULLNAME}-operator created (server dry run)" in out


def test_notes_show_the_next_commands(devcluster: Harness, devcluster_namespace: str) -> None:
    # NOTES.txt renders only on install; a client-side dry run still asks the cluster's version.
    # The session's CRD was applied by kubectl, not helm: helm would refuse to adopt it.
    ns = devcluster_namespace
    argv = ["helm", "install", RELEASE, str(CHART), "-n", ns, "--dry-run=client"]
    out = devcluster.run([*argv, "--set", "crds.enabled=false", *REGISTRY_FLAGS])
    notes = out.split("NOTES:", 1)[1]
    assert f"kubectl -n {ns} apply -f -" in notes
    assert f"kubectl -n {ns} get lora" in notes
    assert '"model": "pixel-art"' in notes and "/v1/images/generations" in notes
    assert f"helm test {RELEASE} -n {ns}" in notes


@pytest.mark.parametrize("path", EXAMPLE_ADAPTERS, ids=lambda p: p.name)
def test_example_adapters_pass_server_side_validation(
    crds: Harness, devcluster_namespace: str, path: Path
) -> None:
    out = server_dry_run(crds, devcluster_namespace, path.read_text())
    assert "loraadapter.lora.dev/" in out and "created (server dry run)" in out


@pytest.mark.parametrize("path", EXAMPLE_VALUES, ids=lambda p: p.name)
def test_example_values_pass_server_side_dry_run(
    crds: Harness, devcluster_namespace: str, helm: str, path: Path
) -> None:
    ns = devcluster_namespace
    rendered = template_text(helm, "-f", str(path), namespace=ns)
    server_dry_run(crds, ns, rendered)
    # Every model's Deployment (one, or one per inference.models entry) asks for its GPU.
    inference = of_component(
        [d for d in yaml.safe_load_all(rendered) if d], "Deployment", "inference"
    )
    assert inference, "no inference Deployment"
    for deployment in inference:
        assert container(deployment)["resources"]["limits"]["nvidia.com/gpu"] == 1
