"""The chart end to end on the local cluster: `helm install`, an adapter applied with kubectl,
Ready N/N, generation by adapter name on every pod, a killed container and a deleted pod reconciled,
an update rolled out, the adapter deleted, `helm uninstall` leaving only the CRD.

The CRD is applied with `kubectl apply -f crds/` and the chart installed with
`crds.enabled=false`: the operator's tests apply the same CRD into the same session cluster, and a
CRD no release owns is shared by both and survives `helm uninstall` (docs/chart.md, "Install").

The model and the adapter volume are host directories behind hostPath PersistentVolumes bound to
claims the chart uses as existing claims; the test writes adapter sources onto the adapter volume,
and their URIs are those paths as the operator sees them (under the chart's volumeRoot).
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
from pathlib import Path

import pytest
from lora_devcluster import demo
from lora_devcluster.demo import MODEL_NAME, RELEASE, VOLUME_ROOT
from lora_devcluster.harness import Harness
from PIL import Image

N = 2
SERVICE = f"{RELEASE}-inference"
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"

pytestmark = pytest.mark.skipif(
    os.environ.get("LORA_E2E_EXTERNAL") == "1",
    reason="needs the local cluster (host volumes, container pids); docs/operations.md says "
    "what an external-cluster run covers",
)


def write_sources(model_dir: Path, volume_dir: Path, ns: str) -> dict[str, str]:
    """The tiny model, and two adapter sources on the volume: name -> sha256 of the weights."""
    from diffusers import DiffusionPipeline
    from lora_inference.tools.random_adapters import write_random_adapter
    from lora_inference.tools.tiny_models import write_tiny_model

    write_tiny_model(model_dir / MODEL_NAME, "sd15")
    pipe = DiffusionPipeline.from_pretrained(str(model_dir / MODEL_NAME))
    shas = {}
    for name, seed in (("a", 1), ("b", 2)):
        out = write_random_adapter(
            volume_dir / ns / "sources" / name, pipe, base_model=MODEL_NAME, seed=seed, strength=0.8
        )
        weights = (out / "pytorch_lora_weights.safetensors").read_bytes()
        shas[name] = hashlib.sha256(weights).hexdigest()
    return shas


def source_uri(ns: str, name: str) -> str:
    return str(VOLUME_ROOT / ns / "sources" / name)


def holds(ip: str, sha: str) -> bool:
    card = demo.served_adapters(ip).get("pixel-art")
    return card is not None and card["root"].endswith(f"/pixel-art/revisions/{sha}")


def pixels(png: bytes) -> bytes:
    return Image.open(io.BytesIO(png)).convert("RGB").tobytes()


def test_install_apply_generate_reconcile_update_delete_uninstall(
    devcluster: Harness, devcluster_namespace: str, tmp_path: Path
) -> None:
    h, ns = devcluster, devcluster_namespace
    model_dir, volume_dir = tmp_path / "models", tmp_path / "adapters"
    shas = write_sources(model_dir, volume_dir, ns)
    pvs = [
        demo.hostpath_claim(h, ns, "models", model_dir),
        demo.hostpath_claim(h, ns, "adapters", volume_dir),
    ]
    try:
        values = demo.local_values(ns, model_claim="models", adapter_claim="adapters", replicas=N)
        demo.install_chart(h, ns, values, tmp_path)
        pods = demo.ready_inference_pods(h, ns, N)

        # The example's shape, with this namespace's source.
        h.apply(
            {
                "apiVersion": "lora.dev/v1alpha1",
                "kind": "LoRAAdapter",
                "metadata": {"name": "pixel-art"},
                "spec": {
                    "baseModel": MODEL_NAME,
                    "source": {"uri": source_uri(ns, "a")},
                    "scale": 0.8,
                },
            },
            ns,
        )
        demo.wait_adapter_ready(h, ns, "pixel-art", f"{N}/{N}")
        table = h.kubectl("get", "lora", "-n", ns, "--no-headers").split()
        assert table[:4] == ["pixel-art", MODEL_NAME, "Ready", f"{N}/{N}"], table

        # Every pod behind the Service serves the adapter by name, different from the base.
        ips = demo.endpoint_ips(h, ns, SERVICE)
        assert sorted(p["status"]["podIP"] for p in pods) == ips
        for ip in ips:
            assert holds(ip, shas["a"])
            base = demo.generate(ip, MODEL_NAME, size=32, steps=2)
            assert pixels(demo.generate(ip, "pixel-art", size=32, steps=2)) != pixels(base)

        # A killed inference container restarts empty and gets the adapter back.
        victim = pods[0]
        (pid,) = h.container_pids(victim["metadata"]["uid"], "inference")
        os.kill(pid, signal.SIGKILL)
        h.wait_for(
            "the killed container to restart and get the adapter back",
            lambda: any(
                p["metadata"]["uid"] == victim["metadata"]["uid"]
                and p["status"]["containerStatuses"][0]["restartCount"] >= 1
                and holds(p["status"]["podIP"], shas["a"])
                for p in demo.ready_inference_pods(h, ns, N)
            ),
            timeout=180,
        )

        # A deleted pod's replacement gets it too.
        gone = pods[1]["metadata"]["name"]
        h.kubectl("delete", "pod", "-n", ns, gone, "--wait=false")
        h.wait_for(
            "the replacement pod to hold the adapter",
            lambda: (
                gone not in {p["metadata"]["name"] for p in demo.ready_inference_pods(h, ns, N)}
                and all(holds(ip, shas["a"]) for ip in demo.endpoint_ips(h, ns, SERVICE))
                and len(demo.endpoint_ips(h, ns, SERVICE)) == N
            ),
            timeout=240,
        )
        demo.wait_adapter_ready(h, ns, "pixel-art", f"{N}/{N}", timeout=120)

        # An update of the source moves every pod to the new revision.
        h.kubectl(
            "patch", "loraadapter", "pixel-art", "-n", ns, "--type=merge",
            "-p", f'{{"spec": {{"source": {{"uri": "{source_uri(ns, "b")}"}}}}}}',
        )  # fmt: skip
        ips = demo.endpoint_ips(h, ns, SERVICE)
        h.wait_for(
            "every pod to serve the new revision",
            lambda: all(holds(ip, shas["b"]) for ip in ips),
            timeout=180,
        )
        st = demo.wait_adapter_ready(h, ns, "pixel-art", f"{N}/{N}", timeout=60)
        assert st["staged"]["sha256"] == shas["b"]

        # Deleted: unloaded from every pod, then the object is gone.
        h.kubectl("delete", "loraadapter", "pixel-art", "-n", ns, "--timeout=90s")
        assert not any("pixel-art" in demo.served_adapters(ip) for ip in ips)

        # Uninstall leaves nothing of the release; the CRD stays.
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "90s"])
        h.wait_for("the release's pods to end", lambda: not h.pods(ns, INSTANCE), 90)
        left = h.kubectl(
            "get", "all,secrets,configmaps,serviceaccounts,roles,rolebindings,pvc",
            "-n", ns, "-l", INSTANCE, "-o", "name",
        )  # fmt: skip
        assert left == "", left
        cluster_wide = h.kubectl(
            "get", "clusterroles,clusterrolebindings",
            "-l", INSTANCE, "-o", "name",
        )  # fmt: skip
        assert RELEASE not in cluster_wide, cluster_wide
        assert h.get_or_none(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/loraadapters.lora.dev"
        )
    finally:
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)
        h.kubectl("delete", "pvc", "--all", "-n", ns, "--wait=false", check=False)
        h.kubectl("delete", "pv", *pvs, "--wait=false", check=False)
