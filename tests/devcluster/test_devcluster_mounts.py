"""Volume mounts whose order matters: an emptyDir at /tmp (what the chart gives every container,
whose root filesystem is read-only) while the cluster's own directory, where the kubelet keeps
every pod volume and the service-account token, is under /tmp too (the pytest fixture's
/tmp/lora-devcluster-*). Bind-mounting /tmp first must not hide the sources of later mounts, and
a mount below /tmp must land on top of the /tmp volume, not under it, as on a real node."""

from __future__ import annotations

import sys
from pathlib import Path, PurePosixPath

import pytest
from lora_devcluster.harness import Harness
from lora_devcluster.launch import image_paths


def test_an_emptydir_at_tmp_hides_no_later_mount(
    devcluster: Harness, devcluster_namespace: str, tmp_path: Path
) -> None:
    h, ns = devcluster, devcluster_namespace
    if not str(h.cluster.layout.root).startswith("/tmp/"):
        pytest.skip("the cluster's directory is not under /tmp: nothing to hide")
    data = tmp_path / "data"  # a hostPath under /tmp as well
    data.mkdir()
    (data / "hello").write_text("from the host\n")
    h.apply(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}},
        ns,
    )
    script = (
        "set -e; cat /var/run/secrets/kubernetes.io/serviceaccount/namespace; echo;"
        " cat /data/hello; cat /etc/secret/k; echo; cat /tmp/conf/k; echo;"
        " echo tmp: $(ls /tmp); touch /tmp/written; echo done"
    )
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "mounts"},
            "spec": {
                "restartPolicy": "Never",
                "volumes": [
                    {"name": "secret", "secret": {"secretName": "s"}},
                    {"name": "conf", "secret": {"secretName": "s"}},
                    {"name": "tmp", "emptyDir": {}},
                    {"name": "data", "hostPath": {"path": str(data), "type": "Directory"}},
                ],
                "containers": [
                    {
                        "name": "c",
                        "image": "shell",
                        "command": ["sh", "-c", script],
                        # /tmp/conf is listed before /tmp: it must still end up visible on top.
                        "volumeMounts": [
                            {"name": "conf", "mountPath": "/tmp/conf"},
                            {"name": "tmp", "mountPath": "/tmp"},
                            {"name": "data", "mountPath": "/data"},
                            {"name": "secret", "mountPath": "/etc/secret"},
                        ],
                    }
                ],
            },
        },
        ns,
    )

    def finished() -> str | None:
        phase = (h.get(f"/api/v1/namespaces/{ns}/pods/mounts").get("status") or {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = h.wait_for("the pod to finish", finished, timeout=60)
    log = h.kubectl("logs", "-n", ns, "mounts")
    assert phase == "Succeeded", log
    lines = log.splitlines()
    assert lines[:4] + lines[5:] == [ns, "from the host", "v", "v", "done"], log
    # /tmp holds the conf mount, and the image's paths bound back when they live under /tmp
    # (a checkout in /tmp, as CI clones it).
    image = {PurePosixPath(p).parts[2] for p in image_paths() if p.startswith("/tmp/")}
    assert lines[4].split() == ["tmp:", *sorted({"conf"} | image)], log
    # The emptyDir took the write; the host's /tmp did not.
    assert not Path("/tmp/written").exists()


def test_a_volume_over_the_repository_does_not_hide_the_image(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    """The chart's /tmp emptyDir over a checkout in /tmp (as CI clones it): the mapped image's
    command still runs from the project's virtual environment."""
    h, ns = devcluster, devcluster_namespace
    repo = Path(__file__).resolve().parents[2]
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "covered"},
            "spec": {
                "restartPolicy": "Never",
                "volumes": [{"name": "scratch", "emptyDir": {}}],
                "containers": [
                    {
                        "name": "c",
                        "image": "lora-devcluster/echo:dev",
                        "command": [
                            sys.executable,
                            "-c",
                            "import lora_devcluster, os; print('ok', os.listdir('.'))",
                        ],
                        "volumeMounts": [{"name": "scratch", "mountPath": str(repo.parent)}],
                    }
                ],
            },
        },
        ns,
    )

    def finished() -> dict | None:  # type: ignore[type-arg]
        pod = h.get(f"/api/v1/namespaces/{ns}/pods/covered")
        statuses = pod.get("status", {}).get("containerStatuses") or [{}]
        return statuses[0].get("state", {}).get("terminated")

    terminated = h.wait_for("the container to finish", finished, timeout=60)
    assert terminated["exitCode"] == 0, h.container_logs(ns)
    assert "ok" in h.container_logs(ns)
