"""The chart end to end on a real cluster: `helm install` with its default volumes, `helm test`,
an adapter applied with kubectl, Ready N/N, generation by adapter name on every pod and through
the Service (by its DNS name from inside the cluster too), a killed container and a deleted pod
reconciled, an update rolled out, the adapter deleted, `helm uninstall` leaving only what the
chart keeps on purpose.

Everything goes through the API server (kubectl, helm, its proxy), so the same test runs on the
local cluster (`make test`) and on kind (`make e2e-kind`). The model and the adapter sources are
written in the cluster by Jobs of the inference image (lora_demo), as the demo does.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from lora_demo import manifests, release
from lora_demo.manifests import MODEL_NAME, RELEASE, SERVICE, AdapterSource
from lora_devcluster.harness import Harness
from PIL import Image

from tests.support.phases import Phase

N = 2
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"


def holds(h: Harness, ns: str, pod: str, sha: str) -> bool:
    card = release.served_adapters(h, ns, pod).get("pixel-art")
    return card is not None and (card.get("root"), card.get("revision")) == ("pixel-art", sha)


def pixels(png: bytes) -> bytes:
    return Image.open(io.BytesIO(png)).convert("RGB").tobytes()


def weights_sha(h: Harness, ns: str, pod: str, source: AdapterSource) -> str:
    """The sha256 of a source's weights, read back through a pod that mounts the volume."""
    path = f"{source.uri}/pytorch_lora_weights.safetensors"
    out = h.kubectl("exec", "-n", ns, pod, "-c", "operator", "--", "sha256sum", path)
    return out.split()[0]


def test_install_apply_generate_reconcile_update_delete_uninstall(
    e2e: tuple[Harness, str], tmp_path: Path, phase: Phase
) -> None:
    h, ns = e2e
    # In the namespace's own folder, under sources/ so the server's resolver never takes
    # them for adapters of their own.
    folder = f"{ns}/sources"
    sources = (AdapterSource("a", seed=1, folder=folder), AdapterSource("b", seed=2, folder=folder))
    try:
        phase("install: the model, the CRD, the chart, the sources; helm test")
        release.prepare_model(h, ns)
        release.install_crd(h)
        release.install_chart(h, ns, manifests.local_values(ns, replicas=N), tmp_path)
        release.prepare_adapters(h, ns, sources, "prepare-sources")
        pods = release.ready_inference_pods(h, ns, N)
        h.run(["helm", "test", RELEASE, "-n", ns, "--timeout", "5m"])

        operator = h.pods(ns, "app.kubernetes.io/component=operator")[0]["metadata"]["name"]
        shas = {s.name: weights_sha(h, ns, operator, s) for s in sources}
        phase(f"apply the adapter -> Ready {N}/{N}")
        h.apply(
            {
                "apiVersion": "lora.dev/v1alpha1",
                "kind": "LoRAAdapter",
                "metadata": {"name": "pixel-art"},
                "spec": {"baseModel": MODEL_NAME, "source": {"uri": sources[0].uri}, "scale": 0.8},
            },
            ns,
        )
        release.wait_adapter_ready(h, ns, "pixel-art", f"{N}/{N}")
        table = h.kubectl("get", "lora", "-n", ns, "--no-headers").split()
        assert table[:4] == ["pixel-art", MODEL_NAME, "Ready", f"{N}/{N}"], table

        phase("generate on every pod, through the Service and by its DNS name")
        # Every pod serves the adapter by name, different from the base; so does the Service,
        # from outside (the API server's proxy) and from a pod by its DNS name.
        names = [p["metadata"]["name"] for p in pods]
        small = {"size": 32, "steps": 2}
        for pod in names:
            assert holds(h, ns, pod, shas["a"])
            target = release.pod_target(pod)
            base = release.generate(h, ns, target, MODEL_NAME, **small)
            assert pixels(release.generate(h, ns, target, "pixel-art", **small)) != pixels(base)
        via_service = release.generate(h, ns, release.service_target(), "pixel-art", **small)
        assert Image.open(io.BytesIO(via_service)).size == (32, 32)
        # The playground page, from the router behind the Service and from a pod, as installed.
        for target in (release.service_target(), release.pod_target(names[0])):
            status, page = h.proxy(ns, target, "/", timeout=10)
            assert status == 200 and b"<title>LoRA playground</title>" in page, (target, status)
        summary = release.generate_in_cluster(h, ns, "dns-client", "pixel-art")
        assert summary == {"status": 200, "images": 1, "seed": 42}

        phase("a killed container gets the adapter back")
        # A killed inference container restarts empty and gets the adapter back.
        victim = names[0]
        h.kill_container(ns, victim, "inference")

        def restarted_with_adapter() -> bool:
            pod = h.get(f"/api/v1/namespaces/{ns}/pods/{victim}")
            restarts = pod["status"]["containerStatuses"][0]["restartCount"]
            return restarts >= 1 and release.is_ready(pod) and holds(h, ns, victim, shas["a"])

        h.wait_for("the killed container to get the adapter back", restarted_with_adapter, 180)

        phase("a deleted pod's replacement gets it")
        # A deleted pod's replacement gets it too.
        gone = names[1]
        h.kubectl("delete", "pod", "-n", ns, gone, "--wait=false")

        def replaced() -> bool:
            current = [p["metadata"]["name"] for p in release.ready_inference_pods(h, ns, N)]
            return gone not in current and all(holds(h, ns, p, shas["a"]) for p in current)

        h.wait_for("the replacement pod to hold the adapter", replaced, timeout=240)
        release.wait_adapter_ready(h, ns, "pixel-art", f"{N}/{N}", timeout=120)

        phase("a source update moves every pod")
        # An update of the source moves every pod to the new revision.
        patch = {"spec": {"source": {"uri": sources[1].uri}}}
        h.kubectl("patch", "loraadapter", "pixel-art", "-n", ns, "--type=merge",
                  "-p", json.dumps(patch))  # fmt: skip
        current = [p["metadata"]["name"] for p in release.ready_inference_pods(h, ns, N)]
        h.wait_for(
            "every pod to serve the new revision",
            lambda: all(holds(h, ns, p, shas["b"]) for p in current),
            timeout=180,
        )
        release.wait_adapter_ready(h, ns, "pixel-art", f"{N}/{N}", timeout=60, sha256=shas["b"])

        phase("delete the adapter")
        # Deleted: unloaded from every pod, then the object is gone.
        h.kubectl("delete", "loraadapter", "pixel-art", "-n", ns, "--timeout=90s")
        assert not any("pixel-art" in release.served_adapters(h, ns, p) for p in current)

        phase("helm uninstall")
        # Uninstall leaves nothing of the release but what the chart keeps on purpose (objects
        # annotated helm.sh/resource-policy: keep); the CRD stays.
        uninstall = h.run(
            ["helm", "uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "90s"], check=False
        )
        assert "uninstalled" in uninstall, h.kubectl(
            "get", "all,pvc,pdb,events", "-n", ns, "-o", "wide", check=False
        )
        h.wait_for("the release's pods to end", lambda: not h.pods(ns, INSTANCE), 90)
        kinds = "all,secrets,configmaps,serviceaccounts,roles,rolebindings,pvc"
        left = json.loads(h.kubectl("get", kinds, "-n", ns, "-l", INSTANCE, "-o", "json"))
        unkept = [
            f"{o['kind']}/{o['metadata']['name']}"
            for o in left["items"]
            if (o["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") != "keep"
        ]
        assert unkept == []
        cluster_wide = h.kubectl("get", "clusterroles,clusterrolebindings", "-l", INSTANCE,
                                 "-o", "name")  # fmt: skip
        assert RELEASE not in cluster_wide, cluster_wide
        assert h.get_or_none(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/loraadapters.lora.dev"
        )
    finally:
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)


def test_the_example_adapter_is_the_demos_first() -> None:
    import yaml

    example = yaml.safe_load((release.ROOT / "examples" / "adapter.yaml").read_text())
    assert example["spec"]["source"]["uri"] == manifests.DEMO_ADAPTERS[0].uri
    assert example["spec"]["baseModel"] == manifests.DEMO_MODEL
    assert f"{RELEASE}-inference" == SERVICE
