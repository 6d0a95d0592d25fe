"""Start, find, enter and stop a local cluster from the host (CLI and pytest share this).

Owns: the checks before a start (each failure says what to install or do), the state directory,
spawning the supervisor under `unshare` (own PID, network and mount namespaces), waiting for it
to be ready, `down` (orderly stop, then SIGKILL, then removing the cluster's cgroups and its
directory), what a cluster left behind, and the binaries' location.
Must not: know about pods; the supervisor and the node run inside the namespaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from lora_devcluster import cgroups, images, ns, processes, registry
from lora_devcluster.layout import NAMESPACE_MARKER_ENV, Layout

MARKER = ".lora-devcluster"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
    "coredns",
    "local-path-provisioner",
    "kube-router",  # the NetworkPolicy enforcer (its firewall only)
    "kubectl",
    "helm",
)
# Host programs the node runs, and the Debian package that brings each (`make install`).
HOST_PROGRAMS = {
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "ip": "iproute2",
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "iptables": "iptables",
    "conntrack": "conntrack",
    "ipset": "ipset",  # kube-router's policy rules match ipsets
}
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")


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


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A running cluster, as seen from the host."""

    dir: Path
    unshare_pid: int
    bin_dir: Path
    images: Mapping[str, str]  # role (operator, inference, ...) -> the ref the node holds

    @property
    def layout(self) -> Layout:
        return Layout(self.dir)

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
    layout = Layout(root)
    try:
        state = json.loads(layout.state.read_text())
    except (OSError, ValueError):
        return None
    pid = int(state["unshare_pid"])
    if not _is_ours(pid, root):
        return None
    return Cluster(root, pid, Path(state["bin_dir"]), state.get("images", {}))


def check_host(binaries: Path) -> None:
    """Everything a start needs from the host, each missing piece named with what to do."""
    if os.geteuid() != 0:
        raise ClusterError(
            "lora-devcluster needs root: it creates PID, mount and network namespaces, "
            "cgroups and a bridge (run it with sudo or as root)"
        )
    missing = missing_binaries(binaries)
    if missing:
        raise ClusterError(
            f"missing binaries in {binaries}: {', '.join(missing)}; run `make binaries` "
            "(hack/build-binaries.sh)"
        )
    path = f"/usr/sbin:/sbin:{os.environ.get('PATH', '/usr/bin:/bin')}"
    absent = sorted(
        {pkg for prog, pkg in HOST_PROGRAMS.items() if shutil.which(prog, path=path) is None}
    )
    plugins = [p for p in CNI_PLUGINS if not Path("/usr/lib/cni", p).exists()]
    if plugins:
        absent.append("containernetworking-plugins")
    if absent:
        raise ClusterError(
            f"missing host packages: {', '.join(absent)}; run `make install` "
            f"(or apt-get install {' '.join(absent)})"
        )
    gap = kernel_gap(
        filesystems=Path("/proc/filesystems").read_text(),
        bridge_netfilter=Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists(),
        cgroup_hierarchies=bool(cgroups.hierarchies()),
    )
    if gap:
        raise ClusterError(gap)


def kernel_gap(*, filesystems: str, bridge_netfilter: bool, cgroup_hierarchies: bool) -> str | None:
    """What the kernel lacks for a node, with how to add it; None when nothing (pure)."""
    if "overlay" not in filesystems.split():
        return (
            "the kernel has no overlay filesystem (containerd's snapshotter needs it); "
            "load it with `modprobe overlay`"
        )
    if not bridge_netfilter:
        # Without it, packets between pods on the bridge skip iptables, so ClusterIPs
        # (kube-proxy's rules) do not answer from pods.
        return (
            "the kernel's bridge netfilter is not loaded (kube-proxy's Service rules need "
            "bridged traffic to pass iptables); load it with `modprobe br_netfilter`"
        )
    if not cgroup_hierarchies:
        return "no cgroup hierarchy is mounted under /sys/fs/cgroup"
    return None


def up(
    root: Path,
    *,
    binaries: Path | None = None,
    node_images: Sequence[images.Image] | None = None,
    timeout: float = 300,
    die_with_parent: bool = False,
    progress: Callable[[str], None] | None = None,
    with_registry: bool = False,
) -> Cluster:
    """Start a cluster in `root` and wait until its node is Ready, with DNS, Services and the
    default StorageClass working. `node_images` are imported into the node (default: every
    image of this project, which must be built). `die_with_parent` ties the cluster to this
    process (pytest), so it cannot outlive a killed test run. A failed start tears down what
    it started. `with_registry` starts an OCI registry on the node at registry.ADDRESS, which
    containerd pulls from (registry.py)."""
    binaries = binaries or bin_dir()
    check_host(binaries)
    if with_registry and shutil.which(registry.BINARY) is None:
        raise ClusterError(
            f"--registry needs {registry.BINARY}: run `make install` "
            f"(or apt-get install {registry.PACKAGE})"
        )
    root = root.resolve()
    if find(root) is not None:
        raise ClusterError(
            f"a cluster is already running in {root}; use it, or `lora-devcluster down"
            f" --dir {root}` first"
        )
    node_images = list(node_images) if node_images is not None else images.built()
    helper = next((i for i in node_images if i.role == "base"), None)
    if helper is None:
        raise ClusterError("the node needs the base image (helper pods of the volume provisioner)")
    if root.exists():
        _check_ours(root)
        _cleanup(root)  # a stale directory (and cgroups) from a cluster that was killed
    layout = Layout(root)
    layout.logs.mkdir(parents=True)
    (root / MARKER).write_text("a lora-devcluster state directory; `down` removes it\n")
    argv = [
        "unshare",
        "--net",
        "--pid",
        "--mount",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--propagation",
        "private",
        "--",
        sys.executable,
        "-m",
        "lora_devcluster.supervisor",
        "--dir",
        str(root),
        "--bin-dir",
        str(binaries),
        "--helper-image",
        helper.ref,
    ]
    for image in node_images:
        argv += ["--image", f"{image.ref}={image.archive}"]
    if with_registry:
        argv.append("--registry")
    env = dict(os.environ)
    env[NAMESPACE_MARKER_ENV] = str(root)
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
            preexec_fn=processes.die_with_parent if die_with_parent else None,
        )
    refs = {i.role: i.ref for i in node_images}
    state = {"unshare_pid": proc.pid, "bin_dir": str(binaries), "images": refs}
    layout.state.write_text(json.dumps(state))
    cluster = Cluster(root, proc.pid, binaries, refs)
    deadline = time.monotonic() + timeout
    if progress:
        progress(f"starting the control plane and the node in {root}")
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
    node_images: Sequence[images.Image] | None = None,
    die_with_parent: bool = False,
    progress: Callable[[str], None] | None = None,
    with_registry: bool = False,
) -> Iterator[Cluster]:
    """Start a cluster in `root`, move this thread into its network namespace (so this process,
    the threads it starts later, kubectl and helm reach the API server and pod IPs), point
    KUBECONFIG and PATH at it; on exit, however it exits, undo both and stop the cluster. The
    pytest fixture and the demo use this."""
    saved_env = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    switch: ns.NetnsSwitch | None = None
    try:
        c = up(
            root,
            binaries=binaries,
            node_images=node_images,
            die_with_parent=die_with_parent,
            progress=progress,
            with_registry=with_registry,
        )
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
    left = cgroups.remove(Layout(root).cgroup_root)
    if left:
        raise ClusterError("cgroups still in use after the cluster stopped: " + "; ".join(left))
    if root.exists():
        _check_ours(root)
        shutil.rmtree(root, ignore_errors=True)
    if root.parent == default_dir().parent:
        with contextlib.suppress(OSError):
            root.parent.rmdir()  # the per-user parent, if no other cluster is in it


def leftovers(root: Path) -> list[str]:
    """What a cluster in `root` still has on this machine: processes (by command line, the env
    marker of the node's processes, or a cgroup of the cluster's), mounts, cgroups, files.
    Empty after a clean `down`. (The cluster's network devices and iptables rules live in its
    network namespace and cannot outlive it.)"""
    root = root.resolve()
    marker = f"{NAMESPACE_MARKER_ENV}={root}".encode()
    cgroup_root = Layout(root).cgroup_root
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cgroup = Path(f"/proc/{entry}/cgroup").read_text()
        except OSError:
            continue
        if str(root).encode() in cmdline or marker in environ or f":{cgroup_root}/" in cgroup:
            args = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"process {entry}: {args}")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if str(root) in line:
            found.append(f"mount: {line}")
    found += [f"cgroup {d}" for d in cgroups.existing(cgroup_root)]
    if root.exists():
        found.append(f"directory {root}")
    return found
