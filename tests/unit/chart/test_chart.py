"""The Helm chart (charts/lora-operator), rendered with no cluster: what it renders for each set
of values, what it refuses, and that the arguments it gives each program parse with that
program's own parser. Needs only the helm binary (the `helm` fixture, tests/support/chart.py);
whether a real API server accepts what it renders is tests/e2e/test_chart.py's."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from lora_inference import cli as inference_cli
from lora_operator.edges import config
from lora_runtime import sizes

from tests.support.chart import (
    CHART,
    CI_VALUES,
    CRD_COPY,
    CRD_SOURCE,
    EXAMPLE_ADAPTERS,
    EXAMPLE_VALUES,
    EXAMPLES,
    FULLNAME,
    NAMESPACE,
    REGISTRY,
    REGISTRY_FLAGS,
    RELEASE,
    Obj,
    container,
    of_component,
    of_kind,
    one,
    operator_args,
    refused,
    registered_metrics,
    render,
    run_helm,
)

# ---- the CRD: one source


def test_chart_crd_copy_matches_crds_dir() -> None:
    assert CRD_COPY.read_bytes() == CRD_SOURCE.read_bytes(), (
        "charts/lora-operator/crds-src/lora.dev_loraadapters.yaml differs from "
        "crds/lora.dev_loraadapters.yaml, the CRD's single source. Resync it with:\n"
        "    cp crds/lora.dev_loraadapters.yaml charts/lora-operator/crds-src/"
    )


def test_rendered_crd_is_the_source_crd_plus_labels(helm: str) -> None:
    crd = one(render(helm), "CustomResourceDefinition", "loraadapters.lora.dev")
    source = yaml.safe_load(CRD_SOURCE.read_text())
    assert crd["spec"] == source["spec"]
    assert crd["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


@pytest.mark.parametrize(
    ("flags", "annotated"),
    [([], True), (["--set", "crds.keep=true"], True), (["--set", "crds.keep=false"], False)],
    ids=["default", "keep", "no-keep"],
)
def test_crds_keep_annotation(helm: str, flags: list[str], annotated: bool) -> None:
    docs = render(helm, "--set", "operator.replicas=2", *flags)
    crds = of_kind(docs, "CustomResourceDefinition")
    assert {c["metadata"]["name"] for c in crds} == {
        "loraadapters.lora.dev",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
    }
    for crd in crds:
        policy = crd["metadata"].get("annotations", {}).get("helm.sh/resource-policy")
        assert policy == ("keep" if annotated else None), crd["metadata"]["name"]


def test_crds_disabled_renders_no_crd(helm: str) -> None:
    docs = render(helm, "--set", "crds.enabled=false", "--set", "operator.replicas=2")
    assert of_kind(docs, "CustomResourceDefinition") == []


# ---- lint and schema


@pytest.mark.parametrize("values", CI_VALUES + EXAMPLE_VALUES, ids=lambda p: p.name)
def test_helm_lint(helm: str, values: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), *REGISTRY_FLAGS, "-f", str(values))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_scenarios_exist() -> None:
    assert [p.name for p in CI_VALUES] == [
        "defaults-values.yaml",
        "existing-claim-values.yaml",
        "no-inference-values.yaml",
        "production-values.yaml",
        "replicas-values.yaml",
    ]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("operator.replcas=2", "additional properties 'replcas' not allowed"),
        ("inferense.enabled=false", "additional properties 'inferense' not allowed"),
        ("inference.gpu.cuont=2", "additional properties 'cuont' not allowed"),
        ("inference.device=tpu", "inference/device"),
        ("operator.replicas=0", "operator/replicas"),
        ("adapterVolume.accessModes={ReadWriteSometimes}", "accessModes"),
    ],
    ids=["operator-typo", "top-level-typo", "nested-typo", "device", "replicas", "access-mode"],
)
def test_schema_rejects_bad_values(helm: str, flag: str, message: str) -> None:
    stderr = refused(helm, "--set", flag)
    assert "values don't meet the specifications of the schema" in stderr
    assert message in stderr


def _objects_without_closed_properties(schema: Obj, path: str = "") -> Iterator[str]:
    if schema.get("properties") is not None and schema.get("additionalProperties") is not False:
        yield path or "/"
    for key, sub in (schema.get("properties") or {}).items():
        yield from _objects_without_closed_properties(sub, f"{path}/{key}")
    if isinstance(schema.get("items"), dict):
        yield from _objects_without_closed_properties(schema["items"], f"{path}[]")


def test_schema_closes_every_chart_object() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert list(_objects_without_closed_properties(schema)) == []


def _keys(values: Obj, prefix: str = "") -> Iterator[str]:
    for key, value in values.items():
        yield f"{prefix}{key}"
        if isinstance(value, dict) and value and not key.endswith(("Resources", "resources")):
            yield from _keys(value, f"{prefix}{key}.")


def test_every_value_is_in_the_schema_and_documented() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = text.splitlines()
    for key in _keys(values):
        node = schema
        for part in key.split("."):
            props = node.get("properties")
            if props is None:  # a free-form Kubernetes object (securityContext, affinity...)
                break
            assert part in props, f"{key} is in values.yaml but not in values.schema.json"
            node = props[part]
    # Every top-level and second-level key is preceded by a comment or starts a commented group.
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if not stripped or stripped.startswith(("#", "-")) or indent > 2 or ":" not in stripped:
            continue
        above = lines[i - 1].strip() if i else ""
        is_group = stripped.endswith(":")
        assert above.startswith("#") or is_group, f"values.yaml line {i + 1} has no comment: {line}"


def test_contradictory_values_fail_with_what_to_change(helm: str) -> None:
    assert "set inference.gpu.enabled=false" in refused(helm, "--set", "inference.device=cpu")
    assert "adapterVolume.existingClaim" in refused(helm, "--set", "adapterVolume.create=false")
    assert "must be under /models/" in refused(
        helm, "--set", "inference.model.existingClaim=m", "--set", "inference.model.path=/data/x"
    )
    assert "at least inference.maxLoras" in refused(
        helm, "--set", "inference.maxLoras=8", "--set", "inference.maxCpuLoras=4"
    )


# ---- the operator


def test_operator_defaults(helm: str) -> None:
    docs = render(helm)
    deployment = one(docs, "Deployment", f"{FULLNAME}-operator")
    c = container(deployment)
    assert c["image"] == f"{REGISTRY}/lora-operator/operator:0.2.0"
    assert "command" not in c, "the image's entrypoint runs the operator"
    assert c["args"] == [
        "--standalone",
        "--volume-root=/var/lib/lora/adapters",
        # Pods are sent tokens of the operator's own account bound to their namespace; the
        # admin token is not even mounted.
        f"--pod-token-service-account={NAMESPACE}/{FULLNAME}-operator",
        "--pod-token-seconds=3600",
        # Only the release's own inference pods get tokens and load calls.
        f"--inference-service-account={FULLNAME}-inference",
        f"--inference-namespace={NAMESPACE}",
        f"--inference-workload={FULLNAME}-inference",
        # Sources: the Hub only, every private range refused, a quota per namespace.
        "--source-host=huggingface.co",
        "--source-host=*.huggingface.co",
        "--source-host=*.hf.co",
        "--namespace-quota=20GiB",
        # No tenant borrows the operator's cloud identity unless the values say so.
        "--no-ambient-credentials",
        "--health-port=8080",
        "--metrics-port=9090",
        "--max-concurrent-stagings=4",
        "--max-adapter-bytes=2GiB",
        "--max-concurrent-loads=16",
        "--resync-seconds=30",
        "--load-timeout-seconds=120",
    ]
    assert "admin-token" not in {
        v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]
    }
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"health": 8080, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 65532
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert not mounts["/var/lib/lora/adapters"].get("readOnly"), "the operator writes the volume"
    assert "/tmp" in mounts
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1


def test_operator_options_reach_its_arguments(helm: str) -> None:
    docs = render(
        helm,
        "--set",
        "operator.hfEndpoint=https://hub.internal",
        "--set",
        "operator.maxAdapterBytes=10737418240",
        "--set",
        "operator.watchNamespaces={team-a,team-b}",
        "--set",
        "volumeRoot=/data/lora",
        "--set",
        "operator.image.tag=dev",
    )
    args = operator_args(docs)
    assert "--hf-endpoint=https://hub.internal" in args
    assert "--max-adapter-bytes=10737418240" in args
    assert "--volume-root=/data/lora" in args
    assert args.count("--namespace=team-a") == 1 and "--namespace=team-b" in args
    image = container(one(docs, "Deployment", f"{FULLNAME}-operator"))["image"]
    assert image == f"{REGISTRY}/lora-operator/operator:dev"


@pytest.mark.parametrize(
    "flags",
    [[], ["--set", "operator.replicas=2", "--set", "operator.watchNamespaces={a,b}"]],
    ids=["standalone", "peering-namespaced"],
)
def test_operator_arguments_parse_with_the_operator_parser(
    helm: str, flags: list[str], tmp_path: Path
) -> None:
    registries = "operator.insecureRegistries={registry.local:5000,10.0.0.9}"
    args = operator_args(
        render(helm, "--set", "operator.hfEndpoint=https://hub", "--set", registries, *flags)
    )
    parsed = config.parse_args(args)
    assert parsed.source_rules.insecure_registries == ("registry.local:5000", "10.0.0.9")
    assert parsed.pod_token_service_account == (NAMESPACE, f"{FULLNAME}-operator")
    assert parsed.admin_token is None and parsed.namespace_quota == 20 * 1024**3
    assert parsed.source_rules.hosts == ("huggingface.co", "*.huggingface.co", "*.hf.co")
    assert str(parsed.volume_root) == "/var/lib/lora/adapters"
    assert parsed.hf_endpoint == "https://hub"
    if flags:
        assert (parsed.peering, parsed.namespaces) == (FULLNAME, ("a", "b"))
    else:
        assert parsed.standalone and parsed.namespaces == ()


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_peering_only_with_several_replicas(helm: str, replicas: int) -> None:
    docs = render(helm, "--set", f"operator.replicas={replicas}")
    args = operator_args(docs)
    peering = of_kind(docs, "ClusterKopfPeering")
    rules = one(docs, "ClusterRole", f"{FULLNAME}-operator-cluster")["rules"]
    peering_rules = [r for r in rules if r["apiGroups"] == ["kopf.dev"]]
    if replicas == 1:
        assert "--standalone" in args and not any(a.startswith("--peering") for a in args)
        assert peering == [] and of_kind(docs, "KopfPeering") == []
        assert peering_rules == []
    else:
        assert f"--peering={FULLNAME}" in args and "--standalone" not in args
        assert [p["metadata"]["name"] for p in peering] == [FULLNAME]
        assert peering[0]["apiVersion"] == "kopf.dev/v1"
        assert peering_rules == [
            {
                "apiGroups": ["kopf.dev"],
                "resources": ["clusterkopfpeerings"],
                "verbs": ["get", "list", "watch", "patch"],
            }
        ]
        strategy = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"].get("strategy")
        assert strategy is None, "peers hand over during a rolling update"


def test_namespaced_peering_uses_a_kopfpeering_per_namespace(helm: str) -> None:
    docs = render(
        helm, "--set", "operator.replicas=2", "--set", "operator.watchNamespaces={team-a,team-b}"
    )
    assert of_kind(docs, "ClusterKopfPeering") == []
    peerings = of_kind(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert {p["metadata"]["name"] for p in peerings} == {FULLNAME}
    for role in of_component(docs, "Role", "operator"):
        if role["metadata"]["name"].endswith("-tokens"):
            continue  # the release namespace's: the operator's own tokens
        assert {
            "apiGroups": ["kopf.dev"],
            "resources": ["kopfpeerings"],
            "verbs": ["get", "list", "watch", "patch"],
        } in role["rules"]


# ---- RBAC

WORK_RULES = [
    {
        "apiGroups": ["lora.dev"],
        "resources": ["loraadapters"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {"apiGroups": ["lora.dev"], "resources": ["loraadapters/status"], "verbs": ["get", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["apps"],
        "resources": ["replicasets", "deployments", "statefulsets"],
        "verbs": ["get"],
    },
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
]
SECRET_RULE = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
TOKEN_RULE = {
    "apiGroups": [""],
    "resources": ["serviceaccounts/token"],
    "resourceNames": [f"{FULLNAME}-operator"],
    "verbs": ["create"],
}
CRD_RULE = {
    "apiGroups": ["apiextensions.k8s.io"],
    "resources": ["customresourcedefinitions"],
    "verbs": ["list", "watch"],
}
NAMESPACE_RULE = {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}


def roles_by_name(docs: list[Obj], kind: str = "Role") -> dict[tuple[str, str], Obj]:
    return {
        (r["metadata"]["namespace"], r["metadata"]["name"]): r
        for r in of_component(docs, kind, "operator")
    }


def test_rbac_all_namespaces_is_a_cluster_role_reading_secrets_of_the_release_only(
    helm: str,
) -> None:
    docs = render(helm)
    # Secrets: get in the release namespace only; the operator's own tokens, no one else's.
    roles = roles_by_name(docs)
    assert roles == {
        (NAMESPACE, f"{FULLNAME}-operator-secrets"): roles[
            (NAMESPACE, f"{FULLNAME}-operator-secrets")
        ],
        (NAMESPACE, f"{FULLNAME}-operator-tokens"): roles[
            (NAMESPACE, f"{FULLNAME}-operator-tokens")
        ],
    }
    assert roles[(NAMESPACE, f"{FULLNAME}-operator-secrets")]["rules"] == [SECRET_RULE]
    assert roles[(NAMESPACE, f"{FULLNAME}-operator-tokens")]["rules"] == [TOKEN_RULE]
    assert set(roles_by_name(docs, "RoleBinding")) == set(roles)
    assert one(docs, "ClusterRole", f"{FULLNAME}-operator")["rules"] == WORK_RULES
    # One value opens more: named namespaces, or every one.
    more = roles_by_name(render(helm, "--set", "operator.secretNamespaces={team-a,team-b}"))
    assert {ns for ns, name in more if name.endswith("-secrets")} == {"team-a", "team-b"}
    every = render(helm, "--set", "operator.secretNamespaces={*}")
    assert one(every, "ClusterRole", f"{FULLNAME}-operator")["rules"] == [*WORK_RULES, SECRET_RULE]
    assert not [n for _, n in roles_by_name(every) if n.endswith("-secrets")]
    assert one(docs, "ClusterRole", f"{FULLNAME}-operator-cluster")["rules"] == [CRD_RULE]
    for name in (f"{FULLNAME}-operator", f"{FULLNAME}-operator-cluster"):
        binding = one(docs, "ClusterRoleBinding", name)
        assert binding["roleRef"]["name"] == name
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": f"{FULLNAME}-operator", "namespace": NAMESPACE}
        ]


def test_rbac_watched_namespaces_get_a_role_each(helm: str) -> None:
    docs = render(helm, "--set", "operator.watchNamespaces={team-a,team-b}")
    roles = roles_by_name(docs)
    assert set(roles) == {
        ("team-a", f"{FULLNAME}-operator"),
        ("team-b", f"{FULLNAME}-operator"),
        (NAMESPACE, f"{FULLNAME}-operator-tokens"),
    }
    for (_, name), role in roles.items():
        assert role["rules"] == (
            [TOKEN_RULE] if name.endswith("-tokens") else [*WORK_RULES, SECRET_RULE]
        )
    bindings = of_component(docs, "RoleBinding", "operator")
    assert set(roles_by_name(docs, "RoleBinding")) == set(roles)
    for binding in bindings:
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    # Only the cluster-scoped reads kopf needs stay cluster-wide (besides the inference pods'
    # token reviews).
    assert [c["metadata"]["name"] for c in of_component(docs, "ClusterRole", "operator")] == [
        f"{FULLNAME}-operator-cluster"
    ]
    cluster_rules = one(docs, "ClusterRole", f"{FULLNAME}-operator-cluster")["rules"]
    assert cluster_rules == [CRD_RULE, NAMESPACE_RULE]


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_rbac_has_no_wildcards_and_no_writes_to_pods_or_secrets(helm: str, values: Path) -> None:
    docs = render(helm, "-f", str(values))
    for role in of_kind(docs, "ClusterRole") + of_kind(docs, "Role"):
        if role["metadata"]["labels"].get("app.kubernetes.io/component") == "admin-token":
            continue  # the hook Job's, which creates the token Secret: tests/e2e/test_gitops.py
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
            if {"pods", "secrets"} & set(rule["resources"]):
                assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
            if "secrets" in rule["resources"]:
                assert rule["verbs"] == ["get"], "the operator must not enumerate Secrets"


def test_rbac_comments_say_why() -> None:
    text = "".join(
        (CHART / "templates" / name).read_text()
        for name in ("rbac.yaml", "rbac-router.yaml", "_helpers.tpl")
    )
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- apiGroups:"):
            above = lines[i - 1].strip()
            assert above.startswith("#"), f"RBAC rule without a comment: {line.strip()}"


def test_rbac_disabled(helm: str) -> None:
    docs = render(helm, "--set", "rbac.create=false")
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io")]


# ---- volumes, token, inference


def test_created_claim_is_shared_read_write_by_operator_read_only_by_inference(helm: str) -> None:
    docs = render(helm)
    claim = one(docs, "PersistentVolumeClaim", f"{FULLNAME}-adapters")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert "storageClassName" not in claim["spec"], "empty means the cluster's default class"
    for name, read_only in (("operator", False), ("inference", True)):
        deployment = one(docs, "Deployment", f"{FULLNAME}-{name}")
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-adapters"
        mount = next(m for m in container(deployment)["volumeMounts"] if m["name"] == "adapters")
        assert mount["mountPath"] == "/var/lib/lora/adapters"
        assert bool(mount.get("readOnly")) is read_only


def test_storage_class_and_size(helm: str) -> None:
    docs = render(
        helm,
        "--set",
        "adapterVolume.storageClassName=nfs",
        "--set",
        "adapterVolume.size=1Ti",
    )
    claim = one(docs, "PersistentVolumeClaim", f"{FULLNAME}-adapters")
    assert claim["spec"]["storageClassName"] == "nfs"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Ti"


def test_existing_claims_are_used_instead_of_created_ones(helm: str) -> None:
    docs = render(helm, "-f", str(CHART / "ci" / "existing-claim-values.yaml"))
    assert of_kind(docs, "PersistentVolumeClaim") == []
    assert of_kind(docs, "Secret") == [], "the admin token comes from adminToken.existingSecret"
    for name in ("operator", "inference"):
        spec = one(docs, "Deployment", f"{FULLNAME}-{name}")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "shared-lora-adapters"
    spec = one(docs, "Deployment", f"{FULLNAME}-inference")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["admin-token"]["secret"]["secretName"] == "lora-admin-token"
    inference = one(docs, "Deployment", f"{FULLNAME}-inference")
    volumes = {v["name"]: v for v in inference["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    mounts = {m["name"]: m for m in container(inference)["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert "--model=/models/stable-diffusion-v1-5" in container(inference)["args"]


def test_the_operator_proves_itself_with_bound_tokens_that_the_pods_review(helm: str) -> None:
    """By default the operator mounts no admin token: it sends ServiceAccount tokens bound to
    each pod's namespace, and the pods, whose account may only review tokens, check them."""
    docs = render(helm)
    operator = one(docs, "Deployment", f"{FULLNAME}-operator")
    assert not [a for a in container(operator)["args"] if a.startswith("--admin-token-file")]
    inference = one(docs, "Deployment", f"{FULLNAME}-inference")
    spec = inference["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is True
    args = container(inference)["args"]
    assert f"--operator-service-account={NAMESPACE}/{FULLNAME}-operator" in args
    review = one(docs, "ClusterRole", f"{FULLNAME}-inference-tokenreview")
    assert review["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
    ]
    accounts = render(helm, "--set", "operator.inferencePods.namespaces={team-a}")
    binding = one(accounts, "ClusterRoleBinding", f"{FULLNAME}-inference-tokenreview")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{FULLNAME}-inference", "namespace": ns}
        for ns in (NAMESPACE, "team-a")
    ]
    created = [
        a
        for a in of_kind(accounts, "ServiceAccount")
        if a["metadata"]["name"] == f"{FULLNAME}-inference"
    ]
    assert sorted(a["metadata"]["namespace"] for a in created) == sorted([NAMESPACE, "team-a"])
    assert all(a["automountServiceAccountToken"] is False for a in created)


def test_the_admin_token_mode_mounts_the_admin_token_in_operator_and_inference(
    helm: str,
) -> None:
    docs = render(helm, "--set", "operator.podAuth=adminToken")
    # Never rendered: a hook Job creates it once (tests/e2e/test_gitops.py).
    assert of_kind(docs, "Secret") == []
    assert not of_kind(docs, "ClusterRoleBinding") or not [
        b
        for b in of_kind(docs, "ClusterRoleBinding")
        if b["metadata"]["name"].endswith("tokenreview")
    ]
    inference = one(docs, "Deployment", f"{FULLNAME}-inference")
    assert inference["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    for name in ("operator", "inference"):
        deployment = one(docs, "Deployment", f"{FULLNAME}-{name}")
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["admin-token"]["secret"]["secretName"] == f"{FULLNAME}-admin-token"
        c = container(deployment)
        assert "--admin-token-file=/var/run/lora/admin-token/token" in c["args"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "admin-token")
        assert mount == {
            "name": "admin-token",
            "mountPath": "/var/run/lora/admin-token",
            "readOnly": True,
        }


def test_inference_pod_contract(helm: str) -> None:
    docs = render(helm)
    deployment = one(docs, "Deployment", f"{FULLNAME}-inference")
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["lora.dev/inference"] == "true"
    assert template["metadata"]["annotations"]["lora.dev/port"] == "8000"
    assert template["metadata"]["annotations"]["lora.dev/adapter-root"] == "/var/lib/lora/adapters"
    c = container(deployment)
    assert c["image"] == f"{REGISTRY}/lora-operator/inference:0.2.0"
    assert "command" not in c, "the image's entrypoint is lora-inference"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Every flag is one the real server accepts.
    args = [a.replace("$(POD_NAMESPACE)", "ns") for a in c["args"]]
    parsed = inference_cli.build_parser().parse_args(args)
    assert str(parsed.model) == "/models/sdxl-base"
    assert parsed.served_model_name == "sdxl-base"
    assert str(parsed.adapter_root) == "/var/lib/lora/adapters/ns"
    assert str(parsed.admin_token_file) == "/var/run/lora/admin-token/token"
    assert (parsed.max_loras, parsed.max_cpu_loras) == (4, 32)
    assert (parsed.device, parsed.port) == ("cuda", 8000)
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["securityContext"]["runAsNonRoot"] is True
    service = one(docs, "Service", f"{FULLNAME}-inference")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]
    pods = one(docs, "Service", f"{FULLNAME}-inference-pods")
    assert pods["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    router = one(docs, "Deployment", f"{FULLNAME}-router")
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]


def test_inference_on_cpu_without_gpu(helm: str) -> None:
    docs = render(
        helm,
        "--set",
        "inference.device=cpu",
        "--set",
        "inference.gpu.enabled=false",
        "--set",
        "inference.replicas=3",
        "--set",
        "inference.acceptBaseModels={sdxl-1.0}",
    )
    deployment = one(docs, "Deployment", f"{FULLNAME}-inference")
    c = container(deployment)
    assert "resources" not in c
    assert deployment["spec"]["replicas"] == 3
    parsed = inference_cli.build_parser().parse_args(c["args"])
    assert parsed.device == "cpu"
    assert parsed.accepted_base_models == ["sdxl-1.0"]


def test_no_inference_deployment_when_disabled(helm: str) -> None:
    docs = render(helm, "-f", str(CHART / "ci" / "no-inference-values.yaml"))
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", f"{FULLNAME}-operator") in names
    assert ("Deployment", f"{FULLNAME}-inference") not in names
    assert ("Service", f"{FULLNAME}-inference") not in names
    test_pod = one(docs, "Pod", f"{FULLNAME}-test-health")
    assert "-inference" not in test_pod["spec"]["containers"][0]["command"][2]


def test_helm_test_pod_checks_ready_and_operator_health(helm: str) -> None:
    pod = one(render(helm), "Pod", f"{FULLNAME}-test-health")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    # The operator image (python's urllib): no image the project does not build.
    assert c["image"] == f"{REGISTRY}/lora-operator/operator:0.2.0"
    assert c["command"][:2] == ["python", "-c"]
    script = c["command"][2]
    compile(script, "test-health", "exec")
    assert f"http://{FULLNAME}-inference.{NAMESPACE}.svc:80/ready" in script
    assert f"http://{FULLNAME}-operator.{NAMESPACE}.svc:8080/healthz" in script
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize(
    ("flags", "image"),
    [
        (["--set", "operator.image.repository=r/op", "--set", "operator.image.tag=t"], "r/op:t"),
        (["--set", "test.image.repository=r/py"], "r/py:0.2.0"),
        (["--set", "test.image.repository=r/py", "--set", "test.image.tag=v3"], "r/py:v3"),
    ],
    ids=["follows-the-operator-image", "own-repository", "own-repository-and-tag"],
)
def test_helm_test_image(helm: str, flags: list[str], image: str) -> None:
    pod = one(render(helm, *flags), "Pod", f"{FULLNAME}-test-health")
    assert pod["spec"]["containers"][0]["image"] == image


# ---- examples/


def test_examples_cover_every_source_kind() -> None:
    uris = {
        doc["spec"]["source"]["uri"].split("://")[0]
        for path in EXAMPLE_ADAPTERS
        for doc in yaml.safe_load_all(path.read_text())
        if doc["kind"] == "LoRAAdapter"
    }
    assert {"hf", "https", "s3", "oci"} <= uris
    assert (EXAMPLES / "adapter.yaml").exists(), "NOTES.txt and the README point at it"


def test_s3_example_secret_has_the_keys_the_operator_reads() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "adapter-s3.yaml").read_text()))
    secret = next(d for d in docs if d["kind"] == "Secret")
    adapter = next(d for d in docs if d["kind"] == "LoRAAdapter")
    assert adapter["spec"]["source"]["secretRef"]["name"] == secret["metadata"]["name"]
    assert set(secret["stringData"]) == {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL",
        "AWS_REGION",
    }


# ---- data and capacity: the adapter claim, GPU rollouts, disruptions


@pytest.mark.parametrize(
    ("flags", "kept"), [([], True), (["--set", "adapterVolume.keep=false"], False)]
)
def test_adapter_claim_is_kept_on_uninstall_by_default(
    helm: str, flags: list[str], kept: bool
) -> None:
    claim = one(render(helm, *flags), "PersistentVolumeClaim", f"{FULLNAME}-adapters")
    policy = (claim["metadata"].get("annotations") or {}).get("helm.sh/resource-policy")
    assert policy == ("keep" if kept else None)
    annotated = one(
        render(helm, *flags, "--set", "adapterVolume.annotations.team=ml"),
        "PersistentVolumeClaim",
        f"{FULLNAME}-adapters",
    )
    assert annotated["metadata"]["annotations"]["team"] == "ml"


@pytest.mark.parametrize(
    ("flags", "strategy"),
    [
        ([], {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}),
        (["--set", "inference.device=cpu", "--set", "inference.gpu.enabled=false"], None),
        (["--set", "inference.updateStrategy.type=Recreate"], {"type": "Recreate"}),
    ],
    ids=["gpu-no-surge", "cpu-kubernetes-default", "explicit"],
)
def test_gpu_rollouts_need_no_spare_gpu(helm: str, flags: list[str], strategy: Obj | None) -> None:
    deployment = one(render(helm, *flags), "Deployment", f"{FULLNAME}-inference")
    assert deployment["spec"].get("strategy") == strategy


def test_pod_disruption_budget_selects_the_inference_pods(helm: str) -> None:
    docs = render(helm, "--set", "inference.podDisruptionBudget.maxUnavailable=50%")
    pdb = one(docs, "PodDisruptionBudget", f"{FULLNAME}-inference")
    deployment = one(docs, "Deployment", f"{FULLNAME}-inference")
    assert pdb["spec"]["maxUnavailable"] == "50%"
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    off = render(helm, "--set", "inference.podDisruptionBudget.enabled=false")
    assert [p["metadata"]["name"] for p in of_kind(off, "PodDisruptionBudget")] == [
        f"{FULLNAME}-router"
    ]
    assert of_kind(render(helm, "--set", "inference.enabled=false"), "PodDisruptionBudget") == []


def test_max_adapter_bytes_takes_units_and_integers(helm: str) -> None:
    for value, expected in (
        ("2GiB", 2 * 1024**3),
        ("500MB", 500_000_000),
        ("10737418240", 10 * 1024**3),
    ):
        args = operator_args(render(helm, "--set", f"operator.maxAdapterBytes={value}"))
        flag = next(a for a in args if a.startswith("--max-adapter-bytes="))
        assert sizes.parse_size(flag.split("=", 1)[1]) == expected, flag
    assert "operator/maxAdapterBytes" in refused(helm, "--set", "operator.maxAdapterBytes=2 gigs")


# ---- monitoring: what the monitors scrape is what the alerts select

MONITOR_FLAGS = {
    "ServiceMonitor": ["--set", "metrics.serviceMonitor.enabled=true"],
    "PodMonitor": ["--set", "metrics.podMonitor.enabled=true"],
}


def _job(endpoint: Obj) -> str:
    [relabel] = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    assert relabel["action"] == "replace"
    job: str = relabel["replacement"]
    return job


@pytest.mark.parametrize("kind", sorted(MONITOR_FLAGS))
def test_monitors_scrape_the_operator_inference_and_router_ports(helm: str, kind: str) -> None:
    docs = render(helm, *MONITOR_FLAGS[kind], "--set", "metrics.serviceMonitor.labels.release=p")
    monitors = {m["metadata"]["name"]: m for m in of_kind(docs, kind)}
    components = ("inference", "operator", "router")
    assert sorted(monitors) == [f"{FULLNAME}-{c}" for c in components]
    for component in components:
        monitor = monitors[f"{FULLNAME}-{component}"]
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        selector = monitor["spec"]["selector"]["matchLabels"]
        if kind == "ServiceMonitor":
            assert monitor["metadata"]["labels"]["release"] == "p"
            [endpoint] = monitor["spec"]["endpoints"]
            # Exactly one selected Service has the port, and it selects the component's pods:
            # the client-facing inference Service (the router's) never gets scraped as the pods.
            services = [
                svc
                for svc in of_kind(docs, "Service")
                if selector.items() <= svc["metadata"]["labels"].items()
                and endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
            ]
            [service] = services
            assert service["spec"]["selector"]["app.kubernetes.io/component"] == component
            ports = {p["name"] for p in service["spec"]["ports"]}
        else:
            [endpoint] = monitor["spec"]["podMetricsEndpoints"]
            deployment = one(docs, "Deployment", f"{FULLNAME}-{component}")
            assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
            ports = {p["name"] for p in container(deployment)["ports"]}
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        assert _job(endpoint) == f"{FULLNAME}-{component}"
    no_inference = render(helm, *MONITOR_FLAGS[kind], "--set", "inference.enabled=false")
    assert [m["metadata"]["name"] for m in of_kind(no_inference, kind)] == [f"{FULLNAME}-operator"]
    no_router = render(helm, *MONITOR_FLAGS[kind], "--set", "router.enabled=false")
    assert f"{FULLNAME}-router" not in {m["metadata"]["name"] for m in of_kind(no_router, kind)}


@pytest.mark.parametrize("kind", sorted(MONITOR_FLAGS))
def test_alerts_select_what_the_monitors_scrape_and_metrics_the_code_registers(
    helm: str, kind: str
) -> None:
    docs = render(helm, *MONITOR_FLAGS[kind], "--set", "metrics.prometheusRule.enabled=true")
    jobs = {
        _job(e)
        for m in of_kind(docs, kind)
        for e in m["spec"].get("endpoints", m["spec"].get("podMetricsEndpoints", []))
    }
    [rule] = of_kind(docs, "PrometheusRule")
    rules = rule["spec"]["groups"][0]["rules"]
    registered = registered_metrics()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = set()
    for r in rules:
        names.add(r["alert"])
        selectors = re.findall(r"\b([a-z_]+)\{([^}]*)\}", r["expr"])
        assert selectors, r["alert"]
        for metric, labels in selectors:
            label_values = dict(re.findall(r'(\w+)\s*[!=]~?\s*"([^"]*)"', labels))
            assert label_values.get("job") in jobs, (r["alert"], labels)
            if metric == "up":
                continue
            base = next(
                (n for n, (t, _) in registered.items() for sfx in suffixes[t] if metric == n + sfx),
                None,
            )
            assert base is not None, f"{r['alert']}: {metric} is not registered in code"
            assert set(label_values) - {"job", "le"} <= registered[base][1], (r["alert"], labels)
    assert {"LoRAOperatorDown", "LoRAInferenceDown", "LoRAAdapterFailed", "LoRARouterDown"} <= names


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            [*MONITOR_FLAGS["ServiceMonitor"], *MONITOR_FLAGS["PodMonitor"]],
            "not both",
        ),
        (["--set", "metrics.prometheusRule.enabled=true"], "needs metrics.serviceMonitor.enabled"),
        (
            [*MONITOR_FLAGS["ServiceMonitor"], "--set", "operator.service.enabled=false"],
            "needs operator.service.enabled=true",
        ),
        (
            ["--set", "networkPolicy.allowFrom=null", "--set", "router.enabled=false"],
            "networkPolicy.allowFrom is empty",
        ),
    ],
    ids=["two-monitors", "rule-without-monitor", "monitor-without-service", "policy-admits-nobody"],
)
def test_contradictory_monitoring_and_policy_values_fail(
    helm: str, flags: list[str], message: str
) -> None:
    assert message in refused(helm, *flags)


@pytest.mark.parametrize(
    "flag",
    [
        "metrics.serviceMonitor.intervall=1m",
        "networkPolicy.allowfrom=x",
        "inference.podDisruptionBudget.minAvailable=1",
        "adapterVolume.kep=true",
    ],
)
def test_schema_closes_the_new_values(helm: str, flag: str) -> None:
    assert "additional properties" in refused(helm, "--set", flag)


# ---- the router and the pods' client token


def test_the_router_polls_with_the_client_token_when_the_pods_require_one(
    helm: str, tmp_path: Path
) -> None:
    from lora_router import config as router_config

    flags = ["--set", "inference.clientToken.existingSecret=clients"]
    docs = render(helm, *flags, "--set", "inference.clientToken.key=tok")
    router = one(docs, "Deployment", f"{FULLNAME}-router")
    inference = one(docs, "Deployment", f"{FULLNAME}-inference")

    def volume(deployment: Obj) -> Obj:
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        return next(v for v in volumes if v["name"] == "client-token")

    # The same Secret and key the pods check, at the same path.
    assert volume(router) == volume(inference)
    assert volume(router)["secret"] == {
        "secretName": "clients",
        "items": [{"key": "tok", "path": "token"}],
    }
    mounts = [m for m in container(router)["volumeMounts"] if m["name"] == "client-token"]
    assert mounts == [
        {"name": "client-token", "mountPath": "/var/run/lora/client-token", "readOnly": True}
    ]
    flag = "--client-token-file=/var/run/lora/client-token/token"
    assert flag in container(router)["args"]
    assert flag in container(inference)["args"]
    # The router's own parser takes the flag (with the mounted file where the pod has it).
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = [f"--client-token-file={token}" if a == flag else a for a in container(router)["args"]]
    assert router_config.parse_args(args).client_token_file == token

    # Without the value: no flag, no Secret.
    plain = one(render(helm), "Deployment", f"{FULLNAME}-router")
    assert not [a for a in container(plain)["args"] if a.startswith("--client-token-file")]
    assert "client-token" not in {m["name"] for m in container(plain)["volumeMounts"]}
    assert "client-token" not in {v["name"] for v in plain["spec"]["template"]["spec"]["volumes"]}


# ---- the network policy


def test_network_policy_admits_the_operator_router_helm_test_and_allow_from(helm: str) -> None:
    docs = render(helm, "-f", str(CHART / "ci" / "production-values.yaml"))
    policy = one(docs, "NetworkPolicy", f"{FULLNAME}-inference")
    inference = one(docs, "Deployment", f"{FULLNAME}-inference")
    operator = one(docs, "Deployment", f"{FULLNAME}-operator")
    router = one(docs, "Deployment", f"{FULLNAME}-router")
    test_pod = one(docs, "Pod", f"{FULLNAME}-test-health")
    spec = policy["spec"]
    assert spec["podSelector"] == inference["spec"]["selector"]
    # The inference pods open one kind of connection: to the API server, for TokenReview. With
    # no cluster to look its addresses up (helm template), its ports only.
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["egress"] == [
        {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}
    ]
    [ingress] = spec["ingress"]
    assert ingress["ports"] == [{"port": "http", "protocol": "TCP"}]
    peers = ingress["from"]
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert peers[0]["podSelector"]["matchLabels"].items() <= operator_labels.items()
    assert peers[1]["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert peers[2]["podSelector"]["matchLabels"].items() <= test_pod["metadata"]["labels"].items()
    values = yaml.safe_load((CHART / "ci" / "production-values.yaml").read_text())
    assert peers[3:] == values["networkPolicy"]["allowFrom"]
    # On by default: the release namespace's own pods are the clients, nobody else.
    defaults = render(helm)
    default_peers = one(defaults, "NetworkPolicy", f"{FULLNAME}-inference")["spec"]["ingress"][0]
    assert default_peers["from"][3:] == [{"podSelector": {}}]
    assert one(defaults, "NetworkPolicy", f"{FULLNAME}-router")
    assert of_kind(render(helm, "--set", "networkPolicy.enabled=false"), "NetworkPolicy") == []
    # Named addresses pin the egress; the admin token mode needs none at all.
    pinned = render(helm, "--set", "networkPolicy.apiServerCIDRs={10.0.0.1/32,192.168.1.10/32}")
    egress = one(pinned, "NetworkPolicy", f"{FULLNAME}-inference")["spec"]["egress"]
    assert egress[0]["to"] == [
        {"ipBlock": {"cidr": "10.0.0.1/32"}},
        {"ipBlock": {"cidr": "192.168.1.10/32"}},
    ]
    static = render(helm, "--set", "operator.podAuth=adminToken")
    assert one(static, "NetworkPolicy", f"{FULLNAME}-inference")["spec"]["egress"] == []
