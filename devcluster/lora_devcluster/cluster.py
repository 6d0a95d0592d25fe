"""Start, find, enter and stop a local cluster from the host (CLI and pytest share this).

Owns: the state directory, spawning the supervisor under `unshare` (own PID, network and mount
namespaces), waiting for it to be ready, `down` (orderly stop, then SIGKILL, then removing the
mount points the kubelet created and the directory), and the binaries' location.
Must not: know about pods; the supervisor and the kubelet run inside the namespaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lora_devcluster import controlplane, mountpoints, ns, processes

MARKER = ".lora-devcluster"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm")
_PR_SET_PDEATHSIG = 1


class ClusterError(Exception):
    """The cluster cannot be started, found or stopped; the message says what to do."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "lora-devcluster" / "default"


def bin_dir() -> Path:
    """The directory with the built binaries: LORA_DEVCLUSTER_BIN_DIR, or the one
    hack/build-binaries.sh builds into (it prints it without building)."""
    override = os.environ.get("LORA_DEVCLUSTER_BIN_DIR")
    if override:
        return Path(override)
    script = repo_root() / "hack" / "build-binaries.sh"
    if not script.exists():
        raise ClusterError(f"{script} not found; set LORA_DEVCLUSTER_BIN_DIR to the binaries")
    out = subprocess.run([str(script), "--print-dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def missing_binaries(directory: Path) -> list[str]:
    return [b for b in BINARIES if not os.access(directory / b, os.X_OK)]


def default_image_map() -> dict[str, Any]:
    """This project's images map to its console scripts in the virtual environment that runs
    the harness; lora-devcluster/echo is the harness's own test server."""
    venv_bin = Path(sys.executable).parent
    return {
        "lora-operator/inference:*": [str(venv_bin / "lora-inference")],
        "*/lora-operator/inference:*": [str(venv_bin / "lora-inference")],
        "lora-operator/operator:*": [sys.executable, "-m", "lora_operator"],
        "*/lora-operator/operator:*": [sys.executable, "-m", "lora_operator"],
        "lora-devcluster/echo:*": [sys.executable, "-m", "lora_devcluster.echoserver"],
    }


def load_image_map(path: str | None) -> dict[str, Any]:
    """The default map, updated by a YAML/JSON file (--image-map or LORA_DEVCLUSTER_IMAGE_MAP)."""
    mapping = default_image_map()
    path = path or os.environ.get("LORA_DEVCLUSTER_IMAGE_MAP")
    if path:
        import yaml

        extra = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(extra, dict):
            raise ClusterError(f"{path}: the image map must be a mapping of image glob -> command")
        mapping.update(extra)
    return mapping


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A running cluster, as seen from the host."""

    dir: Path
    unshare_pid: int
    bin_dir: Path

    @property
    def layout(self) -> controlplane.Layout:
        return controlplane.Layout(self.dir)

    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    @property
    def netns(self) -> str:
        return f"/proc/{self.unshare_pid}/ns/net"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        return env


def _is_ours(pid: int, root: Path) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"unshare" in Path(cmdline[0].decode()).name.encode() and str(root).encode() in cmdline


def find(root: Path) -> Cluster | None:
    """The cluster running with state directory `root`, if any."""
    layout = controlplane.Layout(root)
    try:
        state = json.loads(layout.state.read_text())
    except (OSError, ValueError):
        return None
    pid = int(state["unshare_pid"])
    if not _is_ours(pid, root):
        return None
    return Cluster(root, pid, Path(state["bin_dir"]))


def _set_pdeathsig() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def up(
    root: Path,
    *,
    binaries: Path | None = None,
    image_map: Mapping[str, Any] | None = None,
    timeout: float = 180,
    die_with_parent: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Cluster:
    """Start a cluster in `root` and wait until the API server answers and the node is
    registered. `die_with_parent` ties the cluster to this process (pytest), so it cannot
    outlive a killed test run."""
    if os.geteuid() != 0:
        raise ClusterError(
            "lora-devcluster needs root (network, PID and mount namespaces, bind mounts)"
        )
    root = root.resolve()
    if find(root) is not None:
        raise ClusterError(f"a cluster is already running in {root}; `lora-devcluster down` first")
    binaries = binaries or bin_dir()
    missing = missing_binaries(binaries)
    if missing:
        raise ClusterError(
            f"missing binaries in {binaries}: {', '.join(missing)}; run `make binaries` "
            "(hack/build-binaries.sh)"
        )
    if root.exists():
        _check_ours(root)
        shutil.rmtree(root)  # a stale directory from a cluster that was killed
    layout = controlplane.Layout(root)
    layout.logs.mkdir(parents=True)
    (root / MARKER).write_text("a lora-devcluster state directory; `down` removes it\n")
    mapping = dict(image_map) if image_map is not None else load_image_map(None)
    argv = [
        "unshare",
        "--net",
        "--pid",
        "--mount",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--",
        sys.executable,
        "-m",
        "lora_devcluster.supervisor",
        "--dir",
        str(root),
        "--bin-dir",
        str(binaries),
        "--image-map",
        json.dumps(mapping),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")] if p
    )
    log_path = layout.logs / "supervisor.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=not die_with_parent,
            preexec_fn=_set_pdeathsig if die_with_parent else None,
        )
    layout.state.write_text(json.dumps({"unshare_pid": proc.pid, "bin_dir": str(binaries)}))
    cluster = Cluster(root, proc.pid, binaries)
    deadline = time.monotonic() + timeout
    if progress:
        progress(
            f"starting etcd, kube-apiserver, kube-controller-manager and the kubelet in {root}"
        )
    while not layout.ready.exists():
        if proc.poll() is not None:
            text = processes.tail(log_path, 40)
            _cleanup(root)
            raise ClusterError(f"the cluster failed to start (exit {proc.returncode}):\n{text}")
        if time.monotonic() > deadline:
            text = processes.tail(log_path, 40)
            down(root)
            raise ClusterError(f"the cluster was not ready after {timeout:.0f} s:\n{text}")
        time.sleep(0.1)
    return cluster


@contextlib.contextmanager
def joined(
    root: Path,
    *,
    binaries: Path | None = None,
    die_with_parent: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Iterator[Cluster]:
    """Start a cluster in `root`, move this thread into its network namespace (so this process,
    the threads it starts later, kubectl and helm reach the API server and pod IPs), point
    KUBECONFIG and PATH at it; on exit, however it exits, undo both and stop the cluster. The
    pytest fixture and the demo use this."""
    saved_env = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    switch: ns.NetnsSwitch | None = None
    try:
        c = up(root, binaries=binaries, die_with_parent=die_with_parent, progress=progress)
        switch = ns.NetnsSwitch(c.netns)
        switch.enter()
        os.environ.update({k: v for k, v in c.env().items() if k in saved_env})
        yield c
    finally:
        if switch is not None:
            switch.leave()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        down(root)


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Reap it if it is our child (pytest started it), else wait for it to disappear.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.1)
    return False


def down(root: Path, timeout: float = 60) -> bool:
    """Stop the cluster in `root` (if one runs) and remove everything it left: processes,
    the mount points the kubelet created, the directory. Returns whether one was running."""
    root = root.resolve()
    cluster = find(root)
    if cluster is not None:
        supervisor = children(cluster.unshare_pid)
        for pid in supervisor:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not _wait_gone(cluster.unshare_pid, timeout):
            # Killing PID 1 of the cluster's PID namespace kills every process in it.
            for pid in children(cluster.unshare_pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(cluster.unshare_pid, signal.SIGKILL)
            _wait_gone(cluster.unshare_pid, 10)
    _cleanup(root)
    return cluster is not None


def _check_ours(root: Path) -> None:
    """Refuse to delete a directory that is neither empty nor a cluster's state directory
    (`--dir ~` must never wipe a home directory)."""
    if root.is_dir() and any(root.iterdir()) and not (root / MARKER).exists():
        raise ClusterError(
            f"{root} exists and is not a lora-devcluster state directory; choose another --dir"
        )


def _cleanup(root: Path) -> None:
    if root.exists():
        _check_ours(root)
        shutil.rmtree(root, ignore_errors=True)
    # Also those of clusters that stopped before, unless a running cluster still uses them.
    mountpoints.remove_unused()
    if root.parent == default_dir().parent:
        with contextlib.suppress(OSError):
            root.parent.rmdir()  # the per-user parent, if no other cluster is in it


def leftovers(root: Path) -> list[str]:
    """What a cluster in `root` still has on this machine: processes (by command line or the
    env marker every container carries), mounts, files. Empty after a clean `down`."""
    root = root.resolve()
    marker = f"LORA_DEVCLUSTER_DIR={root}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(root).encode() in cmdline or marker in environ:
            args = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"process {entry}: {args}")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if str(root) in line:
            found.append(f"mount: {line}")
    if root.exists():
        found.append(f"directory {root}")
    return found
