"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler: flags and start-up order.

Owns: the command lines (pure `build_*_args`), starting each binary and waiting until it is
healthy, with a clear error (and the log tail) when it is not.
Must not: know about the node (that is `node`); runs inside the cluster's sandbox, which the
supervisor set up.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

from lora_devcluster import certs, processes
from lora_devcluster.layout import (
    API_PORT,
    API_SERVICE_IP,
    CLUSTER_DOMAIN,
    ETCD_PEER_PORT,
    ETCD_PORT,
    HOST_IP,
    NODE_NAME,
    SERVICE_CIDR,
    Layout,
)

SERVER_NAMES = [
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    f"kubernetes.default.svc.{CLUSTER_DOMAIN}",
]
SERVER_IPS = ["127.0.0.1", HOST_IP, API_SERVICE_IP]


def build_etcd_args(bin_dir: Path, layout: Layout) -> list[str]:
    return [
        str(bin_dir / "etcd"),
        "--name=devcluster",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls=http://127.0.0.1:{ETCD_PORT}",
        f"--advertise-client-urls=http://127.0.0.1:{ETCD_PORT}",
        f"--listen-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
        f"--initial-cluster=devcluster=http://127.0.0.1:{ETCD_PEER_PORT}",
        # A test cluster: durability buys nothing and fsync costs seconds per test.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def build_apiserver_args(bin_dir: Path, pki: certs.PKI) -> list[str]:
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
        "--bind-address=0.0.0.0",
        f"--secure-port={API_PORT}",
        f"--advertise-address={HOST_IP}",
        f"--tls-cert-file={pki.server_cert}",
        f"--tls-private-key-file={pki.server_key}",
        f"--client-ca-file={pki.ca_cert}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        # logs, exec and port-forward go from here to the kubelet, which serves a certificate
        # of the cluster's CA for the node address.
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-certificate-authority={pki.ca_cert}",
        f"--kubelet-client-certificate={pki.admin_cert}",
        f"--kubelet-client-key={pki.admin_key}",
        # The aggregation layer (APIServices: custom.metrics.k8s.io from prometheus-adapter, when
        # a test starts the metrics pipeline): the API server proxies to an extension API server
        # with this client certificate and passes the caller's identity in these headers, which
        # the extension server trusts for certificates of this CA with this name (it reads all
        # of it from kube-system/extension-apiserver-authentication, which the API server writes).
        f"--requestheader-client-ca-file={pki.front_proxy_ca_cert}",
        f"--requestheader-allowed-names={certs.FRONT_PROXY_CLIENT}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.proxy_client_cert}",
        f"--proxy-client-key-file={pki.proxy_client_key}",
        "--v=1",
    ]


def build_kcm_args(bin_dir: Path, layout: Layout, pki: certs.PKI) -> list[str]:
    kc = str(layout.kubeconfig)
    return [
        str(bin_dir / "kube-controller-manager"),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--leader-elect=false",
        "--use-service-account-credentials=false",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_cert}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--bind-address=127.0.0.1",
        "--secure-port=10257",
        # A HorizontalPodAutoscaler decides every 5 s instead of 15: a test of one scales within
        # seconds of its metric moving.
        "--horizontal-pod-autoscaler-sync-period=5s",
        "--v=1",
    ]


def build_scheduler_args(bin_dir: Path, layout: Layout) -> list[str]:
    kc = str(layout.kubeconfig)
    return [
        str(bin_dir / "kube-scheduler"),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--secure-port=10259",
        "--v=1",
    ]


def _probe(url: str, context: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


async def wait_healthy(
    proc: processes.Proc, url: str, context: ssl.SSLContext | None, timeout: float
) -> None:
    await processes.wait_until(f"{proc.name} at {url}", lambda: _probe(url, context), proc, timeout)


def admin_ssl_context(pki: certs.PKI) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
    return context


async def start(bin_dir: Path, layout: Layout) -> tuple[certs.PKI, list[processes.Proc]]:
    """Generate the PKI and kubeconfigs, start etcd, the API server and the controller
    manager, in that order, each healthy before the next. Returns them in start order."""
    pki = certs.write_pki(layout.pki, SERVER_IPS, SERVER_NAMES, NODE_NAME, HOST_IP)
    server = f"https://127.0.0.1:{API_PORT}"
    certs.write_kubeconfig(layout.kubeconfig, certs.build_kubeconfig(server, pki))
    certs.write_kubeconfig(
        layout.node_kubeconfig,
        certs.build_kubeconfig(server, pki, user=(pki.node_cert, pki.node_key)),
    )
    started: list[processes.Proc] = []
    try:
        etcd = await processes.start(
            "etcd", build_etcd_args(bin_dir, layout), layout.logs / "etcd.log"
        )
        started.append(etcd)
        await wait_healthy(etcd, f"http://127.0.0.1:{ETCD_PORT}/health", None, 60)
        context = admin_ssl_context(pki)
        api = await processes.start(
            "kube-apiserver", build_apiserver_args(bin_dir, pki), layout.logs / "kube-apiserver.log"
        )
        started.append(api)
        await wait_healthy(api, f"https://127.0.0.1:{API_PORT}/readyz", context, 120)
        kcm = await processes.start(
            "kube-controller-manager",
            build_kcm_args(bin_dir, layout, pki),
            layout.logs / "kube-controller-manager.log",
        )
        started.append(kcm)
        await wait_healthy(kcm, "https://127.0.0.1:10257/healthz", _insecure(), 60)
        scheduler = await processes.start(
            "kube-scheduler",
            build_scheduler_args(bin_dir, layout),
            layout.logs / "kube-scheduler.log",
        )
        started.append(scheduler)
        await wait_healthy(scheduler, "https://127.0.0.1:10259/healthz", _insecure(), 60)
    except BaseException:
        await processes.stop_all(started)
        raise
    return pki, started


async def restart_apiserver(
    bin_dir: Path, layout: Layout, pki: certs.PKI, started: list[processes.Proc]
) -> None:
    """Stop the API server and start it again, as an upgrade or a crash would: every client's
    connections and watches break, and the data stays in etcd. Replaces it in `started`."""
    index = next(i for i, p in enumerate(started) if p.name == "kube-apiserver")
    await started[index].stop(grace=10)
    api = await processes.start(
        "kube-apiserver", build_apiserver_args(bin_dir, pki), layout.logs / "kube-apiserver.log"
    )
    started[index] = api
    await wait_healthy(api, f"https://127.0.0.1:{API_PORT}/readyz", admin_ssl_context(pki), 120)
    count = int(layout.apiserver_restarts.read_text()) if layout.apiserver_restarts.exists() else 0
    # Written whole or not at all: a test polls it (a plain write is an empty file for a moment).
    written = layout.apiserver_restarts.with_suffix(".tmp")
    written.write_text(str(count + 1))
    written.replace(layout.apiserver_restarts)


def _insecure() -> ssl.SSLContext:
    # kube-controller-manager and kube-scheduler serve /healthz with self-signed certificates.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
