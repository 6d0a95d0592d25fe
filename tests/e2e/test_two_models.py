"""Two base models of different families in one release, on the local cluster: the chart's
`inference.models` with a tiny SD 1.5 and a tiny SDXL pipeline, each its own Deployment, Service,
PodDisruptionBudget and NetworkPolicy; each model's adapter is loaded on its model's pod only,
and the router sends each request only to a pod of the base model its adapter (or its `model`)
names, also when that model has no pod left.

The test process is in the cluster's network namespace (the devcluster fixture): it reaches the
router through its Service's ClusterIP, as tests/e2e/test_router_faults.py does.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from lora_demo import manifests, release
from lora_demo.manifests import MODEL_CLAIM, MODELS_MOUNT, RELEASE, SERVICE, AdapterSource
from lora_devcluster import pytest_plugin
from lora_devcluster.harness import ApiError, Harness

Obj = dict[str, Any]
SD15, SDXL = "tiny-sd15", "tiny-sdxl"
DEPLOYMENTS = {model: f"{RELEASE}-inference-{model}" for model in (SD15, SDXL)}
SHORT: dict[str, Any] = {"size": 64, "steps": 4}


@dataclass(frozen=True)
class Answer:
    status: int
    pod: str | None  # x-lora-pod: the pod that answered
    body: Obj


@dataclass
class Release:
    h: Harness
    ns: str
    url: str  # the router's Service: http://<ClusterIP>:80

    def generate(self, model: str) -> Answer:
        body = json.dumps(manifests.generation_request(model, **SHORT)).encode()
        req = urllib.request.Request(
            f"{self.url}/v1/images/generations",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return Answer(r.status, r.headers.get("x-lora-pod"), json.loads(r.read()))
        except urllib.error.HTTPError as e:
            return Answer(e.code, e.headers.get("x-lora-pod"), json.loads(e.read()))

    def pod_of(self, model: str) -> str:
        (pod,) = release.ready_pods(self.h, self.ns, f"lora.dev/model={model}", 1)
        name: str = pod["metadata"]["name"]
        return name


def values(ns: str) -> Obj:
    out = manifests.local_values(ns, replicas=1)
    out["inference"]["models"] = [
        {"name": model, "model": {"path": str(MODELS_MOUNT / model)}} for model in (SD15, SDXL)
    ]
    assert out["inference"]["model"]["existingClaim"] == MODEL_CLAIM  # both models' claim
    return out


@pytest.fixture(scope="module")
def two(devcluster: Harness, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    if os.environ.get("LORA_E2E_KUBECONFIG"):
        pytest.skip("reaches the router by its ClusterIP: the local cluster only")
    h = devcluster
    ns = f"two-models-{uuid.uuid4().hex[:6]}"
    h.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    )
    folder = f"{ns}/sources"
    sources = (
        AdapterSource("ink", seed=1, folder=folder, base=SD15),
        AdapterSource("pixel", seed=2, folder=folder, base=SDXL),
    )
    try:
        release.prepare_model(h, ns, SD15)
        release.prepare_model(h, ns, SDXL)
        release.install_crd(h)
        release.install_chart(h, ns, values(ns), tmp_path_factory.mktemp("values"))
        release.prepare_adapters(h, ns, sources, "prepare-sources")
        release.ready_inference_pods(h, ns, 2)
        h.apply([manifests.adapter(s) for s in sources], ns)
        for s in sources:
            release.wait_adapter_ready(h, ns, s.name, "1/1", timeout=300)
        service = h.get(f"/api/v1/namespaces/{ns}/services/{SERVICE}")
        yield Release(h, ns, f"http://{service['spec']['clusterIP']}:80")
    finally:
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)
        with contextlib.suppress(ApiError):
            h.delete(f"/api/v1/namespaces/{ns}")


@pytest.fixture(autouse=True)
def report_logs(two: Release, request: pytest.FixtureRequest) -> None:
    request.node.stash[pytest_plugin._NAMESPACE_KEY] = two.ns
    request.node.stash[pytest_plugin._HARNESS_KEY] = two.h


def test_each_model_has_its_own_objects_and_its_adapters_only_on_its_pods(two: Release) -> None:
    h, ns = two.h, two.ns
    for model, name in DEPLOYMENTS.items():
        deployment = h.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")
        assert deployment["spec"]["selector"]["matchLabels"]["lora.dev/model"] == model
        assert (
            h.get(f"/api/v1/namespaces/{ns}/services/{name}")["spec"]["selector"]["lora.dev/model"]
            == model
        )
        h.get(f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}")
    for adapter, model in (("ink", SD15), ("pixel", SDXL)):
        status = release.adapter_status(h, ns, adapter)
        assert {p["name"] for p in status.get("pods") or ()} == {two.pod_of(model)}
        assert set(release.served_adapters(h, ns, two.pod_of(model))) >= {adapter}
    assert "pixel" not in release.served_adapters(h, ns, two.pod_of(SD15))
    assert "ink" not in release.served_adapters(h, ns, two.pod_of(SDXL))


def test_the_router_sends_each_request_to_a_pod_of_its_model(two: Release) -> None:
    pods = {model: two.pod_of(model) for model in (SD15, SDXL)}
    # A base model by name, and each model's adapter, several times over: the least-queued pod
    # would alternate between the two if the router ignored the model.
    for _ in range(3):
        for name, model in (("ink", SD15), ("pixel", SDXL), (SD15, SD15), (SDXL, SDXL)):
            answer = two.generate(name)
            assert answer.status == 200, answer.body
            assert answer.pod == pods[model], f"{name} answered by {answer.pod}"
            assert answer.body["data"][0]["b64_json"]


def test_an_adapter_whose_model_has_no_pod_is_refused_not_sent_to_the_other(two: Release) -> None:
    h, ns = two.h, two.ns
    sdxl = DEPLOYMENTS[SDXL]
    scale = f"/apis/apps/v1/namespaces/{ns}/deployments/{sdxl}/scale"
    h.merge_patch(scale, {"spec": {"replicas": 0}})
    try:
        h.wait_for(
            "the SDXL pod to leave",
            lambda: not h.pods(ns, f"lora.dev/model={SDXL}"),
            timeout=120,
        )
        answer = two.generate("pixel")
        assert answer.status == 503, answer.body
        assert f"no inference pod of base model {SDXL} is Ready" in answer.body["error"]["message"]
        assert two.generate("ink").status == 200, "the other model keeps serving"
    finally:
        h.merge_patch(scale, {"spec": {"replicas": 1}})
    back = two.pod_of(SDXL)
    # The adapter's status may still say 1/1 from before: a loss of pods alone is written once
    # it has lasted 30 s, and the pod may be back sooner. Served again is what is asserted.
    h.wait_for(
        "the new SDXL pod to serve pixel",
        lambda: two.generate("pixel").status == 200,
        timeout=300,
    )
    answer = two.generate("pixel")
    assert (answer.status, answer.pod) == (200, back)
