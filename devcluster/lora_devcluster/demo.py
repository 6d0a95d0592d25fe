"""The demo (`make demo`): the chart, the operator and two adapters on the local cluster.

`python -m lora_devcluster.demo --out demo-out` starts a cluster in a temporary directory, builds a
tiny SD 1.5 model onto the model volume, `helm install`s charts/lora-operator, applies
examples/adapter.yaml and a second adapter, waits for Ready, generates base / pixel-art /
watercolor images through HTTP by adapter name, writes them and a side-by-side sheet, SIGKILLs an
inference container and times the adapter's return, prints a summary and tears everything down,
also on a failure, Ctrl-C or SIGTERM.

Owns: the demo's steps and the release helpers tests/e2e shares with it (host-path claims, chart
values for the local cluster, inference pod IPs from the EndpointSlice, generation by name).
Must not: start or stop clusters other than through `cluster.joined`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from types import FrameType
from typing import Any

import yaml

from lora_devcluster import cluster as cluster_mod
from lora_devcluster.harness import ApiError, Harness

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lora-operator"
CRDS = ROOT / "crds"
EXAMPLE_ADAPTER = ROOT / "examples" / "adapter.yaml"
RELEASE = "lora-operator"  # the chart's fullname is then the release name
MODEL_NAME = "tiny-sd15"
VOLUME_ROOT = PurePosixPath("/var/lib/lora/adapters")  # the chart's default volumeRoot
INFERENCE_LABELS = "app.kubernetes.io/component=inference"
PROMPT = "a lighthouse on a cliff at dusk"
SIZE = 64


# ---- release helpers (tests/e2e uses these too)


def hostpath_claim(h: Harness, namespace: str, name: str, host_dir: Path) -> str:
    """A PersistentVolumeClaim `name` bound to a hostPath PersistentVolume on `host_dir` (the
    local cluster has no provisioner). Returns the PV's name; delete it after the namespace."""
    pv = f"{namespace}-{name}"
    host_dir.mkdir(parents=True, exist_ok=True)
    spec = {"accessModes": ["ReadWriteMany"], "storageClassName": ""}
    h.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv},
                "spec": {
                    **spec,
                    "capacity": {"storage": "1Gi"},
                    "hostPath": {"path": str(host_dir), "type": "Directory"},
                    "claimRef": {"namespace": namespace, "name": name},
                    "persistentVolumeReclaimPolicy": "Retain",
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {**spec, "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}},
            },
        ]
    )
    return pv


def local_values(namespace: str, *, model_claim: str, adapter_claim: str, replicas: int) -> Obj:
    """Chart values for the local cluster: the tiny model on CPU, small caches, fast probes, the
    operator watching only `namespace`. The CRD is applied with kubectl (see install_chart)."""
    return {
        "crds": {"enabled": False},
        "adapterVolume": {"existingClaim": adapter_claim},
        "operator": {"watchNamespaces": [namespace], "resyncSeconds": 5},
        "inference": {
            "replicas": replicas,
            "servedModelName": MODEL_NAME,
            "model": {"existingClaim": model_claim, "path": f"/models/{MODEL_NAME}"},
            "device": "cpu",
            "dtype": "float32",
            "gpu": {"enabled": False},
            "maxLoras": 2,
            "maxCpuLoras": 4,
            "maxBatchSize": 1,
            "maxQueue": 8,
            "readinessProbe": {"initialDelaySeconds": 1, "periodSeconds": 1, "failureThreshold": 3},
            "terminationGracePeriodSeconds": 5,
        },
    }


def install_chart(h: Harness, namespace: str, values: Obj, work: Path) -> None:
    """`kubectl apply -f crds/` then `helm install --set crds.enabled=false`: the CRD belongs to
    no release, so installs in several namespaces (and the operator's tests, which apply it the
    same way) share it, and uninstalling never deletes it."""
    h.kubectl("apply", "-f", str(CRDS))
    h.kubectl("wait", "--for=condition=Established", "crd/loraadapters.lora.dev", "--timeout=60s")
    values_file = work / f"values-{namespace}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    h.run(["helm", "install", RELEASE, str(CHART), "-n", namespace, "-f", str(values_file)])


def ready_inference_pods(h: Harness, namespace: str, n: int, timeout: float = 300) -> list[Obj]:
    """Wait for exactly `n` ready, not deleting inference pods."""

    def check() -> list[Obj] | None:
        pods = [
            p
            for p in h.pods(namespace, INFERENCE_LABELS)
            if not p["metadata"].get("deletionTimestamp")
        ]
        ready = [p for p in pods if _ready(p)]
        return ready if len(ready) == n == len(pods) else None

    return h.wait_for(f"{n} ready inference pods in {namespace}", check, timeout=timeout)


def _ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def endpoint_ips(h: Harness, namespace: str, service: str) -> list[str]:
    """The ready addresses of a Service's EndpointSlices: the local cluster routes no ClusterIP,
    so clients pick a pod IP from here (as kube-proxy would)."""
    path = (
        f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        f"?labelSelector=kubernetes.io/service-name%3D{service}"
    )
    return sorted(
        address
        for eps in h.get(path)["items"]
        for e in eps.get("endpoints") or ()
        if (e.get("conditions") or {}).get("ready")
        for address in e["addresses"]
    )


def http_json(url: str, body: Obj | None = None, timeout: float = 120) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def generate(ip: str, model: str, *, size: int = SIZE, steps: int = 10, seed: int = 42) -> bytes:
    """One image by model or adapter name; the PNG bytes."""
    status, body = http_json(
        f"http://{ip}:8000/v1/images/generations",
        {
            "model": model,
            "prompt": PROMPT,
            "size": f"{size}x{size}",
            "num_inference_steps": steps,
            "seed": seed,
        },
    )
    if status != 200:
        raise RuntimeError(f"generation with {model!r} on {ip} failed ({status}): {body}")
    return base64.b64decode(body["data"][0]["b64_json"])


def served_adapters(ip: str) -> dict[str, Obj]:
    """`GET /v1/models` of one pod: adapter name -> its card (root says which revision)."""
    status, body = http_json(f"http://{ip}:8000/v1/models", timeout=10)
    if status != 200:
        return {}
    return {c["id"]: c for c in body["data"] if c["id"] != MODEL_NAME}


def adapter_status(h: Harness, namespace: str, name: str) -> Obj:
    obj = h.get_or_none(f"/apis/lora.dev/v1alpha1/namespaces/{namespace}/loraadapters/{name}")
    status: Obj = (obj or {}).get("status") or {}
    return status


def wait_adapter_ready(
    h: Harness, namespace: str, name: str, ready: str, timeout: float = 240
) -> Obj:
    def check() -> Obj | None:
        st = adapter_status(h, namespace, name)
        if st.get("phase") == "Failed":
            raise RuntimeError(f"{namespace}/{name} failed: {json.dumps(st.get('conditions'))}")
        return st if st.get("phase") == "Ready" and st.get("ready") == ready else None

    try:
        return h.wait_for(f"{namespace}/{name} to be Ready {ready}", check, timeout=timeout)
    except AssertionError as e:
        raise AssertionError(
            f"{e}; status: {json.dumps(adapter_status(h, namespace, name))}"
        ) from None


def host_path_for(uri: str, volume_host_dir: Path) -> Path:
    """Where a volume-path source (as the operator sees it, under the chart's volumeRoot) lies on
    the host directory behind the adapter volume."""
    return volume_host_dir / PurePosixPath(uri).relative_to(VOLUME_ROOT)


# ---- the demo


class Progress:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.timings: list[tuple[str, float]] = []

    def step(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f} s] {message}", flush=True)

    def timed(self, label: str, since: float) -> float:
        seconds = time.monotonic() - since
        self.timings.append((label, seconds))
        return seconds


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_demo(out: Path, work: Path, p: Progress, replicas: int) -> int:
    from lora_inference.tools.demo import _sheet
    from PIL import Image

    namespace = "lora-demo"
    volume_dir = work / "volumes" / "adapters"
    model_dir = work / "volumes" / "models"

    p.step("starting the local cluster (etcd, kube-apiserver, controller-manager, kubelet)")
    t = time.monotonic()
    with cluster_mod.joined(work / "cluster", progress=lambda m: None) as c:
        h = Harness(c)
        try:
            p.step(f"cluster up in {p.timed('cluster up', t):.1f} s")

            t = time.monotonic()
            p.step(f"building a tiny SD 1.5 model onto the model volume ({model_dir})")
            pipe = _build_model_and_adapters(model_dir, volume_dir)
            del pipe
            p.step(
                f"model and two random adapters written in {p.timed('model + adapters', t):.1f} s"
            )

            h.create(
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            )
            hostpath_claim(h, namespace, "models", model_dir)
            hostpath_claim(h, namespace, "adapters", volume_dir)
            t = time.monotonic()
            p.step(
                f"helm install {RELEASE} charts/lora-operator -n {namespace} ({replicas} replicas)"
            )
            install_chart(
                h,
                namespace,
                local_values(
                    namespace, model_claim="models", adapter_claim="adapters", replicas=replicas
                ),
                work,
            )
            ready_inference_pods(h, namespace, replicas)
            p.step(f"inference pods ready in {p.timed('helm install -> pods ready', t):.1f} s")

            t = time.monotonic()
            p.step("kubectl apply -f examples/adapter.yaml (pixel-art) and a second adapter")
            h.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE_ADAPTER))
            h.apply(_second_adapter(), namespace)
            for name in ("pixel-art", "watercolor"):
                wait_adapter_ready(h, namespace, name, f"{replicas}/{replicas}")
            p.step(f"both adapters Ready on every pod in {p.timed('apply -> Ready', t):.1f} s")
            print(h.kubectl("get", "lora", "-n", namespace), end="", flush=True)

            ips = endpoint_ips(h, namespace, f"{RELEASE}-inference")
            ip = ips[0]
            images: list[tuple[str, Image.Image]] = []
            for model, label in (
                (MODEL_NAME, "base"),
                ("pixel-art", "pixel-art"),
                ("watercolor", "watercolor"),
            ):
                t = time.monotonic()
                png = generate(ip, model)
                (out / f"{label}.png").write_bytes(png)
                images.append((label, Image.open(io.BytesIO(png)).convert("RGB")))
                seconds = p.timed(f"generate {label}", t)
                p.step(
                    f"POST {ip}:8000/v1/images/generations model={model}"
                    f" -> {out}/{label}.png ({seconds:.1f} s)"
                )
            _sheet(images).save(out / "side-by-side.png")

            victim = ready_inference_pods(h, namespace, replicas)[0]
            uid, victim_ip = victim["metadata"]["uid"], victim["status"]["podIP"]
            pids = h.container_pids(uid, "inference")
            p.step(f"SIGKILL the inference container of {victim['metadata']['name']} ({victim_ip})")
            t = time.monotonic()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)

            def reloaded() -> bool:
                pod = h.get(f"/api/v1/namespaces/{namespace}/pods/{victim['metadata']['name']}")
                restarted = any(
                    cs["restartCount"] >= 1 for cs in pod["status"]["containerStatuses"]
                )
                return restarted and {"pixel-art", "watercolor"} <= set(served_adapters(victim_ip))

            h.wait_for("the restarted container to get its adapters back", reloaded, timeout=180)
            seconds = p.timed("SIGKILL -> adapters back", t)
            p.step(f"restarted and both adapters loaded again in {seconds:.1f} s")
            generate(victim_ip, "pixel-art", steps=2)

            t = time.monotonic()
            p.step("tearing down: delete the adapters, helm uninstall, stop the cluster")
            h.kubectl("delete", "lora", "--all", "-n", namespace, "--timeout=60s")
            h.run(["helm", "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s"])
        except BaseException:
            print(h.describe_pods(namespace), file=sys.stderr)
            print(h.container_logs(namespace)[-6000:], file=sys.stderr)
            raise
    p.timed("teardown", t)
    left = cluster_mod.leftovers(work / "cluster")
    p.step("cluster stopped; " + (f"LEFT BEHIND: {left}" if left else "nothing left behind"))

    arrays = [img.tobytes() for _, img in images]
    differ = len(set(arrays)) == len(arrays)
    print("\nSummary")
    for label, seconds in p.timings:
        print(f"  {label:<28} {seconds:6.1f} s")
    print(f"  {'total':<28} {time.monotonic() - p.start:6.1f} s")
    print(f"  three images differ from each other: {differ}")
    print(f"  pictures: {out}/base.png, pixel-art.png, watercolor.png, side-by-side.png")
    return 0 if differ and not left else 1


def _build_model_and_adapters(model_dir: Path, volume_dir: Path) -> object:
    import diffusers.utils.logging
    import transformers.utils.logging
    from diffusers import DiffusionPipeline
    from lora_inference.tools.random_adapters import write_random_adapter
    from lora_inference.tools.tiny_models import write_tiny_model

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()

    write_tiny_model(model_dir / MODEL_NAME, "sd15")
    pipe = DiffusionPipeline.from_pretrained(str(model_dir / MODEL_NAME))
    # Strong random weights, so the difference shows even on a random tiny model.
    for doc, seed, text_encoder in ((_example_adapter(), 1, False), (_second_adapter(), 2, True)):
        write_random_adapter(
            host_path_for(doc["spec"]["source"]["uri"], volume_dir),
            pipe,
            base_model=MODEL_NAME,
            rank=8,
            strength=0.8,
            seed=seed,
            text_encoder=text_encoder,
        )
    return pipe


def _example_adapter() -> Obj:
    doc: Obj = yaml.safe_load(EXAMPLE_ADAPTER.read_text())
    return doc


def _second_adapter() -> Obj:
    doc = _example_adapter()
    doc["metadata"]["name"] = "watercolor"
    doc["spec"]["source"]["uri"] = str(VOLUME_ROOT / "shared" / "watercolor")
    doc["spec"]["scale"] = 1.0
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--replicas", type=int, default=2, help="inference replicas")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    # One line per step: no library warnings or progress bars in between.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    p = Progress()
    with tempfile.TemporaryDirectory(prefix="lora-demo-") as scratch:
        try:
            return run_demo(args.out.resolve(), Path(scratch), p, args.replicas)
        except (cluster_mod.ClusterError, AssertionError, RuntimeError, ApiError) as e:
            print(f"\ndemo failed after {time.monotonic() - p.start:.0f} s: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ninterrupted; the cluster was torn down", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
