"""An adapter published to the local cluster's registry (`lora-devcluster up --registry`) as an
OCI artifact with `lora-operator adapter push`, staged by the operator from `oci://` and Ready on
the inference pod, which generates with it. The registry speaks plain HTTP on the node's
address, so the release opens exactly that: `operator.sourceHosts`, `sourceAllowCIDRs` and
`insecureRegistries` name it.

The adapter is made in the test process for the tests' tiny model (`lora-inference tiny-model`
and `make-adapter`, the commands the prepare Job runs in the cluster), so its bytes and SHA-256
are known here; the test process is in the cluster's network namespace and reaches the registry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from lora_demo import manifests, release
from lora_demo.manifests import MODEL_NAME, RELEASE, SERVICE, TINY_MODELS
from lora_devcluster import registry as registry_mod
from lora_devcluster.harness import ApiError, Harness
from lora_devcluster.layout import HOST_IP


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_an_adapter_pushed_to_the_registry_is_staged_and_served(
    devcluster: Harness, tmp_path: Path
) -> None:
    if os.environ.get("LORA_E2E_KUBECONFIG"):
        pytest.skip("pushes to the local cluster's registry")
    h = devcluster
    ns = f"oci-{uuid.uuid4().hex[:6]}"
    model, weights = tmp_path / "model", tmp_path / "pixel.safetensors"
    python = sys.executable
    _run(
        python,
        "-m",
        "lora_inference.cli",
        "tiny-model",
        str(model),
        "--arch",
        TINY_MODELS[MODEL_NAME],
    )
    _run(python, "-m", "lora_inference.cli", "make-adapter", str(weights), "--model", str(model),
         "--seed", "7", "--format", "kohya")  # fmt: skip
    data = weights.read_bytes()
    reference = f"oci://{registry_mod.ADDRESS}/{ns}/pixel:v1"
    pushed = _run(python, "-m", "lora_operator.cli", "adapter", "push", str(weights), reference,
                  "--plain-http", "--base-model", MODEL_NAME)  # fmt: skip
    assert pushed.startswith(f"oci://{registry_mod.ADDRESS}/{ns}/pixel@sha256:")

    values = manifests.local_values(ns, replicas=1)
    values["operator"].update(
        sourceHosts=[HOST_IP],
        sourceAllowCIDRs=[f"{HOST_IP}/32"],
        insecureRegistries=[registry_mod.ADDRESS],
    )
    h.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    )
    try:
        release.prepare_model(h, ns)
        release.install_crd(h)
        release.install_chart(h, ns, values, tmp_path)
        release.ready_inference_pods(h, ns, 1)
        adapter = {
            "apiVersion": "lora.dev/v1alpha1",
            "kind": "LoRAAdapter",
            "metadata": {"name": "pixel-oci"},
            "spec": {"baseModel": MODEL_NAME, "source": {"uri": reference}, "scale": 0.8},
        }
        h.apply([adapter], ns)
        digest = hashlib.sha256(data).hexdigest()
        status = release.wait_adapter_ready(h, ns, "pixel-oci", "1/1", timeout=300, sha256=digest)
        assert status["staged"]["sha256"] == digest
        assert status["staged"]["sizeBytes"] == len(data)

        service = h.get(f"/api/v1/namespaces/{ns}/services/{SERVICE}")
        body = json.dumps(manifests.generation_request("pixel-oci", size=64, steps=2)).encode()
        req = urllib.request.Request(
            f"http://{service['spec']['clusterIP']}:80/v1/images/generations",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200
            assert json.loads(r.read())["data"][0]["b64_json"]
    finally:
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)
        with contextlib.suppress(ApiError):
            h.delete(f"/api/v1/namespaces/{ns}")
