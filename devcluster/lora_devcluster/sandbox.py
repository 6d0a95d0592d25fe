"""The sandbox's own filesystem view and network, set up by its PID 1 before anything starts.

`cluster.up` starts the supervisor under `unshare` with its own PID, mount and network
namespaces (mount propagation private). Here that process makes the paths a node writes to its
own: a tmpfs on /run (containerd's state and socket, pod network namespaces, CNI leases,
iptables' lock) and on /var/log, a writable layer in the cluster's directory over /var/lib (CNI's
cache), the cluster's kubelet and containerd directories bound at their usual short paths
(sockets under a long state directory would pass the 108-byte limit of a socket path), and
files of its own over the few global kernel settings the kubelet writes. Then the pod bridge
and the routes. When the sandbox's last process exits, the kernel drops all of it.

Owns: those mounts and the network setup (pure `build_*` plans, applied by `apply_*`).
Must not: run anywhere but inside the sandbox: on the host it would mount over the host's /run.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from lora_devcluster import ns
from lora_devcluster.layout import (
    BRIDGE,
    CONTAINERD_ROOT,
    HOST_IP,
    KUBELET_ROOT,
    SERVICE_CIDR,
    Layout,
)

# Global (not per-namespace) kernel settings the kubelet writes at start even with
# protectKernelDefaults off; each gets a file of the sandbox's own bound over it.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
# Per network namespace: these change only the sandbox's network.
NETWORK_SYSCTLS = {
    "net/ipv4/ip_forward": "1",
    "net/bridge/bridge-nf-call-iptables": "1",
    "net/ipv4/conf/all/route_localnet": "1",
}


@dataclasses.dataclass(frozen=True)
class Mount:
    source: str
    target: str
    fstype: str | None
    options: str = ""
    bind: bool = False


def build_mounts(layout: Layout) -> list[Mount]:
    upper = layout.var_lib_upper
    mounts = [
        Mount("tmpfs", "/run", "tmpfs", "mode=755"),
        Mount("tmpfs", "/var/log", "tmpfs", "mode=755"),
        Mount(
            "overlay",
            "/var/lib",
            "overlay",
            f"lowerdir=/var/lib,upperdir={upper / 'upper'},workdir={upper / 'work'}",
        ),
        Mount(str(layout.kubelet_root), KUBELET_ROOT, None, bind=True),
        Mount(str(layout.containerd_root), CONTAINERD_ROOT, None, bind=True),
    ]
    for name in KUBELET_SYSCTLS:
        mounts.append(Mount(str(sysctl_copy(layout, name)), f"/proc/sys/{name}", None, bind=True))
    return mounts


def sysctl_copy(layout: Layout, name: str) -> Path:
    return layout.config / "sysctl" / name.replace("/", ".")


def build_network_commands() -> list[list[str]]:
    return [
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", f"{HOST_IP}/24", "dev", BRIDGE],
        ["ip", "link", "set", BRIDGE, "up"],
        # The node itself reaches Service addresses through kube-proxy's rules on the bridge.
        ["ip", "route", "add", SERVICE_CIDR, "dev", BRIDGE, "src", HOST_IP],
    ]


def apply_mounts(layout: Layout) -> None:
    for d in (layout.var_lib_upper / "upper", layout.var_lib_upper / "work"):
        d.mkdir(parents=True, exist_ok=True)
    for name in KUBELET_SYSCTLS:
        copy = sysctl_copy(layout, name)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(Path(f"/proc/sys/{name}").read_text())
    for d in (layout.kubelet_root, layout.containerd_root):
        d.mkdir(parents=True, exist_ok=True)
    for m in build_mounts(layout):
        if m.bind:
            if Path(m.source).is_dir():
                Path(m.target).mkdir(parents=True, exist_ok=True)  # in the /var/lib layer
            ns.bind_mount(m.source, m.target, readonly=False)
        else:
            ns.mount(m.source, m.target, m.fstype, 0, m.options)


def apply_network() -> None:
    for argv in build_network_commands():
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    for name, value in NETWORK_SYSCTLS.items():
        Path(f"/proc/sys/{name}").write_text(value)
