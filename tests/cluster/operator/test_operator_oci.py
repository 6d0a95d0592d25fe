"""The operator (a real process, kopf against the local cluster's API server) staging oci://
adapters from a registry that wants a login (Debian's docker-registry with htpasswd, on the
cluster network's 127.0.0.1): the login from a `kubernetes.io/dockerconfigjson` Secret that
consents, the adapter Ready on an inference pod, its status naming the manifest the tag resolved
to; and each way it goes wrong a Failed adapter whose Staged condition and Warning say why: no
login, a Secret that does not consent, an unknown tag, no adapter layer. The password shows in
no status, Event or log line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_devcluster.harness import Harness

from tests.support import cluster
from tests.support import registry as reg
from tests.support.cluster import Models, Operator


@pytest.fixture
def registry(crd: Harness, tmp_path: Path) -> Iterator[reg.Registry]:
    """Started after the cluster (`crd`): in its network namespace, where the operator runs."""
    with reg.run_registry(tmp_path / "registry", "htpasswd") as r:
        yield r


def _secret(name: str, config: str, consent: bool) -> dict[str, object]:
    labels = {"lora.dev/source-credentials": "true"} if consent else {}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": labels},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": config},
    }


def test_oci_adapters_with_a_pull_secret_and_what_goes_wrong(
    crd: Harness,
    devcluster_namespace: str,
    volume: Path,
    models: Models,
    registry: reg.Registry,
    tmp_path: Path,
) -> None:
    h, ns = crd, devcluster_namespace
    folder, sha = cluster.write_adapter(models, tmp_path / "adapter", seed=5)
    result = reg.push(registry, folder, "private/pixel:v1", login=True)
    assert result.returncode == 0, result.stderr
    manifest = result.stdout.strip()  # oci://REGISTRY/private/pixel@sha256:...
    weights_only = [("application/vnd.example.weights", b"w")]
    reg.push_image(registry, "private/model:v1", weights_only, login=True)

    config = reg.docker_config(registry.address)
    h.apply([_secret("pull", config, True), _secret("pull-unlabelled", config, False)], ns)
    base = f"oci://{registry.address}/private"
    h.apply(
        cluster.inference_deployment(h.image("inference"), "inference", 1, models.root, volume),
        ns,
    )
    with Operator(
        volume=volume,
        namespaces=[ns],
        log_path=tmp_path / "op.log",
        extra=["--insecure-registry", registry.address],
    ).running() as op:
        h.apply(
            [
                cluster.adapter(
                    "pixel", f"{base}/pixel:v1", source={"secretRef": {"name": "pull"}}
                ),
                cluster.adapter("no-login", f"{base}/pixel:v1"),
                cluster.adapter(
                    "unlabelled",
                    f"{base}/pixel:v1",
                    source={"secretRef": {"name": "pull-unlabelled"}},
                ),
                cluster.adapter(
                    "no-tag", f"{base}/pixel:v9", source={"secretRef": {"name": "pull"}}
                ),
                cluster.adapter(
                    "no-layer", f"{base}/model:v1", source={"secretRef": {"name": "pull"}}
                ),
            ],
            ns,
        )
        ready = cluster.wait_phase(h, ns, "pixel", "Ready", "1/1", timeout=240)
        assert ready["status"]["staged"]["sha256"] == sha
        # The manifest the tag resolved to, kept by the API server (the CRD's schema has it).
        assert ready["status"]["staged"]["resolvedSource"] == manifest
        (ip,) = cluster.pod_ips(h, ns, 1).values()
        assert cluster.holds(ip, "pixel", sha)

        expectations = {
            "no-login": ("SourceForbidden", "needs a login"),
            "unlabelled": ("SecretNotConsented", "lora.dev/source-credentials=true"),
            "no-tag": ("SourceNotFound", "no manifest for tag v9"),
            "no-layer": ("InvalidSource", "no adapter layer"),
        }
        for name, (reason, words) in expectations.items():
            obj = cluster.wait_phase(h, ns, name, "Failed", timeout=120)
            staged = next(c for c in obj["status"]["conditions"] if c["type"] == "Staged")
            assert (staged["status"], staged["reason"]) == ("False", reason), (name, staged)
            assert words in staged["message"], (name, staged["message"])
            assert list(cluster.event_notes(h, ns, name, "Warning")) == [reason], name

        every = json.dumps(h.get(f"/apis/lora.dev/v1alpha1/namespaces/{ns}/loraadapters"))
        every += json.dumps(h.get(f"/api/v1/namespaces/{ns}/events")) + op.log()
        assert reg.PASSWORD not in every
        assert "manifest=sha256:" in op.log()  # the digest the tag resolved to, logged
