"""The chart under a GitOps tool (Argo CD, Flux) or `helm template | kubectl apply`, rendered with
no cluster: every render is the same, and the admin token is never rendered (a hook Job creates
its Secret once; docs/tasks/gitops.md). Applying it twice is tests/e2e/test_gitops.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.chart import (
    CHART,
    CI_VALUES,
    EXAMPLE_VALUES,
    FULLNAME,
    REGISTRY,
    REGISTRY_FLAGS,
    Obj,
    of_kind,
    one,
    render,
    run_helm,
)

JOB = f"{FULLNAME}-admin-token-create"
SECRET = f"{FULLNAME}-admin-token"
HOOK = {
    "helm.sh/hook": "pre-install,pre-upgrade",
    "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded",
}


def admin_token_objects(docs: list[Obj]) -> list[Obj]:
    return [
        d
        for d in docs
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "admin-token"
    ]


@pytest.mark.parametrize("values", [*CI_VALUES, *EXAMPLE_VALUES], ids=lambda p: p.name)
def test_every_render_is_the_same(helm: str, values: Path) -> None:
    renders = [
        run_helm(
            helm, "template", "demo", str(CHART), "-n", "lora", *REGISTRY_FLAGS, "-f", str(values)
        )
        for _ in range(2)
    ]
    assert renders[0].returncode == 0, renders[0].stderr
    assert renders[0].stdout == renders[1].stdout


def test_the_token_is_never_rendered_a_hook_job_creates_it(helm: str) -> None:
    docs = render(helm)
    assert of_kind(docs, "Secret") == []
    objects = admin_token_objects(docs)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in objects) == [
        ("Job", JOB),
        ("Role", JOB),
        ("RoleBinding", JOB),
        ("ServiceAccount", JOB),
    ]
    for d in objects:
        annotations = d["metadata"]["annotations"]
        assert {k: annotations[k] for k in HOOK} == HOOK, d["kind"]
        # Its ServiceAccount and Role exist before the Job runs.
        assert annotations["helm.sh/hook-weight"] == ("0" if d["kind"] == "Job" else "-10")
    # The only install or upgrade hooks (beside `helm test`'s Pod): everything else is an
    # ordinary manifest that every sync applies alike.
    hooks = [
        d
        for d in docs
        if d["metadata"].get("annotations", {}).get("helm.sh/hook", "test") != "test"
    ]
    assert {id(d) for d in hooks} == {id(d) for d in objects}

    job = one(docs, "Job", JOB)
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == JOB and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["image"] == f"{REGISTRY}/lora-operator/operator:0.2.0"
    assert c["command"][:3] == ["python", "-m", "lora_operator.admintoken"]
    assert f"--name={SECRET}" in c["command"] and "--namespace=lora-system" in c["command"]
    # The Secret gets no app.kubernetes.io/instance label: Argo CD's label tracking would take
    # it for an object of the app that is missing from git and prune it.
    labels = [a.split("=", 1)[1] for a in c["command"] if a.startswith("--label=")]
    assert not [la for la in labels if la.startswith("app.kubernetes.io/instance")]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert job["spec"]["ttlSecondsAfterFinished"] == 600

    rules = one(docs, "Role", JOB)["rules"]
    assert rules == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": [SECRET],
            "verbs": ["get", "patch"],
        },
    ]


def test_an_existing_secret_needs_no_job(helm: str) -> None:
    docs = render(helm, "--set", "adminToken.existingSecret=mine")
    assert admin_token_objects(docs) == []
    assert of_kind(docs, "Secret") == []


def test_without_rbac_the_job_runs_with_permissions_granted_elsewhere(helm: str) -> None:
    kinds = {d["kind"] for d in admin_token_objects(render(helm, "--set", "rbac.create=false"))}
    assert kinds == {"Job", "ServiceAccount"}
