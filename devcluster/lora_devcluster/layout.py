"""Where a cluster keeps its files, and the addresses and names every component agrees on.

Owns: the state directory's layout (pure paths) and the cluster's constants (node name and
address, pod and service ranges, DNS). Both sides use it: the host (`cluster`, `harness`) and
the sandbox (`supervisor`, `controlplane`, `node`).
Must not: do I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

NODE_NAME = "lora-devcluster"
HOST_IP = "10.244.0.1"  # the node's address on the pod bridge; the API server advertises it
BRIDGE = "cni0"
POD_CIDR = "10.244.0.0/24"
SERVICE_CIDR = "10.0.0.0/24"
API_SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service (first address of the range)
DNS_SERVICE_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
API_PORT = 6443
ETCD_PORT = 2379
ETCD_PEER_PORT = 2380
KUBELET_PORT = 10250
# Inside the sandbox only: /run is a private tmpfs there, so these never meet the host's.
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
CONTAINERD_STATE = "/run/containerd"
# Inside the sandbox only: the cluster's directories bound at the paths a node uses.
KUBELET_ROOT = "/var/lib/kubelet"
CONTAINERD_ROOT = "/var/lib/containerd"
NAMESPACE_MARKER_ENV = "LORA_DEVCLUSTER_DIR"


@dataclasses.dataclass(frozen=True)
class Layout:
    """The files of the cluster whose state directory is `root` (all of them under it)."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (tests, kubectl, helm, the control plane's own clients)."""
        return self.root / "kubeconfig"

    @property
    def node_kubeconfig(self) -> Path:
        """The kubelet's kubeconfig: the node's own identity (system:node:NAME)."""
        return self.root / "node.kubeconfig"

    @property
    def config(self) -> Path:
        """Generated configuration files of the node's components."""
        return self.root / "config"

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def pod_logs(self) -> Path:
        """The kubelet's podLogsDir: `<ns>_<pod>_<uid>/<container>/<restart>.log` (CRI format)."""
        return self.root / "pod-logs"

    @property
    def volumes(self) -> Path:
        """Where the default StorageClass provisions PersistentVolumes."""
        return self.root / "volumes"

    @property
    def var_lib_upper(self) -> Path:
        """The writable layer over /var/lib inside the sandbox (CNI's cache and the like)."""
        return self.root / "var-lib"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def apiserver_restarts(self) -> Path:
        """How many times the supervisor restarted the API server (SIGUSR1), once healthy."""
        return self.root / "apiserver-restarts"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def ready(self) -> Path:
        return self.root / "ready"

    @property
    def cgroup_root(self) -> str:
        """The kubelet's cgroupRoot: one per state directory, so two clusters never share a
        cgroup, and `down` knows exactly which cgroups are its own."""
        digest = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]
        return f"/lora-devcluster-{digest}"
