"""The node's configuration, decided without side effects: each `build_*` returns what a
component's file or command line holds (containerd, the CNI bridge, the kubelet, kube-proxy,
kube-router's firewall, CoreDNS, the local-path provisioner), and `node_env` the environment
they run in. `node` writes these and starts the components.

Each setting that departs from a stock node says why next to it; most come from running on a
shared machine whose kernel and cgroups belong to the host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from lora_devcluster import certs
from lora_devcluster.layout import (
    BRIDGE,
    CLUSTER_DOMAIN,
    CONTAINERD_SOCKET,
    DNS_SERVICE_IP,
    HOST_IP,
    KUBELET_PORT,
    KUBELET_ROOT,
    NODE_NAME,
    POD_CIDR,
    SERVICE_CIDR,
    Layout,
)

Obj = dict[str, Any]

PAUSE_IMAGE = "localhost/lora-devcluster/pause:3.10"
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
STORAGE_CLASS = "standard"
PROVISIONER = "rancher.io/local-path"
DNS_PORT = 53


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def build_containerd_config(
    root: Path, state: str, socket: str, cni_conf_dir: Path, hosts_dir: Path | None = None
) -> str:
    """containerd's config.toml (version 2): its own root, state and socket, the local pause
    image, runc with cgroupfs, the CNI bridge configuration in `cni_conf_dir`, and registry
    hosts (`config_path`) in `hosts_dir`."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    sections: list[tuple[str, dict[str, object]]] = [
        (
            "",
            {
                "version": 2,
                "root": str(root),
                "state": state,
                # Plugins this node never uses; `opt` would write to /opt/containerd.
                "disabled_plugins": [
                    "io.containerd.internal.v1.opt",
                    "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp",
                ],
            },
        ),
        ("grpc", {"address": socket}),
        (
            cri,
            {
                "sandbox_image": PAUSE_IMAGE,
                # Root here lacks CAP_SYS_RESOURCE, so runc cannot lower oom_score_adj to the
                # kubelet's -998; without this every sandbox fails to start.
                "restrict_oom_score_adj": True,
                "disable_apparmor": True,
                "enable_selinux": False,
                # Images are imported, never pulled: there is no registry to reach.
                "disable_tcp_service": True,
            },
        ),
        (f"{cri}.containerd", {"snapshotter": "overlayfs", "default_runtime_name": "runc"}),
        (f"{cri}.containerd.runtimes.runc", {"runtime_type": "io.containerd.runc.v2"}),
        (f"{cri}.containerd.runtimes.runc.options", {"SystemdCgroup": False}),
        (
            f"{cri}.cni",
            {"bin_dir": CNI_BIN_DIR, "conf_dir": str(cni_conf_dir), "max_conf_num": 1},
        ),
    ]
    if hosts_dir is not None:
        # The local registry (lora-devcluster up --registry) over plain HTTP: registry.py.
        sections.append((f"{cri}.registry", {"config_path": str(hosts_dir)}))
    lines = []
    for name, values in sections:
        if name:
            lines.append(f"\n[{name}]")
        lines += [
            f"  {k} = {_toml_value(v)}" if name else f"{k} = {_toml_value(v)}"
            for k, v in values.items()
        ]
    return "\n".join(lines) + "\n"


def build_cni_config() -> Obj:
    """One bridge network for every pod: `cni0` is the node's side (the gateway, 10.244.0.1),
    hairpin mode lets a pod reach itself through a Service, and host-local hands out addresses
    from the pod range, keeping its leases on the sandbox's private /run."""
    return {
        "cniVersion": "1.0.0",
        "name": "lora-devcluster",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": HOST_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": "/run/cni-ipam",
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def build_kubelet_config(layout: Layout, pki: certs.PKI) -> Obj:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        # This kernel exposes cgroup v1 only; the kubelet refuses it unless told otherwise.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        # Every pod cgroup under one root of this cluster's own, so clusters never share one
        # and `down` removes exactly these.
        "cgroupRoot": layout.cgroup_root,
        "address": HOST_IP,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": str(pki.kubelet_cert),
        "tlsPrivateKeyFile": str(pki.kubelet_key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(pki.ca_cert)},
        },
        # Only the API server (a client certificate of the cluster's CA) reaches the kubelet.
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        # Not the host's resolv.conf: nothing outside the cluster is reachable from a pod.
        "resolvConf": str(layout.config / "resolv.conf"),
        "podLogsDir": str(layout.pod_logs),
        "failSwapOn": False,
        # The kernel belongs to the host: the kubelet must not tune it (the sandbox also binds
        # its own files over the few settings the kubelet writes anyway).
        "protectKernelDefaults": False,
        # Images cannot be pulled again, so never collect them; evict only when truly full.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # The kubelet checks again, by pulling, that a pod may use an image it once pulled
        # itself, and it keys that by image ID: once the node has pulled from its registry an
        # image that is also imported here under its own name (same ID), a pod naming the
        # imported name is sent to a registry that does not exist and stays in
        # ImagePullBackOff. Every image on this node is the project's, for every pod.
        "imagePullCredentialsVerificationPolicy": "NeverVerify",
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "serializeImagePulls": False,
        "kubeAPIQPS": 50,
        "kubeAPIBurst": 100,
        # Quick reactions for tests; a production node reports less often.
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "5s",
    }


def build_kubelet_args(bin_dir: Path, layout: Layout) -> list[str]:
    return [
        str(bin_dir / "kubelet"),
        f"--config={layout.config / 'kubelet.yaml'}",
        f"--kubeconfig={layout.node_kubeconfig}",
        f"--root-dir={KUBELET_ROOT}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={HOST_IP}",
        "--v=1",
    ]


def build_kube_proxy_config(layout: Layout) -> Obj:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(layout.kubeconfig)},
        "mode": "iptables",
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": POD_CIDR,
        "bindAddress": HOST_IP,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # Pods share one bridge: without masquerading, a reply from a Service's backend would
        # go straight back over the bridge, bypassing the NAT that the request went through.
        "iptables": {"masqueradeAll": True, "syncPeriod": "5s", "minSyncPeriod": "0s"},
        # Zero leaves the conntrack table, a host-wide setting, alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }


KUBE_ROUTER_HEALTH_PORT = 20244
# The chain kube-router's policy controller hooks into FORWARD: there once its rules are.
KUBE_ROUTER_CHAIN = "KUBE-ROUTER-FORWARD"


def build_kube_router_args(bin_dir: Path, layout: Layout) -> list[str]:
    """kube-router as a NetworkPolicy enforcer only: its firewall (iptables rules matching
    ipsets of pod addresses, for pods on this node) and neither its BGP router (the bridge
    carries every pod's traffic) nor its service proxy (kube-proxy's job)."""
    return [
        str(bin_dir / "kube-router"),
        f"--kubeconfig={layout.kubeconfig}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        f"--hostname-override={NODE_NAME}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--health-port={KUBE_ROUTER_HEALTH_PORT}",
        "--metrics-port=0",
        # A full resync besides the one each pod, namespace or policy change triggers.
        "--iptables-sync-period=1m",
    ]


def build_corefile(layout: Layout) -> str:
    # No `health` plugin (`ready` is what start-up waits on): it would hold 127.0.0.1:8080 in
    # the cluster's network namespace, the port the README's `kubectl port-forward` asks for.
    return f"""\
.:{DNS_PORT} {{
    bind {HOST_IP}
    errors
    ready 127.0.0.1:8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {layout.kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""


def build_dns_objects() -> list[Obj]:
    """The `kube-dns` Service at the cluster DNS address. CoreDNS runs on the node itself (like
    the control plane), so the Service has no selector and one EndpointSlice for the node
    address; kube-proxy routes 10.0.0.10:53 to it as it would to CoreDNS pods."""
    ports = [
        {"name": "dns", "port": DNS_PORT, "protocol": "UDP"},
        {"name": "dns-tcp", "port": DNS_PORT, "protocol": "TCP"},
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system"},
            "spec": {"clusterIP": DNS_SERVICE_IP, "ports": ports},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-node",
                "namespace": "kube-system",
                "labels": {"kubernetes.io/service-name": "kube-dns"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [HOST_IP], "conditions": {"ready": True}}],
            "ports": ports,
        },
    ]


def build_storage_objects(layout: Layout, helper_image: str) -> list[Obj]:
    """The default StorageClass and the provisioner's configuration: every claim gets a
    directory under the cluster's volumes/, made world-writable by a helper pod (so non-root
    pods can write, as on kind). The volumes path is shared by the node's pods, so every access
    mode, ReadWriteMany included, is supported (one node)."""
    config = {"sharedFileSystemPath": str(layout.volumes)}
    helper_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "helper-pod"},
        "spec": {
            "containers": [
                {"name": "helper-pod", "image": helper_image, "imagePullPolicy": "Never"}
            ]
        },
    }
    return [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": PROVISIONER,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "local-path-config", "namespace": "kube-system"},
            "data": {
                "config.json": json.dumps(config),
                "setup": '#!/bin/sh\nset -eu\nmkdir -m 0777 -p "$VOL_DIR"\n',
                "teardown": '#!/bin/sh\nset -eu\nrm -rf "$VOL_DIR"\n',
                "helperPod.yaml": yaml.safe_dump(helper_pod),
            },
        },
    ]


def build_local_path_args(bin_dir: Path, layout: Layout, helper_image: str) -> list[str]:
    return [
        str(bin_dir / "local-path-provisioner"),
        "start",
        f"--kubeconfig={layout.kubeconfig}",
        "--namespace=kube-system",
        "--configmap-name=local-path-config",
        f"--provisioner-name={PROVISIONER}",
        f"--helper-image={helper_image}",
        "--service-account-name=default",
    ]


def build_resolv_conf() -> str:
    return f"nameserver {DNS_SERVICE_IP}\n"


def node_env(bin_dir: Path, layout: Layout) -> dict[str, str]:
    """The environment of the node's processes: runc and iptables live in /usr/sbin, kubectl in
    the binaries' directory; temporary files stay in the cluster's directory."""
    return {
        "PATH": f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(layout.root),
        "TMPDIR": str(layout.tmp),
        "LANG": "C.UTF-8",
    }
