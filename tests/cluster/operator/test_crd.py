"""The LoRAAdapter CRD on a real kube-apiserver: what it accepts, what it refuses and why.

Each invalid manifest must be refused by the API server itself (OpenAPI schema, CEL rules or
strict field validation) with a message that tells the user what to fix.
"""

from __future__ import annotations

import copy
import json
import subprocess
from typing import Any

import pytest
import yaml


def adapter(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": "pixel-art"},
        "spec": {"baseModel": "sdxl-base", "source": {"uri": "hf://acme/pixel-art"}},
    }
    base["spec"].update(spec)
    return base


def with_source(**source: Any) -> dict[str, Any]:
    manifest = adapter()
    manifest["spec"]["source"] = source
    return manifest


def dry_run(
    cluster: Any, namespace: str, manifest: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "apply", "--dry-run=server", "-n", namespace, "-f", "-"],
        input=yaml.safe_dump(manifest),
        capture_output=True,
        text=True,
        env=cluster.cluster.env(),
        timeout=60,
    )


def without(path: list[str]) -> dict[str, Any]:
    manifest = adapter()
    parent = manifest
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return manifest


def composed(members: list[dict[str, Any]]) -> dict[str, Any]:
    manifest = without(["spec", "source"])
    manifest["spec"]["compose"] = members
    return manifest


def rolled(manifest: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    manifest["spec"]["rollout"] = {"steps": steps}
    return manifest


INVALID = [
    pytest.param(
        with_source(uri="http://example.com/a.safetensors"),
        "plain http:// is not accepted",
        id="http-scheme",
    ),
    pytest.param(
        with_source(uri="ftp://example.com/a"),
        "must start with hf://, https://, s3://",
        id="ftp-scheme",
    ),
    pytest.param(with_source(uri="relative/path"), "must start with hf://", id="relative-path"),
    pytest.param(with_source(uri="hf://just-a-repo"), "hf://ORG/REPO", id="hf-without-org"),
    pytest.param(with_source(uri="s3://Bad_Bucket/key"), "s3://BUCKET/KEY", id="s3-bad-bucket"),
    pytest.param(
        with_source(uri="oci://registry.example/loras/pixel"),
        "oci://REGISTRY/REPOSITORY:TAG",
        id="oci-without-tag",
    ),
    pytest.param(
        with_source(uri="oci://registry.example/Loras/pixel:v1"),
        "oci://REGISTRY/REPOSITORY:TAG",
        id="oci-uppercase-repository",
    ),
    pytest.param(with_source(uri="/adapters/../etc/passwd"), "'..' segments", id="dotdot-path"),
    pytest.param(
        with_source(uri="https://example.com/a.safetensors", sha256="abc123"),
        "64 lowercase hexadecimal",
        id="short-sha",
    ),
    pytest.param(
        with_source(uri="https://example.com/a.safetensors", sha256="A" * 64),
        "64 lowercase hexadecimal",
        id="uppercase-sha",
    ),
    pytest.param(
        with_source(uri="https://example.com/a.safetensors", revision="main"),
        "revision applies to hf:// sources only",
        id="revision-on-https",
    ),
    pytest.param(
        with_source(uri="/adapters/a", secretRef={"name": "creds"}),
        "needs no source.secretRef",
        id="secret-on-path",
    ),
    pytest.param(
        with_source(uri="s3://bucket/key", secretRef={}),
        "name: Required value",
        id="secret-without-name",
    ),
    pytest.param(adapter(scale=10.5), "should be less than or equal to 10", id="scale-too-high"),
    pytest.param(adapter(scale=-11), "should be greater than or equal to -10", id="scale-too-low"),
    pytest.param(adapter(scale="strong"), "must be of type number", id="scale-type"),
    pytest.param(adapter(pinned="yes"), "must be of type boolean", id="pinned-type"),
    pytest.param(
        without(["spec", "baseModel"]), "baseModel: Required value", id="missing-base-model"
    ),
    pytest.param(without(["spec", "source"]), "set either source", id="missing-source"),
    pytest.param(
        adapter(compose=[{"name": "a"}, {"name": "b"}]),
        "set either source",
        id="source-and-compose",
    ),
    pytest.param(composed([]), "should have at least 1 items", id="compose-empty"),
    pytest.param(
        composed([{"name": "a", "blocks": {"middle": 1}}]),
        'unknown field "spec.compose[0].blocks.middle"',
        id="compose-block-group",
    ),
    pytest.param(
        composed([{"name": "a", "blocks": {"up": 11}}]),
        "should be less than or equal to 10",
        id="compose-block-weight",
    ),
    pytest.param(
        composed([{"name": "a", "blocks": {}}]),
        "should have at least 1 properties",
        id="compose-no-blocks",
    ),
    pytest.param(
        composed([{"name": n} for n in "abcde"]), "must have at most 4 items", id="compose-five"
    ),
    pytest.param(
        composed([{"name": "a"}, {"name": "a", "scale": 0.5}]),
        "names an adapter twice",
        id="compose-twice",
    ),
    pytest.param(
        composed([{"name": "a", "scale": 11}, {"name": "b"}]),
        "should be less than or equal to 10",
        id="compose-scale",
    ),
    pytest.param(
        adapter(sourc={"uri": "hf://a/b"}), 'unknown field "spec.sourc"', id="unknown-field"
    ),
    pytest.param(
        adapter(
            selector={"matchExpressions": [{"key": "tier", "operator": "Like", "values": ["a"]}]}
        ),
        'Unsupported value: "Like"',
        id="selector-bad-operator",
    ),
    pytest.param(
        adapter(selector={"matchExpressions": [{"key": "tier", "operator": "In"}]}),
        "In and NotIn need at least one value",
        id="selector-in-without-values",
    ),
    pytest.param(
        adapter(
            selector={"matchExpressions": [{"key": "tier", "operator": "Exists", "values": ["x"]}]}
        ),
        "Exists and DoesNotExist take no values",
        id="selector-exists-with-values",
    ),
    pytest.param(adapter(replicas=0), "should be greater than or equal to 1", id="zero-replicas"),
    pytest.param(
        adapter(replicas=2, autoscale={"minReplicas": 1, "maxReplicas": 3}),
        "set either replicas",
        id="replicas-and-autoscale",
    ),
    pytest.param(
        adapter(autoscale={"minReplicas": 4, "maxReplicas": 2}),
        "minReplicas must not exceed autoscale.maxReplicas",
        id="autoscale-min-above-max",
    ),
    pytest.param(
        adapter(autoscale={"minReplicas": 1}),
        "maxReplicas: Required value",
        id="autoscale-without-max",
    ),
    pytest.param(
        adapter(autoscale={"minReplicas": 1, "maxReplicas": 2, "targetRequestsPerSecond": 0}),
        "targetRequestsPerSecond must be positive",
        id="autoscale-zero-target",
    ),
    pytest.param(
        rolled(composed([{"name": "a"}, {"name": "b"}]), [{"weight": 10}]),
        "spec.rollout applies to adapters with a source",
        id="rollout-of-a-composition",
    ),
    pytest.param(
        adapter(rollout={"steps": [{"weight": 0}]}),
        "should be greater than or equal to 1",
        id="rollout-weight-zero",
    ),
    pytest.param(
        adapter(rollout={"steps": []}), "should have at least 1 items", id="rollout-no-steps"
    ),
]


@pytest.mark.parametrize(("manifest", "message"), INVALID)
def test_the_api_server_refuses_mistakes_and_says_what_to_fix(
    crd: Any, devcluster_namespace: str, manifest: dict[str, Any], message: str
) -> None:
    result = dry_run(crd, devcluster_namespace, manifest)
    assert result.returncode != 0, f"accepted: {manifest}"
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    "source",
    [
        {"uri": "hf://acme/pixel-art", "revision": "v2", "secretRef": {"name": "hf"}},
        {"uri": "hf://acme/styles/pixel/pytorch_lora_weights.safetensors"},
        {"uri": "https://example.com/pixel.safetensors", "sha256": "ab" * 32},
        {"uri": "s3://my-bucket/loras/pixel.safetensors", "secretRef": {"name": "s3"}},
        {"uri": "oci://registry.example:5000/loras/pixel:v1", "secretRef": {"name": "pull"}},
        {"uri": "oci://ghcr.io/acme/pixel@sha256:" + "ab" * 32, "sha256": "cd" * 32},
        {"uri": "/adapters/_shared/pixel"},
    ],
    ids=["hf-revision", "hf-file", "https-pinned", "s3", "oci-tag", "oci-digest", "volume-path"],
)
def test_every_kind_of_source_is_accepted(
    crd: Any, devcluster_namespace: str, source: dict[str, Any]
) -> None:
    manifest = with_source(**source)
    manifest["spec"]["selector"] = {
        "matchLabels": {"app": "inference"},
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["gpu"]},
            {"key": "canary", "operator": "DoesNotExist"},
        ],
    }
    result = dry_run(crd, devcluster_namespace, manifest)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "spec",
    [
        {"replicas": 2},
        {"autoscale": {"minReplicas": 1, "maxReplicas": 4}},
        {"autoscale": {"minReplicas": 2, "maxReplicas": 2, "targetRequestsPerSecond": 0.1}},
    ],
    ids=["replicas", "autoscale", "autoscale-fixed"],
)
def test_placement_fields_are_accepted(
    crd: Any, devcluster_namespace: str, spec: dict[str, Any]
) -> None:
    result = dry_run(crd, devcluster_namespace, adapter(**spec))
    assert result.returncode == 0, result.stderr


def test_a_rollout_is_accepted(crd: Any, devcluster_namespace: str) -> None:
    steps = [{"weight": 10, "pauseSeconds": 300}, {"weight": 50}, {"weight": 100}]
    result = dry_run(crd, devcluster_namespace, adapter(rollout={"steps": steps}))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "members",
    [
        [{"name": "a", "scale": 0.8}, {"name": "b"}, {"name": "c", "scale": -1}],
        [{"name": "a", "scale": 0.8, "blocks": {"down": 0.2, "mid": 0.5, "up": 1.0}}],
        [
            {"name": "a", "blocks": {"text_encoder": 0, "double": 1.5, "single": -0.5}},
            {"name": "b", "blocks": {"up": 10}},
        ],
    ],
    ids=["stack", "one-member-with-blocks", "transformer-blocks"],
)
def test_a_composition_is_accepted(
    crd: Any, devcluster_namespace: str, members: list[dict[str, Any]]
) -> None:
    result = dry_run(crd, devcluster_namespace, composed(members))
    assert result.returncode == 0, result.stderr


def test_defaults_short_name_printer_columns_and_status(
    crd: Any, devcluster_namespace: str
) -> None:
    crd.apply(adapter(), namespace=devcluster_namespace)
    stored = json.loads(
        crd.kubectl("get", "lora", "pixel-art", "-n", devcluster_namespace, "-o", "json")
    )
    assert stored["spec"]["scale"] == 1.0 and stored["spec"]["pinned"] is False
    status = {
        "phase": "Ready",
        "ready": "2/2",
        "readyPods": 2,
        "desiredPods": 2,
        "observedGeneration": 1,
    }
    crd.kubectl(
        "patch",
        "lora",
        "pixel-art",
        "-n",
        devcluster_namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    table = crd.kubectl("get", "lora", "-n", devcluster_namespace)
    header, row = table.splitlines()[:2]
    assert header.split()[:6] == ["NAME", "BASE", "MODEL", "PHASE", "READY", "AGE"]
    assert row.split()[:4] == ["pixel-art", "sdxl-base", "Ready", "2/2"]
    # The status subresource: a spec update through the main resource cannot change status.
    changed = copy.deepcopy(stored)
    changed["status"] = {"phase": "Failed"}
    changed["metadata"].pop("resourceVersion")
    crd.apply(changed, namespace=devcluster_namespace)
    phase = crd.kubectl(
        "get", "lora", "pixel-art", "-n", devcluster_namespace, "-o", "jsonpath={.status.phase}"
    )
    assert phase == "Ready"


def test_kubectl_explain_teaches_the_fields(crd: Any) -> None:
    text = crd.kubectl("explain", "loraadapter.spec.source")
    assert "hf://ORG/REPO" in text and "sha256" in text and "secretRef" in text
    assert "Negative scales are legitimate" in crd.kubectl("explain", "loraadapter.spec.scale")
