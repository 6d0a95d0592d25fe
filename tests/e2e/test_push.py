"""The README's first steps as a platform team takes them: `make images` leaves the images tagged
in buildah's storage, `make push` copies them to a registry and `make chart-push` the packaged
chart, as an OCI artifact the chart installs from. The registry is a real one (Debian's
`docker-registry`: the distribution registry), on this machine's loopback over plain HTTP, and
the local cluster's own (`lora-devcluster up --registry`), which its node pulls from.

Only the operator image is pushed here (`PUSH_IMAGES=operator`): the inference image takes the
same path, and gzipping its 5 GB would cost minutes of the suite."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from lora_demo import manifests
from lora_devcluster import images
from lora_devcluster import registry as registry_mod
from lora_devcluster.harness import Harness

from tests.support import ROOT
from tests.support.chart import CHART, run_helm, unavailable

REPO = "lora-operator"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A distribution registry on 127.0.0.1 with its storage in tmp_path; `host:port`."""
    if os.geteuid() != 0 or not shutil.which("buildah"):
        unavailable("needs root and buildah (make install)")
    binary = shutil.which("docker-registry")
    if not binary:
        unavailable("no docker-registry: run `make install` (Debian's docker-registry package)")
    port = _free_port()
    config = tmp_path / "registry.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": 0.1,
                "log": {"level": "warn"},
                "storage": {"filesystem": {"rootdirectory": str(tmp_path / "storage")}},
                "http": {"addr": f"127.0.0.1:{port}"},
            }
        )
    )
    log = (tmp_path / "registry.log").open("w")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"the registry did not start: {(tmp_path / 'registry.log').read_text()}"
                    ) from None
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _make(*args: str) -> str:
    proc = subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def _get(url: str, accept: str = "application/json") -> dict[str, object]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=30) as r:
        body: dict[str, object] = json.loads(r.read())
        return body


def test_make_push_and_chart_push_to_a_registry(
    registry: str,
    helm: str,
) -> None:
    dest = f"{registry}/{REPO}"
    out = _make("push", f"REGISTRY={dest}", "PLAIN_HTTP=1", "PUSH_IMAGES=operator")
    assert "pushed" in out and f"{dest}/operator:" in out, out

    # make images (run by make push) left the image tagged as the build its archive holds.
    (operator,) = images.built(("operator",))
    spec_id = operator.archive.with_suffix(".id").read_text().strip()
    inspected = subprocess.run(
        ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", operator.ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert inspected.removeprefix("sha256:") == spec_id

    tag = operator.ref.rsplit(":", 1)[1]
    base = f"http://{registry}/v2/{REPO}/operator"
    assert _get(f"{base}/tags/list")["tags"] == [tag]
    manifest = _get(
        f"{base}/manifests/{tag}",
        "application/vnd.oci.image.manifest.v1+json, "
        "application/vnd.docker.distribution.manifest.v2+json",
    )
    config = manifest["config"]
    assert isinstance(config, dict)
    # The pushed image is the built one: its config is the image's ID.
    assert str(config["digest"]).removeprefix("sha256:") == spec_id

    out = _make("chart-push", f"REGISTRY={dest}", "PLAIN_HTTP=1")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    oci = f"oci://{dest}/lora-operator"
    shown = run_helm(helm, "show", "chart", oci, "--version", chart["version"], "--plain-http")
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["version"] == chart["version"]
    # Installing from the registry renders what the working tree renders.
    values = ["--set", f"operator.image.repository={dest}/operator"]
    values += ["--set", f"inference.image.repository={dest}/inference"]
    from_registry = run_helm(
        helm, "template", "lora-operator", oci, "--version", chart["version"], "--plain-http",
        "-n", "lora", *values,
    )  # fmt: skip
    local = run_helm(helm, "template", "lora-operator", str(CHART), "-n", "lora", *values)
    assert from_registry.returncode == 0, from_registry.stderr
    assert from_registry.stdout == local.stdout


def test_the_chart_and_its_image_install_from_the_local_clusters_registry(
    crds: Harness,
    devcluster_namespace: str,
    helm: str,
    tmp_path: Path,
) -> None:
    """`lora-devcluster up --registry` (the session's cluster has it): the chart installs from
    its registry and the node pulls the operator image from there, as a GPU cluster does; the
    image imported under its own name stays usable afterwards (same image ID, two names)."""
    h, ns = crds, devcluster_namespace
    dest = f"{registry_mod.ADDRESS}/{REPO}"
    _make("push", f"REGISTRY={dest}", "PLAIN_HTTP=1", "PUSH_IMAGES=operator")
    _make("chart-push", f"REGISTRY={dest}", "PLAIN_HTTP=1")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    operator: dict[str, object] = {
        "watchNamespaces": [ns],
        "image": {"repository": f"{dest}/operator", "pullPolicy": "IfNotPresent"},
    }
    values = {
        "crds": {"enabled": False},  # the session's CRD (the crds fixture)
        "adapterVolume": {"accessModes": ["ReadWriteOnce"]},
        "operator": operator,
        "inference": {"enabled": False},
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    argv = ["helm", "install", "lora-operator", f"oci://{dest}/lora-operator"]
    argv += ["--version", chart["version"], "--plain-http", "-n", ns]
    argv += ["-f", str(tmp_path / "values.yaml"), "--wait", "--timeout", "5m"]
    try:
        h.run(argv)
        (pod,) = h.pods(ns, "app.kubernetes.io/component=operator")
        (status,) = pod["status"]["containerStatuses"]
        # Pulled: the image's digest is the registry's, under the registry's name.
        assert status["imageID"].startswith(f"{dest}/operator@sha256:"), status
        assert status["ready"], status
        assert h.get_or_none(f"/api/v1/namespaces/{ns}/secrets/lora-operator-admin-token")
    finally:
        h.run(["helm", "uninstall", "lora-operator", "-n", ns, "--ignore-not-found"], check=False)
    # The kubelet keeps a record of what it pulled by image ID; a release naming the imported
    # image (same ID, as every other release of the suite does) must still start without a
    # registry behind that name: its hook Job and operator run.
    local_image = manifests.LOCAL_IMAGES["operator"]["repository"]
    operator["image"] = {"repository": local_image, "pullPolicy": "IfNotPresent"}
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    local = ["helm", "install", "lora-operator", str(CHART), "-n", ns]
    local += ["-f", str(tmp_path / "values.yaml"), "--wait", "--timeout", "2m"]
    try:
        h.run(local)
        (pod,) = h.pods(ns, "app.kubernetes.io/component=operator")
        (status,) = pod["status"]["containerStatuses"]
        assert status["image"].endswith("lora-operator/operator:" + chart["appVersion"]), status
        assert status["ready"], status
    finally:
        h.run(["helm", "uninstall", "lora-operator", "-n", ns, "--ignore-not-found"], check=False)
