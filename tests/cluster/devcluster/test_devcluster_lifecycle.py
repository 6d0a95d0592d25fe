"""`lora-devcluster up/exec/down` and the pytest fixture leave nothing behind on the host (no
process, mount, cgroup, iptables rule, network device or file), also after a failing test, a
failed start and Ctrl-C; two clusters run side by side; start errors say what to do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from lora_devcluster import cgroups, cluster, images

from tests.support.phases import Phase

pytestmark = pytest.mark.slow


def require_cluster() -> None:
    """Skip (fail under CI) when this machine cannot start a cluster."""
    try:
        cluster.check_host(cluster.bin_dir())
        images.built()
    except (cluster.ClusterError, images.ImageError) as e:
        if os.environ.get("CI"):
            pytest.fail(f"devcluster unavailable under CI: {e}", pytrace=False)
        pytest.skip(str(e))


def host_state() -> dict[str, object]:
    """What a cluster could leave on the host: processes in a cluster cgroup, mounts, cgroups,
    iptables rules, network devices, and the paths a node writes by default."""
    cgroup_dirs = sorted(str(d) for h in cgroups.hierarchies() for d in h.glob("lora-devcluster-*"))
    return {
        "mounts": sorted(
            line
            for line in Path("/proc/self/mounts").read_text().splitlines()
            if "lora-devcluster" in line or "containerd" in line or "kubelet" in line
        ),
        "cgroups": cgroup_dirs,
        "iptables": subprocess.run(
            ["iptables-save"], capture_output=True, text=True, check=True
        ).stdout.count("KUBE-"),
        "links": sorted(
            line.split(":")[1].strip()
            for line in subprocess.run(
                ["ip", "-o", "link"], capture_output=True, text=True, check=True
            ).stdout.splitlines()
        ),
        "paths": [
            p
            for p in (
                "/var/lib/kubelet",
                "/var/lib/cni",
                "/var/lib/containerd",
                "/etc/cni",
                "/opt/cni",
                "/opt/containerd",
                "/run/containerd",
                "/var/log/pods",
                "/var/log/containers",
                "/tmp/hostpath_pv",
            )
            if os.path.exists(p)
        ],
    }


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


def run_pod(root: Path, name: str) -> None:
    """A container that listens on 10.244.0.N:8080, as every cluster's first pod does."""
    ref = json.loads((root / "state.json").read_text())["images"]["operator"]
    cli(
        "exec",
        "--dir",
        str(root),
        "--",
        "kubectl",
        "run",
        name,
        f"--image={ref}",
        "--image-pull-policy=Never",
        "--command",
        "--",
        "python",
        "-m",
        "http.server",
        "8080",
        "--directory",
        "/etc",
    )
    cli(
        "exec",
        "--dir",
        str(root),
        "--",
        "kubectl",
        "wait",
        f"pod/{name}",
        "--for=condition=Ready",
        "--timeout=90s",
    )


def test_up_exec_down_twice_leaves_nothing_on_the_host(tmp_path: Path, phase: Phase) -> None:
    require_cluster()
    before = host_state()
    root = tmp_path / "c"
    for round_ in (1, 2):
        phase(f"round {round_}: up, a pod and a helm release")
        out = cli("up", "--dir", str(root)).stdout
        assert "cluster ready" in out
        nodes = cli("exec", "--dir", str(root), "--", "kubectl", "get", "nodes").stdout
        assert "lora-devcluster" in nodes and " Ready " in nodes
        # A pod, so down has containers, a pod network and cgroups to clean up.
        run_pod(root, "sleeper")
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
        phase(f"round {round_}: down leaves nothing")
        running = cluster.leftovers(root)
        assert any(line.startswith("cgroup ") for line in running)  # the check sees pods
        assert "cluster stopped" in cli("down", "--dir", str(root)).stdout
        assert cluster.leftovers(root) == []
        assert host_state() == before
    phase("down again, with no cluster running")
    assert "no cluster was running" in cli("down", "--dir", str(root)).stdout


def test_two_clusters_side_by_side_do_not_collide(tmp_path: Path, phase: Phase) -> None:
    require_cluster()
    before = host_state()
    roots = [tmp_path / "one", tmp_path / "two"]
    try:
        phase("two clusters up, the same pod address in each")
        for root in roots:
            cli("up", "--dir", str(root))
        for root in roots:
            run_pod(root, "web")  # the same pod address and port in each
        for root in roots:
            out = cli(
                "exec",
                "--dir",
                str(root),
                "--",
                "kubectl",
                "get",
                "pod",
                "web",
                "-o",
                "jsonpath={.status.podIP}",
            ).stdout
            reply = cli(
                "exec",
                "--dir",
                str(root),
                "--",
                "python3",
                "-c",
                f"import urllib.request; print(urllib.request.urlopen('http://{out}:8080/hostname').read().decode())",
            ).stdout
            assert reply.strip() == "web"
        phase("a second up of a running cluster refused")
        again = cli("up", "--dir", str(roots[0]), check=False)
        assert again.returncode == 1
        assert "already running" in again.stderr and "down" in again.stderr
        phase("stopping one leaves the other working")
        # Stopping one leaves the other working.
        cli("down", "--dir", str(roots[0]))
        nodes = cli("exec", "--dir", str(roots[1]), "--", "kubectl", "get", "pods").stdout
        assert "web" in nodes and "Running" in nodes
    finally:
        for root in roots:
            cli("down", "--dir", str(root), check=False)
    phase("both down leave nothing")
    assert [cluster.leftovers(r) for r in roots] == [[], []]
    assert host_state() == before


def test_start_errors_name_what_is_wrong_and_what_to_do(tmp_path: Path) -> None:
    require_cluster()
    # Not root: a user namespace without a mapping makes this process uid 65534.
    proc = subprocess.run(
        [
            "unshare",
            "--user",
            sys.executable,
            "-m",
            "lora_devcluster.cli",
            "up",
            "--dir",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "needs root" in proc.stderr, proc.stderr
    # A binary missing.
    empty = tmp_path / "bin"
    empty.mkdir()
    with pytest.raises(cluster.ClusterError, match=r"missing binaries .*make binaries"):
        cluster.up(tmp_path / "c", binaries=empty)
    assert not (tmp_path / "c").exists()


def test_a_failed_start_tears_down_what_it_started(tmp_path: Path) -> None:
    require_cluster()
    before = host_state()
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"not an image archive")
    node_images = [*images.built(), images.Image("example/broken:1", broken, "broken", "broken")]
    root = tmp_path / "c"
    with pytest.raises(cluster.ClusterError, match=r"broken\.tar"):
        cluster.up(root, node_images=node_images, die_with_parent=True)
    assert cluster.leftovers(root) == []
    assert host_state() == before


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
             "spec": {"containers": [{"name": "c", "image": h.image("operator"),
                      "imagePullPolicy": "Never",
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


# How the inner pytest starts. Python turns SIGINT into KeyboardInterrupt only when SIGINT is at
# its default when it starts, and a blocked or ignored SIGINT survives exec: a run started from
# a non-interactive shell's background job (or a launcher that ignores SIGINT) would sleep
# through the test's Ctrl-C until communicate() times out. So the inner run gets Python's own
# handling whatever this process inherited. SIGUSR1 makes it print every thread's stack to a
# copy of its stderr (pytest's capture does not swallow it), for the report when it hangs.
_INNER_MAIN = (
    "import faulthandler, os, signal, sys, pytest; "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "faulthandler.register(signal.SIGUSR1, os.fdopen(os.dup(2), 'w'), all_threads=True); "
    "sys.exit(pytest.console_main())"
)


def _inner_pytest(tmp_path: Path, *tests: str) -> subprocess.Popen[str]:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    work = tmp_path / "tmp"
    work.mkdir()
    env = dict(os.environ, TMPDIR=str(work), MARKER=str(tmp_path / "marker"))
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _INNER_MAIN,
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


def _finish(proc: subprocess.Popen[str], tmp_path: Path, timeout: float) -> str:
    """The inner pytest's output once it exits. If it is still running after `timeout` s, or
    this test fails before (an assertion, Ctrl-C), it is killed (its cluster dies with it: the
    parent-death signal) and its cluster's directory and cgroups removed: left running, it would
    keep a cluster up for the rest of the session. A timeout reports where the run hung."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out
    except subprocess.TimeoutExpired:
        where = _hang_report(proc.pid, tmp_path / "tmp")
        out = _kill(proc, tmp_path)
        raise AssertionError(
            f"the inner pytest still ran {timeout:.0f} s later; its output (with every thread's"
            f" stack at the end):\n{out}\n{where}"
        ) from None
    finally:
        _kill(proc, tmp_path)


def _kill(proc: subprocess.Popen[str], tmp_path: Path) -> str:
    """Kill the inner pytest if it still runs, remove what its cluster left; its output."""
    if proc.poll() is not None:
        return ""
    proc.kill()
    out, _ = proc.communicate()
    for root in (tmp_path / "tmp").glob("lora-devcluster-*/cluster"):
        try:
            cluster.down(root)
        except cluster.ClusterError as e:
            print(f"cleaning up after the inner pytest: {e}")
    return out


def _hang_report(pid: int, work: Path) -> str:
    """The Python stacks of the inner pytest (on its stderr), the state, kernel wait channel and
    signal masks of it and every process under it, and the tail of its cluster's log."""
    os.kill(pid, signal.SIGUSR1)
    time.sleep(2)  # faulthandler writes from the signal handler; let it reach the pipe
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        stat = _read(f"/proc/{entry}/stat").decode(errors="replace") if entry.isdigit() else ""
        if ")" in stat:
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    lines: list[str] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += sorted(c for c, parent in parents.items() if parent == p)
        status = _read(f"/proc/{p}/status").decode(errors="replace").splitlines()
        fields = " ".join(
            line.replace("\t", "")
            for line in status
            if line.split(":")[0] in ("State", "SigBlk", "SigIgn", "SigCgt")
        )
        wchan = _read(f"/proc/{p}/wchan").decode(errors="replace")
        cmd = _read(f"/proc/{p}/cmdline").replace(b"\0", b" ").decode(errors="replace")[:150]
        lines.append(f"{p}: {fields} wchan={wchan} {cmd}")
    for log in work.glob("lora-devcluster-*/cluster/logs/supervisor.log"):
        lines += [f"---- {log}", *_read(str(log)).decode(errors="replace").splitlines()[-30:]]
    return "processes (pid: state, signal masks, wait channel, command):\n" + "\n".join(lines)


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
    require_cluster()
    proc = _inner_pytest(tmp_path, "test_fails")
    out = _finish(proc, tmp_path, timeout=240)
    assert proc.returncode == 1, out
    assert "failing on purpose" in out, out
    assert "devcluster container logs" in out
    assert "hello-from-the-pod" in out
    assert "pod talker: phase=Running" in out  # the pods section
    assert "node ready in" in out  # the supervisor log's tail
    _assert_clean(tmp_path / "tmp")


def test_ctrl_c_tears_the_cluster_down(tmp_path: Path) -> None:
    require_cluster()
    proc = _inner_pytest(tmp_path, "test_interrupted")
    deadline = time.monotonic() + 180
    try:
        while not (tmp_path / "marker").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "inner test never started"
            time.sleep(0.2)
    except BaseException:
        _kill(proc, tmp_path)  # else it sleeps 600 s more with its cluster up
        raise
    proc.send_signal(signal.SIGINT)
    out = _finish(proc, tmp_path, timeout=240)  # teardown on a loaded machine takes a while
    assert "KeyboardInterrupt" in out, out
    _assert_clean(tmp_path / "tmp")


def test_cluster_stops_after_the_last_test_that_needs_it(tmp_path: Path) -> None:
    require_cluster()
    proc = _inner_pytest(tmp_path, "test_uses_the_cluster", "test_runs_after_the_last_user")
    out = _finish(proc, tmp_path, timeout=240)
    assert proc.returncode == 0, out
    assert "2 passed" in out
    _assert_clean(tmp_path / "tmp")
