"""Operator benchmark: apply -> Ready against the bare load calls, restart recovery, footprint.

One run starts its own local cluster (lora-devcluster, in a temporary directory), installs the
CRD, runs `python -m lora_operator` as a process and a Deployment of tiny SD 1.5 inference pods,
and prints one table with, for each N pods and K adapters:

  (a) apply -> Ready: from `kubectl apply -f` of K LoRAAdapters (one multi-document YAML) to all
      K Ready N/N, against the limit: the bare POST /v1/load_lora_adapter calls for the same K
      adapters on the same N pods with the operator's concurrency (one call at a time per pod,
      the pods in parallel), from copies of the revision directories the operator staged;
  (b) restart: SIGKILL one pod's server process and time it until the pod's /v1/models lists all
      K again, against the pod's own restart-to-Ready time plus the bare load of K on one pod;
  (c) at rest: the operator's RSS, and its requests to the API server over a quiet window after
      everything is Ready, per adapter (target: none beyond watches); then deletion: from
      `kubectl delete --all` to every object gone and no pod holding one, against the bare
      POST /v1/unload_lora_adapter calls for the same K on the same N pods;
  (d) staging: one large adapter file (64 MiB and 1 GiB by default) staged by the operator's
      store from a local https origin and from a local S3 server (moto), against curl of the
      same bytes to a file, with the staging process's peak RSS.

The operator authenticates as a ServiceAccount of its own, and FlowSchemas that match only that
account (by verb class and resource) let the API server count its requests exactly
(apiserver_flowcontrol_dispatched_requests_total), apart from the kubelet's and this script's:
the table gives API writes to LoRAAdapters and Event writes per adapter from apply to Ready,
and the detail the CPU time every kind of process on the machine used in that time. The script
observes cheaply, as it shares the machine: until every pod holds all K it reads the pods every
0.5 s, and it lists the K LoRAAdapters only after that; while they are deleted it asks for one.

    .venv/bin/python bench/bench_operator.py                          # N in 1,3,10; K in 1,50,200
    .venv/bin/python bench/bench_operator.py --pods 10 --adapters 1000  # the 1000-adapter row
    .venv/bin/python bench/bench_operator.py --quick                  # N in 1,3;    K in 1,50
    .venv/bin/python bench/bench_operator.py --staging only           # (d) alone, no cluster
    .venv/bin/python bench/bench_operator.py --pods 10 --adapters 1000 --replicas 2 --staging no

With `--replicas R` every adapter has `spec.replicas: R`: the operator places it on R of the N
pods, "held" means every adapter is on exactly its R placed pods, Ready means `Ready R/R`, the
bare limit loads each adapter on its placed pods only, and a killed pod is back when it lists
the adapters placed on it. The pods advertise a CPU tier of `--cpu-loras` adapters (placement
never gives a pod more).

Needs root and the devcluster binaries (`make binaries`), like the cluster tests. Results go in
docs/benchmarks.md together with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
from aiohttp import ClientSession, ClientTimeout

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from diffusers import DiffusionPipeline  # noqa: E402
from lora_demo import release  # noqa: E402
from lora_devcluster.certs import write_pki  # noqa: E402
from lora_devcluster.harness import Harness  # noqa: E402
from lora_devcluster.pytest_plugin import running_cluster  # noqa: E402
from lora_inference.tools.random_adapters import write_random_adapter  # noqa: E402
from lora_inference.tools.tiny_models import write_tiny_model  # noqa: E402

from tests.support import cluster  # noqa: E402
from tests.support.cluster import MODEL_NAME, POD_VOLUME, TOKEN  # noqa: E402
from tests.support.http import free_port  # noqa: E402

NS = "bench"
SA = "lora-operator-bench"
CRD = REPO / "crds" / "lora.dev_loraadapters.yaml"
SELECTOR = "app=inference"
FLOW_PREFIX = "bench-op-"
VERBS = {
    "watch": ["watch"],
    "read": ["get", "list"],
    "write": ["create", "update", "patch", "delete", "deletecollection"],
}
RESOURCES = {
    "adapters": ["loraadapters", "loraadapters/status"],
    "pods": ["pods", "pods/status"],
    "events": ["events"],
    "other": ["*"],
}


# -- the operator's identity, counted by the API server ----------------------------------------


def flow_schemas() -> list[dict[str, Any]]:
    """FlowSchemas matching only the operator's ServiceAccount, one per (verb class, resource):
    the API server's dispatch counter per schema is then a per-verb count of its requests."""
    subject = {"kind": "ServiceAccount", "serviceAccount": {"name": SA, "namespace": "default"}}
    out = []
    for i, (res, resources) in enumerate(RESOURCES.items()):
        for j, (verb, verbs) in enumerate(VERBS.items()):
            rule = {
                "verbs": verbs,
                "apiGroups": ["*"],
                "resources": resources,
                "clusterScope": True,
                "namespaces": ["*"],
            }
            out.append(_flow_schema(f"{verb}-{res}", 10 + 3 * i + j, subject, resourceRules=[rule]))
    rule = {"verbs": ["*"], "nonResourceURLs": ["*"]}
    out.append(_flow_schema("nonresource", 40, subject, nonResourceRules=[rule]))
    return out


def _flow_schema(name: str, precedence: int, subject: Any, **rules: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": FLOW_PREFIX + name},
        "spec": {
            "priorityLevelConfiguration": {"name": "workload-high"},
            "matchingPrecedence": precedence,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{"subjects": [subject], **rules}],
        },
    }


def operator_kubeconfig(h: Harness, path: Path) -> Path:
    """A kubeconfig for a cluster-admin ServiceAccount used by the operator alone."""
    h.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SA}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": SA},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": "default"}],
            },
            *flow_schemas(),
        ],
        "default",
    )
    token = h.create(
        f"/api/v1/namespaces/default/serviceaccounts/{SA}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 86400},
        },
    )["status"]["token"]
    config = yaml.safe_load(h.cluster.kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token}
    path.write_text(yaml.safe_dump(config))
    return path


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before.get(key, 0) for key in after}


def operator_requests(h: Harness) -> dict[str, int]:
    """The operator's requests so far, by FlowSchema (verb class and resource)."""
    with urllib.request.urlopen(h.server + "/metrics", context=h.ssl_context, timeout=30) as r:
        text = r.read().decode()
    counts: dict[str, int] = {}
    pattern = re.compile(
        r'^apiserver_flowcontrol_dispatched_requests_total\{[^}]*flow_schema="'
        + FLOW_PREFIX
        + r'([^"]+)"[^}]*\} (\S+)$',
        re.M,
    )
    for m in pattern.finditer(text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
    return counts


# -- the pods ------------------------------------------------------------------------------------


def pods(h: Harness, n: int, timeout: float = 900) -> list[dict[str, Any]]:
    return release.ready_pods(h, NS, SELECTOR, n, timeout=timeout, all_ready=False)


def names_on(ip: str) -> set[str]:
    try:
        return set(cluster.models(ip))
    except (OSError, AssertionError):
        return set()


def gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


async def bare_calls(
    names_by_ip: dict[str, list[str]], root: str
) -> tuple[float, list[float], float]:
    """The limits: POST /v1/load_lora_adapter for each pod's adapters (every adapter, or its
    placed ones), one call at a time per pod, the pods in parallel (as the operator calls them),
    then the same for /v1/unload_lora_adapter. Returns (load wall, per-pod load wall, unload
    wall)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def one_pod(session: ClientSession, ip: str, verb: str) -> float:
        started = time.perf_counter()
        for name in names_by_ip[ip]:
            body = {"lora_name": f"bare-{name}", "lora_path": f"{root}/{name}"}
            if verb == "unload":
                body = {"lora_name": f"bare-{name}"}
            async with session.post(
                f"http://{ip}:8000/v1/{verb}_lora_adapter", json=body, headers=headers
            ) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{ip}: {verb} {name}: {resp.status} {await resp.text()}")
        return time.perf_counter() - started

    async def all_pods(session: ClientSession, verb: str) -> tuple[float, list[float]]:
        started = time.perf_counter()
        per_pod = await asyncio.gather(*(one_pod(session, ip, verb) for ip in names_by_ip))
        return time.perf_counter() - started, list(per_pod)

    async with ClientSession(timeout=ClientTimeout(total=600)) as session:
        load_wall, per_pod = await all_pods(session, "load")
        unload_wall, _ = await all_pods(session, "unload")
    return load_wall, per_pod, unload_wall


# -- one configuration ---------------------------------------------------------------------------


@dataclass
class Row:
    n: int
    k: int
    apply_s: float = 0.0  # `kubectl apply` itself
    held_s: float = 0.0  # apply -> every pod lists all K
    ready_s: float = 0.0  # apply -> every LoRAAdapter Ready N/N
    bare_s: float = 0.0  # the bare load calls, all pods
    bare_pod_s: float = 0.0  # the bare load calls, median per pod
    server_ready_s: float = 0.0  # kill -> the server's /ready answers 200
    pod_ready_s: float = 0.0  # kill -> the pod is Ready again in the API
    back_s: float = 0.0  # kill -> /v1/models lists all K again
    rss_mib: float = 0.0
    requests: dict[str, int] | None = None  # the operator's API requests over the quiet window
    quiet_s: float = 0.0
    kubectl_delete_s: float = 0.0  # `kubectl delete --all` itself
    delete_s: float = 0.0  # `kubectl delete --all` -> every object gone, no pod holding one
    bare_unload_s: float = 0.0  # the bare unload calls, all pods
    apply_cpu_s: float = 0.0  # the operator's CPU time from apply to Ready
    apply_cpu_by: dict[str, float] | None = None  # every process's CPU, apply to Ready, by kind
    apply_requests: dict[str, int] | None = None  # its API requests from apply to Ready


def adapter_docs(names: list[str], volume: Path, replicas: int | None) -> str:
    placed = {} if replicas is None else {"replicas": replicas}
    return str(
        yaml.safe_dump_all(
            [cluster.adapter(name, str(volume / NS / "src" / name), **placed) for name in names]
        )
    )


# What each process is, for the machine's CPU by kind of process (the first match names it).
CPU_KINDS = (
    ("operator", "lora_operator"),
    ("inference pods", "lora-inference"),
    ("inference pods", "lora_inference"),
    ("kube-apiserver", "kube-apiserver"),
    ("etcd", "etcd"),
    ("this script", "bench_operator"),
)


def cpu_by_kind() -> Counter[str]:
    """CPU seconds used so far by the machine's live processes, by kind, plus the script's
    finished children (kubectl) under "this script"."""
    used: Counter[str] = Counter()
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        times, cmdline = proc.info["cpu_times"], " ".join(proc.info["cmdline"] or ())
        if times is None:
            continue
        kind = next((k for k, marker in CPU_KINDS if marker in cmdline), "the rest of the node")
        used[kind] += times.user + times.system
    children = psutil.Process().cpu_times()
    used["this script"] += children.children_user + children.children_system
    return used


def adapters(h: Harness) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = h.get(f"/apis/lora.dev/v1alpha1/namespaces/{NS}/loraadapters")[
        "items"
    ]
    return items


def all_ready(h: Harness, n: int, k: int) -> bool:
    items = adapters(h)
    done = [
        i
        for i in items
        if (i.get("status") or {}).get("phase") == "Ready"
        and (i.get("status") or {}).get("ready") == f"{n}/{n}"
    ]
    return len(items) == k and len(done) == k


def placed_on(h: Harness, pod: str) -> set[str]:
    """The adapters whose status places them on `pod`."""
    return {
        i["metadata"]["name"]
        for i in adapters(h)
        if pod in ((i.get("status") or {}).get("placedPods") or ())
    }


def held_by(ips: list[str], names: set[str]) -> Counter[str]:
    """How many of the pods list each adapter."""
    return Counter(name for ip in ips for name in names_on(ip) & names)


def measure(
    h: Harness, op: cluster.Operator, volume: Path, n: int, k: int, args: argparse.Namespace
) -> Row:
    row = Row(n=n, k=k)
    names = [f"a-{i:04d}" for i in range(k)]
    ips = [p["status"]["podIP"] for p in pods(h, n)]
    manifest = volume.parent / f"adapters-{k}.yaml"
    manifest.write_text(adapter_docs(names, volume, args.replicas))
    want = set(names)
    per_adapter_pods = n if args.replicas is None else min(n, args.replicas)

    complete: set[str] = set()  # pods seen holding all K: nothing unloads until Ready

    def held() -> bool:
        if args.replicas is None:
            complete.update(ip for ip in ips if ip not in complete and want <= names_on(ip))
            return len(complete) == len(ips)
        counts = held_by(ips, want)
        return len(counts) == k and set(counts.values()) == {per_adapter_pods}

    # (a) apply -> every pod holds all K, and -> every LoRAAdapter says Ready N/N.
    assert op.proc is not None
    proc = psutil.Process(op.proc.pid)
    cpu_before, requests_before = sum(proc.cpu_times()[:2]), operator_requests(h)
    machine_before = cpu_by_kind()
    started = time.perf_counter()
    h.run(["kubectl", "apply", "-n", NS, "-f", str(manifest)])
    row.apply_s = time.perf_counter() - started
    deadline = started + args.timeout
    # The observer must take little of the machine it measures: until every pod holds all K
    # it reads the pods every 0.5 s (each read lists up to K adapters); only then does it list
    # the K LoRAAdapters, every 0.2 s, since Ready needs the pods' reports and so never comes
    # first.
    while not (row.held_s and row.ready_s):
        if time.perf_counter() > deadline:
            raise RuntimeError(
                f"N={n} K={k}: not Ready after {args.timeout:.0f} s; see {op.log_path}"
            )
        if not row.held_s:
            if held():
                row.held_s = time.perf_counter() - started
            else:
                time.sleep(0.5)
                continue
        if all_ready(h, per_adapter_pods, k):
            row.ready_s = time.perf_counter() - started
        else:
            time.sleep(0.2)

    row.apply_cpu_s = sum(proc.cpu_times()[:2]) - cpu_before
    machine = cpu_by_kind()
    machine.subtract(machine_before)
    row.apply_cpu_by = {kind: seconds for kind, seconds in machine.most_common() if seconds > 0}
    row.apply_requests = diff(operator_requests(h), requests_before)

    # (c) at rest: RSS and the operator's API requests over a quiet window.
    time.sleep(args.settle)
    before = operator_requests(h)
    quiet_started = time.perf_counter()
    time.sleep(args.quiet)
    after = operator_requests(h)
    row.quiet_s = time.perf_counter() - quiet_started
    row.requests = diff(after, before)
    row.rss_mib = proc.memory_info().rss / 2**20

    # (b) SIGKILL one pod's server: until /ready, until Ready in the API, until all K are back.
    victim = pods(h, n)[0]
    uid, ip = victim["metadata"]["uid"], victim["status"]["podIP"]
    own = want if args.replicas is None else placed_on(h, victim["metadata"]["name"])
    restarts = victim["status"]["containerStatuses"][0]["restartCount"]
    (pid,) = h.container_pids(uid, "server")
    started = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while gone(pid) is False:
        time.sleep(0.01)
    while not (row.server_ready_s and row.pod_ready_s and row.back_s):
        now = time.perf_counter() - started
        if now > args.timeout:
            raise RuntimeError(f"N={n} K={k}: the restarted pod did not get its adapters back")
        if not row.server_ready_s and http_ok(f"http://{ip}:8000/ready"):
            row.server_ready_s = now
        if not row.pod_ready_s:
            p = h.get(f"/api/v1/namespaces/{NS}/pods/{victim['metadata']['name']}")
            cs = p["status"]["containerStatuses"][0]
            if cs["restartCount"] > restarts and cs.get("ready"):
                row.pod_ready_s = now
        if not row.back_s and row.server_ready_s and own <= names_on(ip):
            row.back_s = now
        time.sleep(0.1)
    h.wait_for(
        "every adapter Ready again",
        lambda: all_ready(h, per_adapter_pods, k),
        timeout=args.timeout,
    )
    ip_of = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods(h, n)}
    names_by_ip = {ip: names for ip in ips}
    if args.replicas is not None:
        names_by_ip = {ip: [] for ip in ips}
        for item in adapters(h):
            for pod in item["status"]["placedPods"]:
                names_by_ip[ip_of[pod]].append(item["metadata"]["name"])

    # The limit: copies of the staged revision directories, loaded without the operator.
    bare = volume / NS / "bare"
    shutil.rmtree(bare, ignore_errors=True)
    bare.mkdir()
    for name in names:
        (revision,) = (volume / NS / name / "revisions").iterdir()
        shutil.copytree(revision, bare / name, symlinks=False)
    started = time.perf_counter()
    h.run(["kubectl", "delete", "loraadapters", "--all", "-n", NS, "--wait=false"])
    row.kubectl_delete_s = time.perf_counter() - started
    # Whether any object is left, asked for one (a full list of up to K objects five times a
    # second would take a share of the API server the operator is measured against).
    h.wait_for(
        "the adapters to be unloaded everywhere and gone",
        lambda: (
            not h.get(f"/apis/lora.dev/v1alpha1/namespaces/{NS}/loraadapters?limit=1")["items"]
            and not any(names_on(ip) & want for ip in ips)
        ),
        timeout=args.timeout,
    )
    row.delete_s = time.perf_counter() - started
    row.bare_s, per_pod, row.bare_unload_s = asyncio.run(
        bare_calls(names_by_ip, f"{POD_VOLUME}/{NS}/bare")
    )
    row.bare_pod_s = statistics.median(per_pod)
    shutil.rmtree(bare)
    return row


# -- staging speed (no cluster) ------------------------------------------------------------------


def write_big_lora(path: Path, size: int) -> None:
    """A LoRA-shaped safetensors file of `size` bytes: two F32 halves of rank 64 (zeros)."""
    cols = size // (2 * 64 * 4)
    half = 64 * cols * 4
    header = json.dumps(
        {
            "unet.big.lora_A.weight": {
                "dtype": "F32",
                "shape": [64, cols],
                "data_offsets": [0, half],
            },
            "unet.big.lora_B.weight": {
                "dtype": "F32",
                "shape": [cols, 64],
                "data_offsets": [half, 2 * half],
            },
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        chunk = os.urandom(1 << 20)  # incompressible, like real weights
        for _ in range(2 * half >> 20):
            f.write(chunk)


class FileOrigin:
    """An HTTPS origin serving one file: `openssl s_server -WWW` (C, so the origin is not what
    is measured; it answers HTTP/1.0 without a Content-Length, which the fetcher accepts)."""

    def __init__(self, path: Path, cert: Path, key: Path) -> None:
        self.port = free_port()
        self._proc = subprocess.Popen(
            [
                *("openssl", "s_server", "-accept", str(self.port)),
                *("-cert", str(cert), "-key", str(key), "-WWW", "-quiet"),
            ],
            cwd=path.parent,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"https://127.0.0.1:{self.port}/{path.name}"
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                break
            time.sleep(0.05)

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)


# The child imports only the operator's staging code: its peak RSS is the operator's cost.
STAGE_CHILD = """
import asyncio, json, os, sys, time, uuid
from pathlib import Path
from lora_operator.rules import consent
from lora_operator.store import egress, fetchers, sources, staging

uri, volume = sys.argv[1], Path(sys.argv[2])
credentials = sources.Credentials(
    aws_endpoint_url=os.environ.get("AWS_ENDPOINT_URL"),
    aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
    aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
)
# The sources are this machine's: any name, the loopback range opened.
rules = consent.Rules(hosts=("*",), allow=consent.parse_networks(["127.0.0.0/8"]))
fetch = fetchers.Fetcher(volume, egress.Guard(rules))
store = staging.Store(volume, max_bytes=8 * 1024**3, fetch=fetch)
started = time.perf_counter()
name = "big-" + uuid.uuid4().hex[:8]
staged = asyncio.run(store.stage("bench", name, sources.parse_source(uri), credentials=credentials))
seconds = time.perf_counter() - started
# VmHWM: this process's peak (ru_maxrss would include the parent's, kept across exec).
status = Path("/proc/self/status").read_text()
rss = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024
print(json.dumps({"seconds": seconds, "rss_mib": rss, "bytes": staged.size}))
"""


def empty_page_cache() -> bool:
    """Write back and drop the page cache (root only), so that every download of (d) starts
    from the same memory state: on a machine just used by a cluster, fresh page-cache pages
    cost several times more to fill, and which run found them so was chance. Whether it could."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def stage_in_child(uri: str, volume: Path, env: dict[str, str]) -> dict[str, Any]:
    """Stage `uri` with the operator's store in a fresh process: its time and peak RSS."""
    out = subprocess.run(
        [sys.executable, "-c", STAGE_CHILD, uri, str(volume)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def plain_download(url: str, dest: Path, ca: Path | None) -> float:
    """The same bytes with curl to the same volume: the limit for staging."""
    argv = ["curl", "-sSf", "-o", str(dest), url] + (["--cacert", str(ca)] if ca else [])
    started = time.perf_counter()
    subprocess.run(argv, check=True)
    seconds = time.perf_counter() - started
    dest.unlink()
    return seconds


@dataclass
class StagingRow:
    source: str
    mib: int
    plain_s: float
    staged_s: float
    rss_mib: float
    cache_emptied: bool  # the page cache was dropped before each download


def measure_staging(work: Path, sizes_mib: list[int], repeats: int) -> list[StagingRow]:
    import boto3

    volume = work / "staging-volume"
    volume.mkdir(parents=True, exist_ok=True)
    pki = write_pki(work / "pki", ["127.0.0.1"], ["localhost"], "bench", "127.0.0.1")
    moto_port = free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{moto_port}"
    s3_env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
    }
    rows = []
    try:
        for _ in range(300):
            if http_ok(f"{endpoint}/moto-api/"):
                break
            time.sleep(0.1)
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        s3.create_bucket(Bucket="bench")
        for mib in sizes_mib:
            path = work / f"big-{mib}.safetensors"
            write_big_lora(path, mib * 2**20)
            origin = FileOrigin(path, pki.server_cert, pki.server_key)
            s3.upload_file(str(path), "bench", path.name)
            sources_ = [
                ("https", origin.url, pki.ca_cert, {"SSL_CERT_FILE": str(pki.ca_cert)}),
                ("s3", f"s3://bench/{path.name}", None, s3_env),
            ]
            try:
                for name, uri, ca, env in sources_:
                    url = uri if name == "https" else f"{endpoint}/bench/{path.name}"
                    plain, staged = [], []
                    rss, emptied = 0.0, True
                    for _ in range(repeats):  # alternate, keep the best of each (a shared machine)
                        emptied &= empty_page_cache()
                        plain.append(plain_download(url, volume / "plain.bin", ca))
                        empty_page_cache()
                        result = stage_in_child(uri, volume, env)
                        staged.append(result["seconds"])
                        rss = max(rss, result["rss_mib"])
                        gc_volume(volume)
                    rows.append(StagingRow(name, mib, min(plain), min(staged), rss, emptied))
                    print(
                        f"  {name} {mib} MiB: plain {min(plain):.2f} s, staged {min(staged):.2f} s,"
                        f" operator RSS {rss:.0f} MiB",
                        flush=True,
                    )
            finally:
                origin.close()
                path.unlink()
    finally:
        moto.terminate()
        moto.wait(10)
    return rows


def gc_volume(volume: Path) -> None:
    """Empty the staging volume between runs (each run stages under a new name)."""
    for child in volume.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


def print_staging(rows: list[StagingRow]) -> None:
    print("\n(d) staging one file: the operator's store against curl of the same bytes")
    print(
        f"{'source':>7}{'MiB':>6} |{'curl s':>8}{'staged s':>9}{'speed':>7} |"
        f"{'operator RSS MiB':>17}"
    )
    for r in rows:
        print(
            f"{r.source:>7}{r.mib:6d} |{r.plain_s:8.2f}{r.staged_s:9.2f}"
            f"{r.plain_s / r.staged_s:7.2f} |{r.rss_mib:17.0f}"
        )
    print(
        "speed: curl's time / the store's (target >= 0.8); the store hashes, checks the header,"
        " fsyncs and publishes;\noperator RSS: the staging process's peak, flat in the file size"
        " when the sizes' rows agree; the page cache was"
        + ("" if all(r.cache_emptied for r in rows) else " NOT")
        + " emptied before each download."
    )


# -- the report ----------------------------------------------------------------------------------


def per_adapter(requests: dict[str, int] | None, prefix: str, k: int) -> float:
    return sum(v for key, v in (requests or {}).items() if key.startswith(prefix)) / k


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print("\n(a) apply -> Ready against the bare load calls")
    print(
        f"{'N':>3}{'K':>6} |{'apply':>7}{'bare':>8}{'held':>8}{'Ready':>8}"
        f"{'(held-apply)/bare':>18}{'Ready-held':>11} |{'writes/adapter':>15}"
        f"{'events/adapter':>15}"
    )
    for r in rows:
        print(
            f"{r.n:3d}{r.k:6d} |{r.apply_s:7.2f}{r.bare_s:8.2f}{r.held_s:8.2f}{r.ready_s:8.2f}"
            f"{(r.held_s - r.apply_s) / r.bare_s:18.2f}{r.ready_s - r.held_s:11.2f} |"
            f"{per_adapter(r.apply_requests, 'write-adapters', r.k):15.2f}"
            f"{per_adapter(r.apply_requests, 'write-events', r.k):15.2f}"
        )
    print(
        "apply: `kubectl apply` itself; bare: the load calls alone, all pods; held: apply -> every"
        " pod lists all K;\nReady: apply -> every LoRAAdapter Ready N/N; writes/adapter: the"
        " operator's writes to LoRAAdapters (kopf's\nfinalizer and status patches) from apply to"
        " Ready, per adapter; events/adapter: its Event writes (creates and series patches)."
    )
    print(f"\n(b) a killed server back to all K; (c) at rest over {args.quiet:.0f} s; deletion")
    print(
        f"{'N':>3}{'K':>6} |{'pod Ready':>10}{'back':>8}{'limit':>8}{'back/limit':>11} |"
        f"{'RSS MiB':>8}{'req/adapter':>12}{'watches':>8} |{'kubectl':>8}{'delete':>8}"
        f"{'bare unload':>12}{'delete/bare':>12}"
    )
    for r in rows:
        limit = r.pod_ready_s + r.bare_pod_s
        print(
            f"{r.n:3d}{r.k:6d} |{r.pod_ready_s:10.2f}{r.back_s:8.2f}{limit:8.2f}"
            f"{r.back_s / limit:11.2f} |{r.rss_mib:8.0f}"
            f"{per_adapter(r.requests, '', r.k) - per_adapter(r.requests, 'watch-', r.k):12.2f}"
            f"{sum(v for key, v in (r.requests or {}).items() if key.startswith('watch-')):8d} |"
            f"{r.kubectl_delete_s:8.2f}{r.delete_s:8.2f}{r.bare_unload_s:12.2f}"
            f"{r.delete_s / r.bare_unload_s:12.2f}"
        )
    print(
        "pod Ready: kill -> the pod Ready again; back: kill -> /v1/models lists all K; limit: pod"
        " Ready + the bare loads\nof K on one pod; req/adapter: the operator's API requests other"
        " than watches over the quiet window, per adapter;\nkubectl: `kubectl delete --all`"
        " itself; delete: from its start until every object is gone and no pod holds one;\nbare"
        " unload: the unload calls alone."
    )
    print("\nDetail")
    for r in rows:
        req = {key: v for key, v in sorted((r.requests or {}).items()) if v}
        during = {key: v for key, v in sorted((r.apply_requests or {}).items()) if v}
        print(
            f"N={r.n} K={r.k}: apply -> Ready: operator CPU {r.apply_cpu_s:.2f} s"
            f" ({r.apply_cpu_s / r.k * 1000:.0f} ms per adapter); requests {during}"
        )
        by = ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in (r.apply_cpu_by or {}).items())
        print(
            f"N={r.n} K={r.k}: apply -> Ready: CPU seconds by process ({os.cpu_count()} cores x"
            f" {r.ready_s:.1f} s = {(os.cpu_count() or 1) * r.ready_s:.0f}): {by}"
        )
        print(
            f"N={r.n} K={r.k}: server /ready after kill {r.server_ready_s:.2f} s; bare per pod"
            f" {r.bare_pod_s:.2f} s; requests in {r.quiet_s:.0f} s: {req or 'none'}"
        )


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="N in 1,3 and K in 1,50")
    parser.add_argument("--pods", type=parse_list, default=None, help="N values (1,3,10)")
    parser.add_argument("--adapters", type=parse_list, default=None, help="K values (1,50,200)")
    parser.add_argument("--quiet", type=float, default=35.0, help="quiet window, seconds")
    parser.add_argument("--settle", type=float, default=5.0, help="wait before the window")
    parser.add_argument("--timeout", type=float, default=900.0, help="per wait, seconds")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the operator's log here")
    parser.add_argument(
        "--staging", choices=("also", "only", "no"), default="also", help="(d), staging speed"
    )
    parser.add_argument(
        "--staging-mib", type=parse_list, default=[64, 1024], help="file sizes for (d), MiB"
    )
    parser.add_argument("--staging-repeats", type=int, default=2, help="runs per row of (d)")
    parser.add_argument(
        "--replicas", type=int, default=None, help="spec.replicas of every adapter (default: none)"
    )
    parser.add_argument(
        "--cpu-loras", type=int, default=None, help="the pods' --max-cpu-loras (default: 32)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="lora-bench-operator-") as scratch:
        work = Path(scratch)
        if args.staging != "only":
            rows, totals = measure_cluster(work, args)
        if args.staging != "no":
            print("(d) staging speed", flush=True)
            staging_rows = measure_staging(work, args.staging_mib, args.staging_repeats)
        cpus = os.cpu_count()
        memory = psutil.virtual_memory().total / 2**30
        print(
            f"\nlora-operator on lora-devcluster, tiny sd15 inference pods on cpu; "
            f"{platform.machine()}, {cpus} cores, {memory:.0f} GiB; "
            f"{datetime.date.today().isoformat()}; operator --resync-seconds 30, "
            "--max-concurrent-loads 16"
            + (f"; spec.replicas {args.replicas}" if args.replicas is not None else "")
            + (f"; pods --max-cpu-loras {args.cpu_loras}" if args.cpu_loras is not None else "")
        )
        if args.staging != "only":
            print_table(rows, args)
            print(f"the operator's API requests over the whole run: {dict(sorted(totals.items()))}")
        if args.staging != "no":
            print_staging(staging_rows)


def measure_cluster(work: Path, args: argparse.Namespace) -> tuple[list[Row], dict[str, int]]:
    ns_values = args.pods or ([1, 3] if args.quick else [1, 3, 10])
    ks = args.adapters or ([1, 50] if args.quick else [1, 50, 200])
    started = time.perf_counter()
    model = write_tiny_model(work / "models" / MODEL_NAME, "sd15")
    cluster.readable_by_pods(work / "models")
    pipe = DiffusionPipeline.from_pretrained(str(model))
    volume = work / "volume"
    for i in range(max(ks)):
        write_random_adapter(
            volume / NS / "src" / f"a-{i:04d}", pipe, base_model=MODEL_NAME, seed=i
        )
    del pipe
    print(f"tiny model and {max(ks)} adapters written in {time.perf_counter() - started:.1f} s")
    log_dir = args.log_dir or work
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    with running_cluster() as h:
        h.kubectl("apply", "-f", str(CRD))
        h.kubectl(
            "wait", "--for=condition=Established", "crd/loraadapters.lora.dev", "--timeout=60s"
        )
        h.create(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        )
        kubeconfig = operator_kubeconfig(h, work / "operator.kubeconfig")
        admin_kubeconfig = os.environ["KUBECONFIG"]
        os.environ["KUBECONFIG"] = str(kubeconfig)  # the operator's process only
        op = cluster.Operator(
            volume=volume,
            namespaces=[NS],
            log_path=log_dir / "operator.log",
            extra=["--resync-seconds", "30"],  # the default; the tests' helper sets 5
        )
        op.start()
        os.environ["KUBECONFIG"] = admin_kubeconfig
        try:
            deployment = cluster.inference_deployment(
                h.image("inference"), "inference", 0, work / "models", volume
            )
            if args.cpu_loras is not None:
                container = deployment["spec"]["template"]["spec"]["containers"][0]
                container["args"] += ["--max-cpu-loras", str(args.cpu_loras)]
            h.apply(deployment, NS)
            for n in ns_values:
                h.kubectl("scale", "-n", NS, "deployment/inference", f"--replicas={n}")
                t0 = time.perf_counter()
                pods(h, n)
                print(f"N={n}: pods Ready in {time.perf_counter() - t0:.1f} s", flush=True)
                for k in ks:
                    row = measure(h, op, volume, n, k, args)
                    rows.append(row)
                    print(
                        f"  K={k}: held {row.held_s:.2f} s, Ready {row.ready_s:.2f} s, bare "
                        f"{row.bare_s:.2f} s, delete {row.delete_s:.2f} s, bare unload "
                        f"{row.bare_unload_s:.2f} s, back after kill {row.back_s:.2f} s",
                        flush=True,
                    )
            totals = operator_requests(h)
            if not totals:
                raise RuntimeError("the API server counted no request of the operator's")
        finally:
            op.stop()
    return rows, totals


if __name__ == "__main__":
    main()
