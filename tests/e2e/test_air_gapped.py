"""docs/tasks/install-air-gapped.md, run as written on the local cluster: the images mirrored
from their archives into the cluster's registry with skopeo, the chart pushed there and installed
from it, the base model copied onto a claim, an egress NetworkPolicy that leaves the release's
pods the API server and the registry alone, and an adapter pushed to the registry as an OCI
artifact, staged from `oci://` and generating.

The page's blocks after the first (which builds with a network) run as one script, in a folder
holding what the page says to carry in: the archives `make images` wrote (linked under the
page's names), the chart packaged from this tree, a tiny SD 1.5 model made here and an adapter
for it. The replacements, in order (`REPLACEMENTS`): the local registry's address and plain HTTP
(skopeo, helm and `adapter push`), the cluster's storage class and one node's access mode, the
tiny model's name and size for SDXL's, and local values for examples/values-sdxl-gpu.yaml (the
CPU, one replica, the session's CRD, the registry as an insecure one).

The control: a second registry on the node's address, holding the same artifact and allowed by
every rule of the operator's own, is refused while the NetworkPolicy stands, and serves once it
is deleted: what kept the adapter out was the policy.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from lora_demo import manifests, release
from lora_demo.manifests import MODEL_NAME, TINY_MODELS
from lora_devcluster import images
from lora_devcluster import registry as registry_mod
from lora_devcluster.harness import ApiError, Harness
from lora_devcluster.layout import HOST_IP
from lora_devcluster.nodeconfig import STORAGE_CLASS
from PIL import Image

from tests.support import ROOT
from tests.support.chart import CHART, unavailable
from tests.support.docs import Block, parse_blocks, run_script
from tests.support.registry import run_registry

PAGE = ROOT / "docs" / "tasks" / "install-air-gapped.md"
NAMESPACE = "lora"  # the page's
LOCAL_VALUES = "values-local.yaml"
VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]

REPLACEMENTS = [
    ("REGISTRY=registry.internal:5000", f"REGISTRY={registry_mod.ADDRESS}"),
    ("REGISTRY_IP=10.20.0.5", f"REGISTRY_IP={HOST_IP}"),
    ("skopeo copy ", "skopeo copy --dest-tls-verify=false "),
    ("helm push ", "helm push --plain-http "),
    ("helm install ", "helm install --plain-http "),
    ("--base-model sdxl-base", f"--base-model {MODEL_NAME} --plain-http"),
    ("storageClassName: nfs-client", f"storageClassName: {STORAGE_CLASS}"),
    ("accessModes: [ReadWriteMany]", "accessModes: [ReadWriteOnce]"),
    ("stable-diffusion-xl-base-1.0", MODEL_NAME),
    ("examples/values-sdxl-gpu.yaml", LOCAL_VALUES),
    ("sdxl-base", MODEL_NAME),
    ('"size": "1024x1024"', '"size": "64x64"'),
]

Obj = dict[str, Any]


def page_blocks() -> list[Block]:
    """The page's shell blocks after the first (the one on the connected machine)."""
    blocks = [b for b in parse_blocks(PAGE, PAGE.read_text()) if b.lang == "sh"]
    return blocks[1:]


def localized(text: str) -> str:
    for page, local in REPLACEMENTS:
        text = text.replace(page, local)
    return text


def test_the_replacements_cover_what_the_local_cluster_lacks() -> None:
    """Every replacement matches, and after them nothing names the example registry, SDXL or a
    GPU: the rest of the page runs as written."""
    text = "\n".join(b.text for b in page_blocks())
    assert len(page_blocks()) >= 6, page_blocks()
    unused = [page for page, _ in REPLACEMENTS if page not in text]
    assert unused == [], f"replacements that match nothing on the page: {unused}"
    local = localized(text)
    for gone in ("registry.internal", "sdxl", "stable-diffusion-xl", "nfs-client", "1024x1024"):
        assert gone not in local, (gone, local)
    for path in (word for word in local.split() if word.startswith("examples/")):
        assert (ROOT / path).is_file(), path


def _run(*argv: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _carry_in(h: Harness, work: Path) -> bytes:
    """What the page's first block leaves, in `work`: the image archives, the chart's package,
    the model folder and an adapter for it (its bytes returned)."""
    try:
        built = {image.role: image for image in images.built(("operator", "inference"))}
    except images.ImageError as e:
        unavailable(str(e))
    for name, image in built.items():
        (work / f"{name}-{VERSION}.tar").symlink_to(image.archive)
    h.run(["helm", "package", str(CHART), "-d", str(work)])
    model, weights = work / MODEL_NAME, work / "pixel-art.safetensors"
    cli = [sys.executable, "-m", "lora_inference.cli"]
    _run(*cli, "tiny-model", str(model), "--arch", TINY_MODELS[MODEL_NAME])
    _run(*cli, "make-adapter", str(weights), "--model", str(model), "--seed", "7",
         "--format", "kohya")  # fmt: skip
    return weights.read_bytes()


def _local_values(elsewhere: str) -> Obj:
    """examples/values-sdxl-gpu.yaml's stand-in: the tests' CPU values without their images (the
    page's image.registry names the mirrored ones), both registries plain HTTP."""
    values = manifests.local_values(NAMESPACE, replicas=1)
    del values["operator"]["image"], values["inference"]["image"]
    values["operator"]["insecureRegistries"] = [registry_mod.ADDRESS, elsewhere]
    return values


def _manifest_digest(address: str, repository: str, tag: str) -> str:
    request = urllib.request.Request(
        f"http://{address}/v2/{repository}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return str(r.headers["Docker-Content-Digest"])


def _staging_message(h: Harness, name: str) -> str:
    adapter = h.get(f"/apis/lora.dev/v1alpha1/namespaces/{NAMESPACE}/loraadapters/{name}")
    status = adapter.get("status") or {}
    assert status.get("phase") != "Ready", status
    return " ".join(c.get("message", "") for c in status.get("conditions", []))


def test_the_air_gapped_page_installs_and_serves_from_the_registry_alone(
    devcluster: Harness, tmp_path: Path
) -> None:
    if os.environ.get("LORA_E2E_KUBECONFIG"):
        pytest.skip("pushes to the local cluster's registry")
    h = devcluster
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    data = _carry_in(h, work)
    with contextlib.ExitStack() as stack:
        # Another registry on the node's address: every rule of the operator lets it in.
        elsewhere = stack.enter_context(run_registry(tmp_path / "elsewhere", host=HOST_IP))
        _run(sys.executable, "-m", "lora_operator.cli", "adapter", "push",
             str(work / "pixel-art.safetensors"), f"oci://{elsewhere.address}/loras/pixel-art:v1",
             "--plain-http", "--base-model", MODEL_NAME)  # fmt: skip
        (work / LOCAL_VALUES).write_text(yaml.safe_dump(_local_values(elsewhere.address)))
        release.install_crd(h)
        env = {**h.env, "PATH": f"{Path(sys.executable).parent}:{h.env['PATH']}"}
        script = "\n".join(localized(b.text) for b in page_blocks())
        try:
            run_script(script, work, tmp_path / "page.log", timeout=1800, env=env)
            _check_the_release(h, work, data)
            _check_the_policy_keeps_other_sources_out(h, elsewhere.address)
        finally:
            _remove_the_page_namespace(h)


def _remove_the_page_namespace(h: Harness) -> None:
    """The page's namespace gone, not only deleting, before the next test that uses the name
    (the docs' own tests do): the adapters deleted while the operator still runs (their finalizer
    is its to release; any left, with no operator, released here), then the release, then the
    namespace, waited for."""
    ns = ["-n", NAMESPACE]
    h.kubectl(*ns, "delete", "loraadapters", "--all", "--timeout=120s", check=False)
    for name in h.kubectl(*ns, "get", "loraadapters", "-o", "name", check=False).split():
        h.kubectl(*ns, "patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                  check=False)  # fmt: skip
    h.run(["helm", "uninstall", "lora-operator", *ns, "--ignore-not-found"], check=False)
    with contextlib.suppress(ApiError):
        h.delete(f"/api/v1/namespaces/{NAMESPACE}")
    h.wait_for(
        f"namespace {NAMESPACE} gone",
        lambda: h.get_or_none(f"/api/v1/namespaces/{NAMESPACE}") is None,
        timeout=180,
    )


def _check_the_release(h: Harness, work: Path, data: bytes) -> None:
    adapter = h.get(f"/apis/lora.dev/v1alpha1/namespaces/{NAMESPACE}/loraadapters/pixel-art")
    status = adapter["status"]
    assert status["phase"] == "Ready", status
    assert status["staged"]["sha256"] == hashlib.sha256(data).hexdigest(), status
    digest = _manifest_digest(registry_mod.ADDRESS, "loras/pixel-art", "v1")
    assert status["staged"]["resolvedSource"] == (
        f"oci://{registry_mod.ADDRESS}/loras/pixel-art@{digest}"
    ), status
    image = Image.open(io.BytesIO((work / "out.png").read_bytes()))
    assert image.format == "PNG" and image.size == (64, 64), (image.format, image.size)
    # Every container ran an image pulled from the mirror: its ID is the registry's.
    pods = h.pods(NAMESPACE, "app.kubernetes.io/name=lora-operator")
    components = {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods}
    assert components >= {"operator", "inference"}, components
    for pod in pods:
        for container in pod["status"].get("containerStatuses", []):
            assert container["imageID"].startswith(f"{registry_mod.ADDRESS}/lora-operator/"), (
                container
            )
    # The chart came from the registry: helm's record of where is its chart's own metadata.
    (installed,) = json.loads(h.run(["helm", "list", "-n", NAMESPACE, "-o", "json"]))
    assert installed["chart"] == f"lora-operator-{VERSION}", installed


def _check_the_policy_keeps_other_sources_out(h: Harness, elsewhere: str) -> None:
    """The same artifact from the other registry: never reached while the policy stands (the
    operator retries), staged once the policy is deleted."""
    other = {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": "pixel-art-elsewhere"},
        "spec": {
            "baseModel": MODEL_NAME,
            "source": {"uri": f"oci://{elsewhere}/loras/pixel-art:v1"},
        },
    }
    h.apply([other], NAMESPACE)
    deadline = time.monotonic() + 120
    message = ""
    while elsewhere not in message and time.monotonic() < deadline:
        time.sleep(2)
        message = _staging_message(h, "pixel-art-elsewhere")
    # Dropped where it leaves the pod: each attempt times out (a policy that rejects says
    # refused); either way the operator never reached it.
    assert f"{elsewhere}/loras/pixel-art:v1 could not be downloaded" in message, message
    # Still out after a while: the operator's retries meet the same policy.
    time.sleep(10)
    assert elsewhere in _staging_message(h, "pixel-art-elsewhere")
    h.kubectl("-n", NAMESPACE, "delete", "networkpolicy", "only-the-registry")
    # A changed spec stages again at once, without the policy now.
    h.kubectl("-n", NAMESPACE, "patch", "lora", "pixel-art-elsewhere", "--type=merge",
              "-p", json.dumps({"spec": {"scale": 0.9}}))  # fmt: skip
    release.wait_adapter_ready(h, NAMESPACE, "pixel-art-elsewhere", "1/1", timeout=180)
