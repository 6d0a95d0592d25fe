"""One configuration (N pods, K adapters): (a) apply -> Ready, (c) at rest, (b) a killed server
back, then deletion, against the bare calls; one `Row` of figures."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
from lora_devcluster.harness import Harness

from lora_bench.operator import apiserver, pods
from tests.support import cluster
from tests.support.cluster import POD_VOLUME


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
            [
                cluster.adapter(name, str(volume / pods.NS / "src" / name), **placed)
                for name in names
            ]
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
    items: list[dict[str, Any]] = h.get(
        f"/apis/lora.dev/v1alpha1/namespaces/{pods.NS}/loraadapters"
    )["items"]
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
    return Counter(name for ip in ips for name in pods.names_on(ip) & names)


def measure(
    h: Harness, op: cluster.Operator, volume: Path, n: int, k: int, args: argparse.Namespace
) -> Row:
    row = Row(n=n, k=k)
    names = [f"a-{i:04d}" for i in range(k)]
    ips = [p["status"]["podIP"] for p in pods.pods(h, n)]
    manifest = volume.parent / f"adapters-{k}.yaml"
    manifest.write_text(adapter_docs(names, volume, args.replicas))
    want = set(names)
    per_adapter_pods = n if args.replicas is None else min(n, args.replicas)

    complete: set[str] = set()  # pods seen holding all K: nothing unloads until Ready

    def held() -> bool:
        if args.replicas is None:
            complete.update(ip for ip in ips if ip not in complete and want <= pods.names_on(ip))
            return len(complete) == len(ips)
        counts = held_by(ips, want)
        return len(counts) == k and set(counts.values()) == {per_adapter_pods}

    # (a) apply -> every pod holds all K, and -> every LoRAAdapter says Ready N/N.
    assert op.proc is not None
    proc = psutil.Process(op.proc.pid)
    cpu_before, requests_before = sum(proc.cpu_times()[:2]), apiserver.operator_requests(h)
    machine_before = cpu_by_kind()
    started = time.perf_counter()
    h.run(["kubectl", "apply", "-n", pods.NS, "-f", str(manifest)])
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
    row.apply_requests = apiserver.diff(apiserver.operator_requests(h), requests_before)

    # (c) at rest: RSS and the operator's API requests over a quiet window.
    time.sleep(args.settle)
    before = apiserver.operator_requests(h)
    quiet_started = time.perf_counter()
    time.sleep(args.quiet)
    after = apiserver.operator_requests(h)
    row.quiet_s = time.perf_counter() - quiet_started
    row.requests = apiserver.diff(after, before)
    row.rss_mib = proc.memory_info().rss / 2**20

    # (b) SIGKILL one pod's server: until /ready, until Ready in the API, until all K are back.
    victim = pods.pods(h, n)[0]
    uid, ip = victim["metadata"]["uid"], victim["status"]["podIP"]
    own = want if args.replicas is None else placed_on(h, victim["metadata"]["name"])
    restarts = victim["status"]["containerStatuses"][0]["restartCount"]
    (pid,) = h.container_pids(uid, "server")
    started = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while pods.gone(pid) is False:
        time.sleep(0.01)
    while not (row.server_ready_s and row.pod_ready_s and row.back_s):
        now = time.perf_counter() - started
        if now > args.timeout:
            raise RuntimeError(f"N={n} K={k}: the restarted pod did not get its adapters back")
        if not row.server_ready_s and pods.http_ok(f"http://{ip}:8000/ready"):
            row.server_ready_s = now
        if not row.pod_ready_s:
            p = h.get(f"/api/v1/namespaces/{pods.NS}/pods/{victim['metadata']['name']}")
            cs = p["status"]["containerStatuses"][0]
            if cs["restartCount"] > restarts and cs.get("ready"):
                row.pod_ready_s = now
        if not row.back_s and row.server_ready_s and own <= pods.names_on(ip):
            row.back_s = now
        time.sleep(0.1)
    h.wait_for(
        "every adapter Ready again",
        lambda: all_ready(h, per_adapter_pods, k),
        timeout=args.timeout,
    )
    ip_of = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods.pods(h, n)}
    names_by_ip = {ip: names for ip in ips}
    if args.replicas is not None:
        names_by_ip = {ip: [] for ip in ips}
        for item in adapters(h):
            for pod in item["status"]["placedPods"]:
                names_by_ip[ip_of[pod]].append(item["metadata"]["name"])

    # The limit: copies of the staged revision directories, loaded without the operator.
    bare = volume / pods.NS / "bare"
    shutil.rmtree(bare, ignore_errors=True)
    bare.mkdir()
    for name in names:
        (revision,) = (volume / pods.NS / name / "revisions").iterdir()
        shutil.copytree(revision, bare / name, symlinks=False)
    started = time.perf_counter()
    h.run(["kubectl", "delete", "loraadapters", "--all", "-n", pods.NS, "--wait=false"])
    row.kubectl_delete_s = time.perf_counter() - started
    # Whether any object is left, asked for one (a full list of up to K objects five times a
    # second would take a share of the API server the operator is measured against).
    h.wait_for(
        "the adapters to be unloaded everywhere and gone",
        lambda: (
            not h.get(f"/apis/lora.dev/v1alpha1/namespaces/{pods.NS}/loraadapters?limit=1")["items"]
            and not any(pods.names_on(ip) & want for ip in ips)
        ),
        timeout=args.timeout,
    )
    row.delete_s = time.perf_counter() - started
    row.bare_s, per_pod, row.bare_unload_s = asyncio.run(
        pods.bare_calls(names_by_ip, f"{POD_VOLUME}/{pods.NS}/bare")
    )
    row.bare_pod_s = statistics.median(per_pod)
    shutil.rmtree(bare)
    return row
