"""The node: containerd with runc and the CNI bridge, the kubelet, kube-proxy, the NetworkPolicy
enforcer (kube-router's firewall), CoreDNS and the default StorageClass's provisioner, each
configured (`nodeconfig`) and started here in that order.

Owns: writing the components' configuration files (what each holds is decided in
`nodeconfig`), starting each component and waiting until it works, importing the images into
containerd, and the objects a cluster's add-ons need (the kube-dns Service, the default
StorageClass).
Must not: start the control plane (that is `controlplane`) or touch the host: it runs inside the
sandbox the supervisor set up, where /run, /var/log and /var/lib are the cluster's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lora_devcluster import certs, cgroups, imagestore, netpolicy, processes, registry
from lora_devcluster.controlplane import admin_ssl_context, wait_healthy
from lora_devcluster.layout import (
    API_PORT,
    CONTAINERD_ROOT,
    CONTAINERD_SOCKET,
    CONTAINERD_STATE,
    NODE_NAME,
    Layout,
)
from lora_devcluster.nodeconfig import (
    KUBE_ROUTER_CHAIN,
    build_cni_config,
    build_containerd_config,
    build_corefile,
    build_dns_objects,
    build_kube_proxy_config,
    build_kube_router_args,
    build_kubelet_args,
    build_kubelet_config,
    build_local_path_args,
    build_resolv_conf,
    build_storage_objects,
    node_env,
)

Obj = dict[str, Any]


def policy_chain_exists(env: Mapping[str, str]) -> bool:
    done = subprocess.run(
        ["iptables", "-w", "-n", "-L", KUBE_ROUTER_CHAIN],
        env=dict(env),
        capture_output=True,
        timeout=30,
    )
    return done.returncode == 0


def write_configs(layout: Layout, pki: certs.PKI, helper_image: str) -> None:
    layout.config.mkdir(parents=True, exist_ok=True)
    (layout.config / "cni").mkdir(exist_ok=True)
    for d in (layout.tmp, layout.pod_logs, layout.volumes):
        d.mkdir(parents=True, exist_ok=True)
    # Pods running as any user must be able to reach their volumes' directories.
    layout.volumes.chmod(0o755)
    (layout.config / "containerd.toml").write_text(
        build_containerd_config(
            Path(CONTAINERD_ROOT),
            CONTAINERD_STATE,
            CONTAINERD_SOCKET,
            layout.config / "cni",
            registry.write_hosts(layout),
        )
    )
    (layout.config / "cni" / "10-lora-devcluster.conflist").write_text(
        json.dumps(build_cni_config(), indent=2)
    )
    (layout.config / "kubelet.yaml").write_text(yaml.safe_dump(build_kubelet_config(layout, pki)))
    (layout.config / "kube-proxy.yaml").write_text(yaml.safe_dump(build_kube_proxy_config(layout)))
    (layout.config / "Corefile").write_text(build_corefile(layout))
    (layout.config / "resolv.conf").write_text(build_resolv_conf())
    (layout.config / "addons.yaml").write_text(
        yaml.safe_dump_all([*build_dns_objects(), *build_storage_objects(layout, helper_image)])
    )


def _api_get(path: str, context: ssl.SSLContext) -> Obj | None:
    import urllib.error
    import urllib.request

    try:
        url = f"https://127.0.0.1:{API_PORT}{path}"
        with urllib.request.urlopen(url, timeout=5, context=context) as resp:
            result: Obj = json.loads(resp.read())
            return result
    except (urllib.error.URLError, OSError, ValueError):
        return None


def node_ready(context: ssl.SSLContext) -> bool:
    node = _api_get(f"/api/v1/nodes/{NODE_NAME}", context)
    conditions = ((node or {}).get("status") or {}).get("conditions") or ()
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def start(
    bin_dir: Path,
    layout: Layout,
    pki: certs.PKI,
    images: Mapping[Path, str],
    helper_image: str,
    progress: Callable[[str], object] | None = None,
    with_registry: bool = False,
) -> list[processes.Proc]:
    """Start containerd with `images` (archive -> ref) in its store, then the kubelet,
    kube-proxy, CoreDNS and the provisioner, each working before the next. Returns them in
    start order."""
    write_configs(layout, pki, helper_image)
    env = node_env(bin_dir, layout)
    ctr = ["ctr", f"--address={CONTAINERD_SOCKET}", "--namespace=k8s.io"]
    context = admin_ssl_context(pki)
    started: list[processes.Proc] = []

    async def launch(name: str, argv: list[str]) -> processes.Proc:
        proc = await processes.start(name, argv, layout.logs / f"{name}.log", env=env)
        started.append(proc)
        return proc

    try:
        await imagestore.provide(
            images,
            layout.containerd_root,
            lambda root, state, socket: build_containerd_config(
                root, state, socket, layout.config / "cni"
            ),
            env,
            layout.logs / "containerd-store.log",
            progress,
        )
        containerd = await launch(
            "containerd", ["containerd", f"--config={layout.config / 'containerd.toml'}"]
        )
        await processes.wait_until(
            "containerd", lambda: os.path.exists(CONTAINERD_SOCKET), containerd, 60
        )
        await processes.run_checked([*ctr, "version"], env)

        cgroups.create(layout.cgroup_root)
        kubelet = await launch("kubelet", build_kubelet_args(bin_dir, layout))
        await processes.wait_until("the node", lambda: node_ready(context), kubelet, 120)

        proxy = await launch(
            "kube-proxy",
            [str(bin_dir / "kube-proxy"), f"--config={layout.config / 'kube-proxy.yaml'}"],
        )
        await wait_healthy(proxy, "http://127.0.0.1:10256/healthz", None, 60)
        # NetworkPolicies: enforced when the kernel has what kube-router needs (netpolicy.py);
        # otherwise the API server accepts them and nothing enforces them (`up` says so).
        problem = await asyncio.to_thread(netpolicy.enforcement_problem)
        if problem is None:
            router = await launch("kube-router", build_kube_router_args(bin_dir, layout))
            await processes.wait_until(
                "kube-router's policy chains", lambda: policy_chain_exists(env), router, 60
            )
        elif progress:
            progress(problem)
        # The DNS Service and the default StorageClass.
        kubectl = [str(bin_dir / "kubectl"), f"--kubeconfig={layout.kubeconfig}"]
        await processes.run_checked(
            [*kubectl, "apply", "-f", str(layout.config / "addons.yaml")], env
        )
        dns = await launch(
            "coredns", [str(bin_dir / "coredns"), "-conf", str(layout.config / "Corefile")]
        )
        await wait_healthy(dns, "http://127.0.0.1:8181/ready", None, 60)
        await launch("local-path-provisioner", build_local_path_args(bin_dir, layout, helper_image))
        if with_registry:
            config = layout.config / "registry.yml"
            storage = registry.storage_dir(layout)
            config.write_text(yaml.safe_dump(registry.build_registry_config(storage)))
            reg = await launch("registry", [registry.BINARY, "serve", str(config)])
            await wait_healthy(reg, f"http://{registry.ADDRESS}/v2/", None, 60)
    except BaseException:
        await processes.stop_all(started)
        raise
    return started
