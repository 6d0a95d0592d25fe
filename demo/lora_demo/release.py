"""Putting the chart and its adapters on a cluster, and talking to what runs there: the steps the
demo and the end-to-end suite share, on the local cluster and on kind alike.

Every call goes through the API server (kubectl, helm, its pod and service proxy), never to a pod
address, so nothing here depends on the machine being inside the cluster's network.

Owns: installing the CRD and the chart, running the preparation Jobs, waiting for pods and
adapters, generation and adapter listings through the proxy, a generation from inside the
cluster by the Service's DNS name.
Must not: start or stop clusters (the caller gives a Harness).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import yaml
from lora_devcluster.harness import Harness

from lora_demo import manifests
from lora_demo.manifests import INFERENCE_LABELS, MODEL_NAME, RELEASE, SERVICE, Obj

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lora-operator"
CRDS = ROOT / "crds"
INFERENCE_PORT = 8000


def install_crd(h: Harness) -> None:
    """`kubectl apply -f crds/`: the CRD belongs to no release, so installs in several
    namespaces (and the operator's tests, which apply it the same way) share it, and
    uninstalling a release never deletes it."""
    h.kubectl("apply", "-f", str(CRDS))
    h.kubectl("wait", "--for=condition=Established", "crd/loraadapters.lora.dev", "--timeout=60s")


def install_chart(
    h: Harness,
    namespace: str,
    values: Obj,
    work: Path,
    chart: str = str(CHART),
    flags: tuple[str, ...] = (),
) -> None:
    """`helm install` the chart (the working tree's, or `chart` with its `flags`: a registry's
    `oci://` reference and `--version`) with `values`."""
    values_file = work / f"values-{namespace}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    h.run(["helm", "install", RELEASE, chart, *flags, "-n", namespace, "-f", str(values_file)])


def run_job(h: Harness, namespace: str, job: Obj, timeout: float = 600) -> str:
    """Apply a Job, wait until it completes, return its log; fail with the log if it fails.
    The Job and its pod are deleted once done: a finished pod still holds its claims, which
    would keep them from being deleted."""
    name = job["metadata"]["name"]
    h.apply(job, namespace)

    def finished() -> str | None:
        status = h.get(f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}").get("status") or {}
        if status.get("succeeded"):
            return "Complete"
        return "Failed" if status.get("failed") else None

    outcome = h.wait_for(f"job {namespace}/{name} to finish", finished, timeout=timeout)
    log = h.kubectl("logs", "-n", namespace, f"job/{name}", check=False)
    h.kubectl("delete", "job", name, "-n", namespace, "--cascade=foreground", "--wait=false")
    if outcome != "Complete":
        raise RuntimeError(f"job {namespace}/{name} failed:\n{log}")
    return log


def prepare_model(h: Harness, namespace: str, model: str = MODEL_NAME) -> str:
    """`model` on the `models` claim, written by the inference image."""
    h.apply(manifests.model_claim(), namespace)
    job = manifests.prepare_job("prepare-model", h.image("inference"), model=model)
    return run_job(h, namespace, job)


def prepare_adapters(
    h: Harness, namespace: str, sources: tuple[manifests.AdapterSource, ...], job_name: str
) -> str:
    """Adapter sources onto the chart's adapter volume."""
    job = manifests.prepare_job(job_name, h.image("inference"), model=None, adapters=sources)
    return run_job(h, namespace, job)


def ready_inference_pods(h: Harness, namespace: str, n: int, timeout: float = 300) -> list[Obj]:
    """Wait for exactly `n` ready, not deleting inference pods."""
    return ready_pods(h, namespace, INFERENCE_LABELS, n, timeout)


def ready_pods(
    h: Harness,
    namespace: str,
    selector: str,
    n: int,
    timeout: float = 300,
    *,
    all_ready: bool = True,
) -> list[Obj]:
    """Wait for exactly `n` ready, not deleting pods matching the label `selector`; with
    `all_ready=False`, other pods of the selector that are not ready may be there too."""

    def check() -> list[Obj] | None:
        pods = [
            p for p in h.pods(namespace, selector) if not p["metadata"].get("deletionTimestamp")
        ]
        ready = [p for p in pods if is_ready(p)]
        return ready if len(ready) == n and (len(pods) == n or not all_ready) else None

    return h.wait_for(f"{n} ready pods {selector} in {namespace}", check, timeout=timeout)


def is_ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def adapter_status(h: Harness, namespace: str, name: str) -> Obj:
    obj = h.get_or_none(f"/apis/lora.dev/v1alpha1/namespaces/{namespace}/loraadapters/{name}")
    status: Obj = (obj or {}).get("status") or {}
    return status


def wait_adapter_ready(
    h: Harness,
    namespace: str,
    name: str,
    ready: str,
    timeout: float = 240,
    sha256: str | None = None,
) -> Obj:
    """Wait for the status to say Ready `ready` (and, given `sha256`, for that revision).

    The operator paces its status writes, so after a source change the pods may already serve
    the new revision while the status still shows the old one Ready: name the revision to wait
    for it.
    """

    def check() -> Obj | None:
        st = adapter_status(h, namespace, name)
        if st.get("phase") == "Failed":
            raise RuntimeError(f"{namespace}/{name} failed: {json.dumps(st.get('conditions'))}")
        staged = (st.get("staged") or {}).get("sha256")
        if sha256 is not None and staged != sha256:
            return None
        return st if st.get("phase") == "Ready" and st.get("ready") == ready else None

    what = f"{namespace}/{name} to be Ready {ready}" + (f" at {sha256[:12]}" if sha256 else "")
    try:
        return h.wait_for(what, check, timeout=timeout)
    except AssertionError as e:
        raise AssertionError(
            f"{e}; status: {json.dumps(adapter_status(h, namespace, name))}"
        ) from None


def pod_target(pod: str) -> str:
    return f"pods/{pod}:{INFERENCE_PORT}"


def service_target(service: str = SERVICE) -> str:
    return f"services/{service}:80"


def call(h: Harness, namespace: str, target: str, path: str, body: Obj | None = None) -> Any:
    """JSON from an inference pod or the Service (through the API server); fails on an error."""
    status, raw = h.proxy(namespace, target, path, body)
    if status != 200:
        raise RuntimeError(f"{path} on {target} answered {status}: {raw.decode(errors='replace')}")
    return json.loads(raw)


def served_adapters(h: Harness, namespace: str, pod: str) -> dict[str, Obj]:
    """`GET /v1/models` of one pod: adapter name -> its card (root says which revision; the base
    model's card, which has no parent, is left out); empty while the pod does not answer."""
    status, raw = h.proxy(namespace, pod_target(pod), "/v1/models", timeout=10)
    if status != 200:
        return {}
    return {c["id"]: c for c in json.loads(raw)["data"] if c["parent"] is not None}


def generate(h: Harness, namespace: str, target: str, model: str, **request: Any) -> bytes:
    """One image by model or adapter name; the PNG bytes."""
    body = call(
        h,
        namespace,
        target,
        "/v1/images/generations",
        manifests.generation_request(model, **request),
    )
    return base64.b64decode(body["data"][0]["b64_json"])


def generate_in_cluster(h: Harness, namespace: str, name: str, model: str) -> Obj:
    """One generation from a pod inside the cluster, by the Service's DNS name: what another
    workload of the cluster would do. Returns the pod's one-line summary."""
    url = manifests.service_url(namespace, "/v1/images/generations")
    pod = manifests.generation_pod(
        name, h.image("operator"), url, manifests.generation_request(model, steps=4)
    )
    h.apply(pod, namespace)

    def finished() -> str | None:
        phase: str | None = h.get(f"/api/v1/namespaces/{namespace}/pods/{name}")["status"].get(
            "phase"
        )
        return phase if phase in ("Succeeded", "Failed") else None

    phase = h.wait_for(f"the client pod {name} to finish", finished, timeout=300)
    log = h.kubectl("logs", "-n", namespace, name, check=False)
    if phase != "Succeeded":
        raise RuntimeError(f"generation from inside the cluster failed:\n{log}")
    summary: Obj = json.loads(log.strip().splitlines()[-1])
    return summary
