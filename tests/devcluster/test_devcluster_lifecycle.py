"""`lora-devcluster up/exec/down` and the pytest fixture leave nothing behind: no process,
mount or directory, also after a failing test and after Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from lora_devcluster import cluster

pytestmark = pytest.mark.slow


def require_binaries() -> None:
    if os.geteuid() != 0:
        reason = "lora-devcluster needs root"
    else:
        missing = cluster.missing_binaries(cluster.bin_dir())
        if not missing:
            return
        reason = f"missing {', '.join(missing)}: run `make binaries`"
    if os.environ.get("CI"):
        pytest.fail(f"devcluster unavailable under CI: {reason}", pytrace=False)
    pytest.skip(reason)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "lora_devcluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"lora-devcluster {' '.join(args)} exited {proc.returncode}:\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    return proc


def test_up_exec_down_twice_leaves_nothing(tmp_path: Path) -> None:
    require_binaries()
    root = tmp_path / "c"
    for _ in range(2):
        out = cli("up", "--dir", str(root)).stdout
        assert "cluster ready" in out
        nodes = cli("exec", "--dir", str(root), "--", "kubectl", "get", "nodes").stdout
        assert "lora-devcluster" in nodes and "Ready" in nodes
        # A pod, so down has a container process, a netns holder and a mount point to clean.
        cli(
            "exec",
            "--dir",
            str(root),
            "--",
            "kubectl",
            "run",
            "sleeper",
            "--image=shell",
            "--command",
            "--",
            "sleep",
            "600",
        )
        cli(
            "exec",
            "--dir",
            str(root),
            "--",
            "kubectl",
            "wait",
            "pod/sleeper",
            "--for=condition=Ready",
            "--timeout=60s",
        )
        chart = tmp_path / "chart"
        if not chart.exists():
            (chart / "templates").mkdir(parents=True)
            (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
            (chart / "templates" / "cm.yaml").write_text(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}\n"
            )
        cli("exec", "--dir", str(root), "--", "helm", "install", "rel", str(chart), "--wait")
        listed = cli("exec", "--dir", str(root), "--", "helm", "list", "-q").stdout
        assert listed.split() == ["rel"]
        assert cluster.leftovers(root)  # sanity: the check does see a running cluster
        assert "cluster stopped" in cli("down", "--dir", str(root)).stdout
        assert cluster.leftovers(root) == []
    assert "no cluster was running" in cli("down", "--dir", str(root)).stdout


def test_exec_without_a_cluster_says_so(tmp_path: Path) -> None:
    proc = cli("exec", "--dir", str(tmp_path / "none"), "--", "true", check=False)
    assert proc.returncode == 1
    assert "no cluster running" in proc.stderr


INNER_TESTS = """
import os, time
from pathlib import Path

HOME_NETNS = os.readlink("/proc/self/ns/net")  # read at import, before any fixture ran

def _pod(h, ns):
    h.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "talker"},
             "spec": {"containers": [{"name": "c", "image": "shell",
                      "command": ["sh", "-c", "echo hello-from-the-pod; sleep 600"]}]}}, ns)
    h.wait_for("pod ready", lambda: any(c["type"] == "Ready" and c["status"] == "True"
               for c in h.get(f"/api/v1/namespaces/{ns}/pods/talker")
                   .get("status", {}).get("conditions", [])), timeout=60)
    # Ready comes when the process starts, maybe before its echo: wait for the line itself.
    h.wait_for("the pod's output", lambda: "hello-from-the-pod" in h.container_logs(ns), 30)

def test_fails(devcluster, devcluster_namespace):
    _pod(devcluster, devcluster_namespace)
    assert False, "failing on purpose"

def test_uses_the_cluster(devcluster):
    assert devcluster.get("/api/v1/nodes")["items"]

def test_runs_after_the_last_user():
    # The cluster stopped after the last test needing it: back in the host's namespace.
    assert os.readlink("/proc/self/ns/net") == HOME_NETNS
    assert list(Path(os.environ["TMPDIR"]).iterdir()) == []

def test_interrupted(devcluster, devcluster_namespace):
    _pod(devcluster, devcluster_namespace)
    Path(os.environ["MARKER"]).write_text("running")
    time.sleep(600)
"""


def _inner_pytest(tmp_path: Path, *tests: str) -> subprocess.Popen[str]:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    work = tmp_path / "tmp"
    work.mkdir()
    env = dict(os.environ, TMPDIR=str(work), MARKER=str(tmp_path / "marker"))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            *(f"{tmp_path / 'test_inner.py'}::{test}" for test in tests),
            "--rootdir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _assert_clean(work: Path) -> None:
    assert list(work.iterdir()) == [], f"left in {work}: {list(work.iterdir())}"
    leftover = [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit()
        and str(work).encode() in _read(f"/proc/{pid}/cmdline") + _read(f"/proc/{pid}/environ")
    ]
    assert leftover == []
    assert str(work) not in Path("/proc/self/mounts").read_text()


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def test_failing_test_shows_container_logs_and_leaves_nothing(tmp_path: Path) -> None:
    require_binaries()
    proc = _inner_pytest(tmp_path, "test_fails")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, out
    assert "failing on purpose" in out
    assert "devcluster container logs" in out
    assert "hello-from-the-pod" in out
    assert "pod talker: phase=Running" in out  # the pods section
    assert "cluster ready" in out  # the supervisor log's tail
    _assert_clean(tmp_path / "tmp")


def test_ctrl_c_tears_the_cluster_down(tmp_path: Path) -> None:
    require_binaries()
    proc = _inner_pytest(tmp_path, "test_interrupted")
    deadline = time.monotonic() + 180
    while not (tmp_path / "marker").exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "inner test never started"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert "KeyboardInterrupt" in out, out
    _assert_clean(tmp_path / "tmp")


def test_cluster_stops_after_the_last_test_that_needs_it(tmp_path: Path) -> None:
    require_binaries()
    proc = _inner_pytest(tmp_path, "test_uses_the_cluster", "test_runs_after_the_last_user")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "2 passed" in out
    _assert_clean(tmp_path / "tmp")
