"""The Gateway API routing examples (examples/routing/, docs/routing.md) against the chart they
front: rendered with the examples' own values and release name, the InferencePool must select
exactly the inference pods on their container port, the router must be gone, the HTTPRoute must
send generations to the pool, and the picker's chart values must describe the same pool.

Only the helm binary is needed; the InferencePool and HTTPRoute CRDs are not on the local
cluster, so their fields are checked here against the inference.networking.k8s.io/v1 API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT
from tests.support.chart import CHART, REGISTRY_FLAGS, container, of_kind, run_helm

EXAMPLES = ROOT / "examples" / "routing"
DOC = ROOT / "docs" / "routing.md"
VALUES = EXAMPLES / "values-gateway.yaml"
PICKER_VALUES = EXAMPLES / "endpoint-picker-values.yaml"
# The release and namespace the examples are written for (the README's install).
RELEASE, NAMESPACE = "lora-operator", "lora"
POOL_API = "inference.networking.k8s.io/v1"
# inference.networking.k8s.io/v1 InferencePoolSpec and EndpointPickerRef, field by field.
POOL_SPEC_FIELDS = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
PICKER_REF_FIELDS = {"group", "kind", "name", "port", "failureMode"}

Obj = dict[str, Any]


def _load(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _is_values(path: Path) -> bool:
    return "values" in path.name


MANIFESTS = sorted(p for p in EXAMPLES.glob("*.yaml") if not _is_values(p))


def _only(kind: str) -> Obj:
    found = [d for p in MANIFESTS for d in _load(p) if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in examples/routing/, got {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def rendered(helm: str) -> list[Obj]:
    proc = run_helm(
        helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *REGISTRY_FLAGS, "-f", str(VALUES)
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _inference(docs: list[Obj]) -> Obj:
    found = [
        d
        for d in of_kind(docs, "Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get("lora.dev/inference") == "true"
    ]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def _http_port(deployment: Obj) -> int:
    ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
    port: int = ports["http"]
    return port


def test_every_example_parses_and_every_manifest_names_its_kind() -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert VALUES in files and PICKER_VALUES in files and len(MANIFESTS) >= 2
    for path in files:
        docs = _load(path)
        assert docs, f"{path.name} is empty"
        for doc in docs:
            assert isinstance(doc, dict), f"{path.name}: not a mapping"
            if _is_values(path):
                assert "kind" not in doc, f"{path.name} is values, not a manifest"
            else:
                assert doc.get("apiVersion") and doc.get("kind"), (
                    f"{path.name}: a manifest without apiVersion and kind"
                )
                assert doc.get("metadata", {}).get("name"), f"{path.name}: no metadata.name"


def test_the_pool_selects_exactly_the_inference_pods(rendered: list[Obj]) -> None:
    pool = _only("InferencePool")
    assert pool["apiVersion"] == POOL_API
    assert set(pool["spec"]) <= POOL_SPEC_FIELDS, set(pool["spec"]) - POOL_SPEC_FIELDS
    assert set(pool["spec"]["selector"]) == {"matchLabels"}, "v1 selects by matchLabels only"
    selector = pool["spec"]["selector"]["matchLabels"]
    inference = _inference(rendered)
    labels = inference["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), f"{selector} does not match the pods' {labels}"
    for workload in of_kind(rendered, "Deployment"):
        if workload is inference:
            continue
        other = workload["spec"]["template"]["metadata"]["labels"]
        assert not selector.items() <= other.items(), (
            f"the pool also selects the pods of {workload['metadata']['name']}"
        )


def test_the_pool_targets_the_inference_containers_port(rendered: list[Obj]) -> None:
    pool = _only("InferencePool")
    ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert ports == [_http_port(_inference(rendered))]


def test_the_pool_names_its_endpoint_picker() -> None:
    ref = _only("InferencePool")["spec"]["endpointPickerRef"]
    assert set(ref) <= PICKER_REF_FIELDS, set(ref) - PICKER_REF_FIELDS
    assert ref["name"] and isinstance(ref["port"]["number"], int)
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_the_gateway_values_turn_the_router_off(rendered: list[Obj]) -> None:
    assert not [d for d in rendered if d["metadata"]["name"].endswith("-router")]
    service = next(
        d for d in of_kind(rendered, "Service") if d["metadata"]["name"] == f"{RELEASE}-inference"
    )
    # Without the router, the clients' Service reaches the pods the pool selects.
    labels = _inference(rendered)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_the_route_sends_generations_to_the_pool() -> None:
    route, pool = _only("HTTPRoute"), _only("InferencePool")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    rules = route["spec"]["rules"]
    to_pool = [
        rule
        for rule in rules
        for ref in rule["backendRefs"]
        if ref.get("group") == "inference.networking.k8s.io"
        and ref.get("kind") == "InferencePool"
        and ref["name"] == pool["metadata"]["name"]
    ]
    assert to_pool, "no backendRef names the InferencePool"
    paths = [m["path"]["value"] for rule in to_pool for m in rule["matches"]]
    assert "/v1/images/generations" in paths


def test_the_picker_values_describe_the_same_pool() -> None:
    """The picker's chart creates the pool `<release>` and its Service `<release>-epp` from these
    values: they must say what inferencepool.yaml says, and the doc must install that release."""
    pool = _only("InferencePool")
    servers = yaml.safe_load(PICKER_VALUES.read_text())["router"]["modelServers"]
    assert servers["matchLabels"] == pool["spec"]["selector"]["matchLabels"]
    assert servers["targetPorts"] == pool["spec"]["targetPorts"]
    name = pool["metadata"]["name"]
    assert pool["spec"]["endpointPickerRef"]["name"] == f"{name}-epp"
    assert f"helm install {name} " in DOC.read_text()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_the_doc_shows_each_example_as_it_is(path: Path) -> None:
    assert path.read_text() in DOC.read_text(), f"docs/routing.md does not show {path.name}"
