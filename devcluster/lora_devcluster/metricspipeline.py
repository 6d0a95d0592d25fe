"""A metrics pipeline a HorizontalPodAutoscaler can use, on a running local cluster: Debian's
Prometheus scraping every pod that asks for it (the `prometheus.io/scrape`, `/port`, `/path`
annotations), and prometheus-adapter serving `custom.metrics.k8s.io/v1beta1` from it, registered
with the API server by an APIService, with the inference pods' queue gauges as per-pod metrics
(`vllm:num_requests_waiting` as `vllm_num_requests_waiting`, and `..._running`).

Debian builds Prometheus without its Kubernetes discovery (`kubernetes_sd_configs` is not a
field it knows), so the pipeline discovers the pods itself: a thread reads them from the API
server every second and writes the annotated ones as a file_sd target file, labelled as the
usual `kubernetes_sd_configs` relabelling would (`namespace`, `pod`).

Both run as host processes in the cluster's network namespace (as the control plane does): the
API server reaches the adapter through a Service without a selector whose EndpointSlice names
the node's address, and kube-proxy's rules take it there as they take any ClusterIP; the adapter
runs as a ServiceAccount of its own with the RBAC an extension API server needs (auth
delegation, the extension-apiserver-authentication ConfigMap, reading pods), and trusts the
identity headers of the API server's front proxy (controlplane's --requestheader-* flags).

Owns: the configurations, targets and objects as data (pure `build_*`), the discovery thread,
starting the two processes and registering the APIService (`running`, a context manager that
undoes all of it), and reading a per-pod custom metric back (`pod_metrics`).
Must not: start or stop clusters; know the chart beyond the annotations and the metric names.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import re
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from lora_devcluster import certs, processes
from lora_devcluster.harness import ApiError, Harness
from lora_devcluster.layout import API_PORT, HOST_IP

Obj = dict[str, Any]

NAMESPACE = "lora-metrics"  # the adapter's ServiceAccount, Service and EndpointSlice
ADAPTER = "prometheus-adapter"  # its name on the cluster and its binary's (hack/build-binaries.sh)
PROMETHEUS = "prometheus"  # Debian's package and binary
# Ports on the node, in the cluster's network namespace (nothing of the host's): the adapter on
# the node's address, where the Service's EndpointSlice points; Prometheus on loopback, where
# the adapter and the tests read it.
ADAPTER_PORT = 16443
PROMETHEUS_PORT = 19090
PROMETHEUS_URL = f"http://127.0.0.1:{PROMETHEUS_PORT}"
SCRAPE_INTERVAL = "2s"
GROUP = "custom.metrics.k8s.io"
VERSION = "v1beta1"
APISERVICE = f"{VERSION}.{GROUP}"
# The inference server's gauges (vLLM's names) -> the per-pod metrics the adapter serves (a
# custom metric's name is a path segment: no colon).
METRICS = {
    "vllm:num_requests_waiting": "vllm_num_requests_waiting",
    "vllm:num_requests_running": "vllm_num_requests_running",
}
ANNOTATION = "prometheus.io"  # prometheus.io/scrape, /port, /path: the pods that ask
DISCOVERY_INTERVAL = 1.0  # seconds between two reads of the pods


class PipelineError(Exception):
    """The pipeline cannot start; the message says what is missing or what failed."""


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A running pipeline: where Prometheus answers (PromQL, from this network namespace) and
    the logs of both processes (for a failing test's report)."""

    prometheus_url: str
    logs: tuple[Path, ...]


# ---- pure: the configurations and objects


def build_prometheus_config(targets: Path, interval: str = SCRAPE_INTERVAL) -> Obj:
    """Prometheus's configuration: one job over the targets the pipeline's discovery writes to
    `targets` (file_sd: read again as soon as the file changes)."""
    return {
        # A scrape never takes longer than the interval (Prometheus refuses a timeout above it).
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": interval}],
            }
        ],
    }


def build_targets(pods: list[Obj]) -> list[Obj]:
    """Prometheus's targets (file_sd target groups) for `pods`: those annotated
    `prometheus.io/scrape: "true"` and `prometheus.io/port`, running with an address, scraped at
    that port and `prometheus.io/path` (default /metrics), labelled with their `namespace` and
    `pod` (the adapter maps those labels to the objects). What `kubernetes_sd_configs` (role pod)
    and the usual relabelling give, which Debian's Prometheus cannot: it is built without the
    Kubernetes discovery."""
    groups = []
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        annotations = meta.get("annotations") or {}
        port = annotations.get(f"{ANNOTATION}/port", "")
        # A finished pod's address may be another pod's by now; a pending one has none yet.
        if (
            annotations.get(f"{ANNOTATION}/scrape") != "true"
            or not port.isdigit()
            or status.get("phase") != "Running"
            or not status.get("podIP")
        ):
            continue
        labels = {
            "__metrics_path__": annotations.get(f"{ANNOTATION}/path") or "/metrics",
            "namespace": meta["namespace"],
            "pod": meta["name"],
        }
        groups.append({"targets": [f"{status['podIP']}:{port}"], "labels": labels})
    return sorted(groups, key=lambda g: (g["labels"]["namespace"], g["labels"]["pod"]))


def build_adapter_config(metrics: Mapping[str, str] = METRICS) -> Obj:
    """prometheus-adapter's rules: each of `metrics` (a Prometheus series name -> the custom
    metric's name) as a per-pod metric, the sum of the pod's series (the gauges carry a
    `model_name` label; a pod serves one model)."""
    prefixes = {series.split(":", 1)[0] for series in metrics}
    if len(prefixes) != 1 or any(
        custom != series.replace(":", "_", 1) for series, custom in metrics.items()
    ):
        raise ValueError(f"every metric must be PREFIX:NAME served as PREFIX_NAME: {metrics}")
    (prefix,) = prefixes
    names = "|".join(sorted(metrics))
    return {
        "rules": [
            {
                "seriesQuery": f'{{__name__=~"{names}",namespace!="",pod!=""}}',
                "resources": {
                    "overrides": {
                        "namespace": {"resource": "namespace"},
                        "pod": {"resource": "pod"},
                    }
                },
                "name": {"matches": f"^{prefix}:(.*)$", "as": f"{prefix}_${{1}}"},
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
            }
        ]
    }


def build_adapter_args(
    binary: Path, *, config: Path, kubeconfig: Path, cert: Path, key: Path
) -> list[str]:
    """The adapter's command line: its rules, Prometheus on loopback, the API server through
    `kubeconfig` (its ServiceAccount's token: listing pods, delegating authentication and
    authorization), serving on the node's address with `cert`."""
    return [
        str(binary),
        f"--config={config}",
        f"--prometheus-url={PROMETHEUS_URL}/",
        # A metric whose first series appear after the start (the pods come later) is served
        # within seconds, not the default 10 minutes.
        "--metrics-relist-interval=5s",
        "--metrics-max-age=1m",
        f"--lister-kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={HOST_IP}",
        f"--secure-port={ADAPTER_PORT}",
        f"--tls-cert-file={cert}",
        f"--tls-private-key-file={key}",
        "--v=1",
    ]


def adapter_dns_names() -> list[str]:
    """The names the API server checks the adapter's certificate for (the Service's)."""
    return [f"{ADAPTER}.{NAMESPACE}.svc", f"{ADAPTER}.{NAMESPACE}.svc.cluster.local"]


def build_adapter_objects() -> list[Obj]:
    """What the adapter needs on the cluster before it starts: its namespace and ServiceAccount,
    the RBAC of an extension API server (read the objects its metrics describe, review tokens
    and access, read kube-system/extension-apiserver-authentication), the HPA controller's right
    to read the metrics (on a cluster whose controllers run as their own ServiceAccounts), and
    the Service with its EndpointSlice to the node's address, where the adapter listens."""
    sa = {"kind": "ServiceAccount", "name": ADAPTER, "namespace": NAMESPACE}
    rbac = "rbac.authorization.k8s.io/v1"

    def cluster_binding(name: str, role: str, subject: Obj) -> Obj:
        return {
            "apiVersion": rbac,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role,
            },
            "subjects": [subject],
        }

    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": ADAPTER, "namespace": NAMESPACE},
        },
        {
            "apiVersion": rbac,
            "kind": "ClusterRole",
            "metadata": {"name": f"lora-devcluster:{ADAPTER}"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["nodes", "namespaces", "pods", "services"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        cluster_binding(f"lora-devcluster:{ADAPTER}", f"lora-devcluster:{ADAPTER}", sa),
        cluster_binding(f"lora-devcluster:{ADAPTER}:auth-delegator", "system:auth-delegator", sa),
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {
                "name": f"lora-devcluster:{ADAPTER}:auth-reader",
                "namespace": "kube-system",
            },
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "extension-apiserver-authentication-reader",
            },
            "subjects": [sa],
        },
        {
            "apiVersion": rbac,
            "kind": "ClusterRole",
            "metadata": {"name": "lora-devcluster:custom-metrics-reader"},
            "rules": [{"apiGroups": [GROUP], "resources": ["*"], "verbs": ["get", "list"]}],
        },
        cluster_binding(
            "lora-devcluster:hpa-custom-metrics",
            "lora-devcluster:custom-metrics-reader",
            {
                "kind": "ServiceAccount",
                "name": "horizontal-pod-autoscaler",
                "namespace": "kube-system",
            },
        ),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ADAPTER, "namespace": NAMESPACE},
            # No selector: the adapter is no pod; the EndpointSlice below says where it is.
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": ADAPTER_PORT}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": ADAPTER,
                "namespace": NAMESPACE,
                "labels": {
                    "kubernetes.io/service-name": ADAPTER,
                    # Not the EndpointSlice controller's: it leaves the slice alone.
                    "endpointslice.kubernetes.io/managed-by": "lora-devcluster",
                },
            },
            "addressType": "IPv4",
            "ports": [{"name": "https", "port": ADAPTER_PORT, "protocol": "TCP"}],
            "endpoints": [{"addresses": [HOST_IP], "conditions": {"ready": True}}],
        },
    ]


def build_apiservice(ca_bundle: bytes) -> Obj:
    """The APIService that sends custom.metrics.k8s.io/v1beta1 to the adapter's Service,
    checking its certificate against `ca_bundle` (the cluster's CA, which signed it)."""
    return {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": APISERVICE},
        "spec": {
            "group": GROUP,
            "version": VERSION,
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
            "service": {"name": ADAPTER, "namespace": NAMESPACE, "port": 443},
            "caBundle": base64.b64encode(ca_bundle).decode(),
        },
    }


def build_token_kubeconfig(server: str, ca_bundle: bytes, token: str) -> Obj:
    """A kubeconfig for `server` authenticating with a bearer `token` (a ServiceAccount's)."""
    name = "lora-devcluster"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_bundle).decode(),
                },
            }
        ],
        "users": [{"name": ADAPTER, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": ADAPTER}}],
        "current-context": name,
    }


_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(m|k|M|G)?$")
_SUFFIX = {None: Decimal(1), "m": Decimal("0.001"), "k": Decimal(1000), "M": Decimal(10**6)}
_SUFFIX["G"] = Decimal(10**9)


def parse_quantity(text: str) -> float:
    """A Kubernetes quantity as the custom metrics API writes one (`0`, `2`, `1500m`)."""
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"not a quantity the metrics API writes: {text!r}")
    return float(Decimal(match.group(1)) * _SUFFIX[match.group(2)])


# ---- the processes


def missing(bin_dir: Path) -> str | None:
    """What the pipeline lacks on this machine, with what to do; None when nothing."""
    absent = []
    if shutil.which(PROMETHEUS) is None:
        absent.append(f"{PROMETHEUS} (run `make install`: Debian's prometheus package)")
    if not (bin_dir / ADAPTER).is_file():
        absent.append(f"{bin_dir / ADAPTER} (run `make binaries`: hack/build-binaries.sh)")
    return "the metrics pipeline needs " + " and ".join(absent) if absent else None


def _get(url: str, context: ssl.SSLContext | None = None) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        # Started from this thread, in the cluster's network namespace it joined; killed with it.
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=processes.die_with_parent,
        )


class _Discovery:
    """Reads the cluster's pods every DISCOVERY_INTERVAL seconds on a thread of its own and
    writes their targets to `path` when they change, whole (a temporary file renamed over it:
    Prometheus never reads half a file). An API server that does not answer for a while (a test
    restarts it) leaves the last targets in place."""

    def __init__(self, h: Harness, path: Path) -> None:
        self._h, self._path = h, path
        self._last: str | None = None
        self._stop = threading.Event()
        # Started by this thread, so in the cluster's network namespace it joined.
        self._thread = threading.Thread(target=self._run, name="metrics-discovery", daemon=True)

    def write(self) -> None:
        text = json.dumps(build_targets(self._h.get("/api/v1/pods")["items"]), indent=1)
        if text != self._last:
            written = self._path.with_suffix(".tmp")
            written.write_text(text)
            written.replace(self._path)
            self._last = text

    def start(self) -> None:
        self.write()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(DISCOVERY_INTERVAL):
            with contextlib.suppress(ApiError, OSError, ValueError):
                self.write()


def _wait_up(
    h: Harness,
    what: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    up: Callable[[], bool],
    timeout: float,
) -> None:
    def check() -> bool:
        if proc.poll() is not None:
            raise PipelineError(f"{what} exited {proc.returncode}:\n{processes.tail(log, 30)}")
        return up()

    try:
        h.wait_for(what, check, timeout=timeout, interval=0.5)
    except AssertionError as e:
        raise PipelineError(f"{e}:\n{processes.tail(log, 30)}") from None


@contextlib.contextmanager
def running(h: Harness, work: Path, timeout: float = 120) -> Iterator[Pipeline]:
    """Start Prometheus and the adapter for the local cluster of `h` (this process in its network
    namespace), register the APIService and wait until the API server calls it Available; on
    exit, however it exits, remove the APIService first (an unavailable aggregated API would
    fail every later discovery: kubectl, helm), then stop both and delete the objects."""
    cluster = h.cluster
    problem = missing(cluster.bin_dir)
    if problem:
        raise PipelineError(problem)
    work.mkdir(parents=True, exist_ok=True)
    pki = certs.pki_at(cluster.layout.pki)
    ca_bundle = pki.ca_cert.read_bytes()
    prom_log, adapter_log = work / "prometheus.log", work / "prometheus-adapter.log"
    with contextlib.ExitStack() as stack:
        targets = work / "targets.json"
        discovery = _Discovery(h, targets)
        discovery.start()
        stack.callback(discovery.stop)
        config = work / "prometheus.yml"
        config.write_text(yaml.safe_dump(build_prometheus_config(targets)))
        prom = _start(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={work / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}",
                "--log.level=warn",
            ],
            prom_log,
        )
        stack.callback(processes.stop_group, prom, 10)
        _wait_up(
            h,
            "Prometheus ready",
            prom,
            prom_log,
            lambda: _get(f"{PROMETHEUS_URL}/-/ready") == 200,
            timeout,
        )

        stack.callback(_delete_objects, h)
        h.apply(build_adapter_objects())
        token = h.create(
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{ADAPTER}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 24 * 3600},
            },
        )["status"]["token"]
        kubeconfig = work / "adapter.kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                build_token_kubeconfig(f"https://127.0.0.1:{API_PORT}", ca_bundle, token)
            )
        )
        kubeconfig.chmod(0o600)
        cert, key = work / "adapter.crt", work / "adapter.key"
        certs.write_serving_cert(pki, cert, key, adapter_dns_names(), [HOST_IP])
        rules = work / "adapter.yaml"
        rules.write_text(yaml.safe_dump(build_adapter_config()))
        adapter = _start(
            build_adapter_args(
                cluster.bin_dir / ADAPTER, config=rules, kubeconfig=kubeconfig, cert=cert, key=key
            ),
            adapter_log,
        )
        stack.callback(processes.stop_group, adapter, 10)
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        _wait_up(
            h,
            "prometheus-adapter ready",
            adapter,
            adapter_log,
            lambda: _get(f"https://{HOST_IP}:{ADAPTER_PORT}/readyz", context) == 200,
            timeout,
        )

        stack.callback(_delete_apiservice, h)
        h.apply(build_apiservice(ca_bundle))
        _wait_up(
            h,
            f"APIService {APISERVICE} Available",
            adapter,
            adapter_log,
            lambda: _available(h),
            timeout,
        )
        yield Pipeline(PROMETHEUS_URL, (prom_log, adapter_log))


def _available(h: Harness) -> bool:
    obj = h.get(f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}")
    conditions = (obj.get("status") or {}).get("conditions") or ()
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def _delete_apiservice(h: Harness) -> None:
    with contextlib.suppress(ApiError):
        h.delete(f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}")
    h.wait_for(
        f"APIService {APISERVICE} deleted",
        lambda: h.get_or_none(f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}") is None,
        timeout=30,
    )


def _delete_objects(h: Harness) -> None:
    for obj in reversed(build_adapter_objects()):
        if obj["kind"] in ("Service", "EndpointSlice", "ServiceAccount"):
            continue  # deleted with the namespace
        ns = ["-n", obj["metadata"]["namespace"]] if "namespace" in obj["metadata"] else []
        h.kubectl(
            "delete",
            obj["kind"],
            obj["metadata"]["name"],
            *ns,
            "--ignore-not-found",
            "--wait=false",
        )


def pod_metrics(h: Harness, namespace: str, metric: str, selector: str = "") -> dict[str, float]:
    """A per-pod custom metric of the pods of `namespace` (matching the label `selector`), as
    the HPA controller reads it: pod name -> value. A pod without a sample is absent."""
    query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
    body = h.get(f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/pods/*/{metric}{query}")
    return {
        item["describedObject"]["name"]: parse_quantity(item["value"]) for item in body["items"]
    }
