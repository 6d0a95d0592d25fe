"""The operator at scale (`--simulate PROFILE`): K adapters in NS namespaces on N simulated GPU
pods (`lora-inference serve --simulate`), each adapter on `spec.replicas: 2` pods or, for a Zipf
head, `spec.autoscale` from 2; one cluster, one operator process, every (K, N, NS) in turn, and
for each the phases of scaleplan.PHASES: apply -> every adapter Ready, at rest, an operator
restart -> resumed, the API server unavailable then restarted, delete all; then the bare calls.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml
from lora_demo import release
from lora_devcluster import images
from lora_devcluster.harness import ApiError, Harness

from lora_bench import cluster as bench_cluster
from lora_bench.operator import apiserver, configuration, pods, scaleplan
from lora_bench.operator.scaleplan import Layout, Phase, Run
from tests.support import ROOT, cluster
from tests.support.cluster import MODEL_NAME, POD_VOLUME
from tests.support.loras import lora_bytes

CRD = ROOT / "crds" / "lora.dev_loraadapters.yaml"
ADAPTERS = "/apis/lora.dev/v1alpha1/loraadapters"
SETTLE_S = 10.0  # after a phase's goal, for the writes that follow it


def say(started: float, message: str) -> None:
    print(f"[{time.monotonic() - started:7.1f} s] {message}", flush=True)


# -- the operator, observed -------------------------------------------------------------------


class Watched:
    """The operator's process: its RSS (sampled, with the peak), CPU, log and phase gauge."""

    def __init__(self, op: cluster.Operator) -> None:
        self.op = op
        self.peak_mib = 0.0

    @property
    def proc(self) -> psutil.Process:
        if self.op.proc is None:
            raise RuntimeError("the operator is not running")
        return psutil.Process(self.op.proc.pid)

    def rss_mib(self) -> float:
        rss = float(self.proc.memory_info().rss) / 2**20
        self.peak_mib = max(self.peak_mib, rss)
        return rss

    def cpu_s(self) -> float:
        times = self.proc.cpu_times()
        return float(times.user + times.system)

    def log_offset(self) -> int:
        return self.op.log_path.stat().st_size if self.op.log_path.exists() else 0

    def log_since(self, offset: int) -> list[str]:
        with self.op.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines()

    def ready_count(self) -> int:
        """The operator's own count of Ready adapters (its phase gauge); -1 while it does not
        answer."""
        url = f"http://127.0.0.1:{self.op.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return -1
        for line in text.splitlines():
            if line.startswith('lora_operator_adapters{phase="Ready"}'):
                return int(float(line.split()[-1]))
        return 0


class Clock:
    """One phase's starting point: time, the operator's API requests, CPU, log offset."""

    def __init__(self, h: Harness | None, watched: Watched, counters: bool = True) -> None:
        self.t0 = time.perf_counter()
        self.requests = apiserver.operator_requests(h) if h is not None and counters else {}
        self.cpu = watched.cpu_s()
        self.offset = watched.log_offset()
        watched.peak_mib = watched.rss_mib()

    def finish(self, phase: Phase, h: Harness, watched: Watched, wall_s: float) -> Phase:
        """Fill `phase` with what happened since the start (`wall_s`: to the phase's goal)."""
        used = apiserver.diff(apiserver.operator_requests(h), self.requests)
        phase.wall_s = wall_s
        phase.writes = sum(v for key, v in used.items() if key == "write-adapters")
        phase.events = sum(v for key, v in used.items() if key == "write-events")
        phase.other = sum(
            v
            for key, v in used.items()
            if not key.startswith("watch-") and key not in ("write-adapters", "write-events")
        )
        phase.rss_mib = watched.rss_mib()
        phase.peak_rss_mib = watched.peak_mib
        phase.cpu_s = watched.cpu_s() - self.cpu
        calls = scaleplan.calls_per_pod(watched.log_since(self.offset))
        phase.loads, phase.unloads = calls["load"], calls["unload"]
        return phase


def wait(
    what: str, check: Callable[[], bool], watched: Watched, timeout: float, every: float
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not after {timeout:.0f} s; see {watched.op.log_path}")
        if watched.op.proc is None or watched.op.proc.poll() is not None:
            raise RuntimeError(f"{what}: the operator exited; see {watched.op.log_path}")
        watched.rss_mib()
        time.sleep(every)


# -- the cluster's side ---------------------------------------------------------------------


def deployment(
    h: Harness, work: Path, volume: Path, replicas: int, args: argparse.Namespace
) -> Any:
    d = cluster.inference_deployment(
        h.image("inference"), "inference", replicas, work / "models", volume
    )
    spec = d["spec"]["template"]["spec"]
    container = spec["containers"][0]
    argv = container["args"]
    i = argv.index("--device")
    del argv[i : i + 2]
    argv += ["--simulate", args.simulate, "--max-cpu-loras", str(args.cpu_loras)]
    container["readinessProbe"]["periodSeconds"] = 5  # 50 pods probed each second cost a core
    return d


def set_pods(h: Harness, layout: Layout, known: set[str], make: Callable[[int], Any]) -> None:
    """Every namespace of `layout` with its pods Ready; the namespaces of earlier layouts that
    this one does not use without pods."""
    for i, ns in enumerate(layout.names()):
        if ns not in known:
            h.create(
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            )
            known.add(ns)
        h.apply(make(layout.pods_in(i)), ns)
    for ns in known - set(layout.names()):
        h.kubectl("scale", "-n", ns, "deployment/inference", "--replicas=0")
    for i, ns in enumerate(layout.names()):
        release.ready_pods(h, ns, pods.SELECTOR, layout.pods_in(i), timeout=900)


def pod_ips(h: Harness, layout: Layout) -> dict[str, list[str]]:
    """Namespace -> its Ready pods' IPs."""
    return {
        ns: [
            p["status"]["podIP"]
            for p in h.pods(ns, pods.SELECTOR)
            if release.is_ready(p) and not p["metadata"].get("deletionTimestamp")
        ]
        for ns in layout.names()
    }


def holdings(ips: dict[str, list[str]]) -> dict[tuple[str, str], int]:
    """(namespace, adapter) -> how many of its namespace's pods list it."""
    held: dict[tuple[str, str], int] = {}
    for ns, addresses in ips.items():
        for ip in addresses:
            for name in pods.names_on(ip):
                if name.startswith("a-"):
                    held[(ns, name)] = held.get((ns, name), 0) + 1
    return held


def all_held(ips: dict[str, list[str]], want: set[tuple[str, str]]) -> bool:
    held = holdings(ips)
    return held.keys() == want and set(held.values()) == {scaleplan.REPLICAS}


def list_adapters(h: Harness) -> list[Any]:
    """Every LoRAAdapter, a page of 500 at a time (all 10,000 in one answer would take longer
    than a request may)."""
    items: list[Any] = []
    token = ""
    while True:
        more = f"&continue={urllib.parse.quote(token)}" if token else ""
        page = h.get(ADAPTERS + "?limit=500" + more)
        items += page["items"]
        token = page["metadata"].get("continue") or ""
        if not token:
            return items


def any_left(h: Harness) -> bool:
    """Whether a LoRAAdapter is left (asked for one: a list of thousands costs the API server)."""
    try:
        return bool(h.get(ADAPTERS + "?limit=1")["items"])
    except (ApiError, OSError):
        return True


def all_ready(h: Harness, k: int) -> bool:
    try:
        items = list_adapters(h)
    except (ApiError, OSError):  # a restarted API server answers 429 while its caches fill
        return False
    ready = f"{scaleplan.REPLICAS}/{scaleplan.REPLICAS}"
    done = [i for i in items if (i.get("status") or {}).get("phase") == "Ready"]
    return (
        len(items) == k
        and all((i.get("status") or {}).get("ready") == ready for i in done)
        and len(done) == k
    )


def apiserver_pid(h: Harness) -> int:
    """The kube-apiserver of this benchmark's cluster (others may run on the machine): the one
    among the processes of its namespaces."""
    for proc in psutil.Process(h.cluster.unshare_pid).children(recursive=True):
        if proc.name() == "kube-apiserver":
            return int(proc.pid)
    raise RuntimeError(f"no kube-apiserver in the cluster of {h.cluster.dir}")


def kubectl(h: Harness, *args: str) -> None:
    """kubectl without Harness.run's 2-minute limit: it creates or deletes 10,000 objects one
    by one."""
    subprocess.run(["kubectl", *args], env=h.env, check=True, capture_output=True)


def write_sources(volume: Path, layout: Layout) -> None:
    for ns, name, i in layout.adapters():
        src = volume / ns / "src" / f"{name}.safetensors"
        if not src.exists():
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_bytes(lora_bytes(seed=i))


# -- one layout -----------------------------------------------------------------------------


def ended(run: Run, phase: Phase) -> None:
    """Record a finished phase and print its row at once (the table is printed whole at the end)."""
    if not run.phases:
        print("\n".join(scaleplan.phase_header(run)), flush=True)
    run.phases.append(phase)
    print(scaleplan.phase_row(run, phase), flush=True)


def measure(
    h: Harness,
    watched: Watched,
    work: Path,
    volume: Path,
    layout: Layout,
    args: argparse.Namespace,
    started: float,
    rest: float,
) -> Run:
    k = layout.k
    write_sources(volume, layout)
    hot = scaleplan.autoscaled(k)
    docs = [
        scaleplan.adapter_doc(
            ns, name, str(volume / ns / "src" / f"{name}.safetensors"), MODEL_NAME, i < hot
        )
        for ns, name, i in layout.adapters()
    ]
    manifest = work / f"adapters-{k}.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    want = {(ns, name) for ns, name, _ in layout.adapters()}
    ips = pod_ips(h, layout)
    run = Run(layout=layout, phases=[])
    # The observer shares the machine it measures: each poll of the pods reads every pod's
    # /v1/models, each poll of the objects lists all K, so both are spaced with the scale.
    every = max(2.0, layout.n / 10)
    say(started, f"K={k} N={layout.n} NS={layout.namespaces}: {hot} adapters autoscaled")

    # apply -> every adapter on its 2 pods, and every LoRAAdapter Ready 2/2.
    clock = Clock(h, watched)
    machine_before = configuration.cpu_by_kind()
    kubectl(h, "apply", "-f", str(manifest))
    run.apply_s = time.perf_counter() - clock.t0
    say(started, f"kubectl apply {run.apply_s:.1f} s")
    wait("every adapter held", lambda: all_held(ips, want), watched, args.timeout, every)
    wait(
        "the operator's Ready count", lambda: watched.ready_count() == k, watched, args.timeout, 1.0
    )
    wait("every LoRAAdapter Ready", lambda: all_ready(h, k), watched, args.timeout, every)
    ready_s = time.perf_counter() - clock.t0
    machine = configuration.cpu_by_kind()
    machine.subtract(machine_before)
    run.apply_cpu_by = {kind: seconds for kind, seconds in machine.most_common() if seconds > 0}
    ended(run, clock.finish(Phase("apply"), h, watched, ready_s))
    say(started, f"all Ready {ready_s:.1f} s after apply began")

    # at rest.
    clock = Clock(h, watched)
    end = time.monotonic() + rest
    while time.monotonic() < end:
        watched.rss_mib()
        time.sleep(min(10.0, max(0.0, end - time.monotonic())))
    ended(run, clock.finish(Phase("at rest"), h, watched, rest))
    say(started, "at rest done")

    # operator restart -> resumed: the operator counts every adapter Ready again (it has heard
    # every pod since it started and passed over every adapter).
    clock = Clock(h, watched)
    cpu_before_stop = watched.cpu_s() - clock.cpu
    watched.op.stop()
    watched.op.start()
    clock.cpu = -cpu_before_stop  # the new process's CPU counts from 0
    wait(
        "resumed after the restart", lambda: watched.ready_count() == k, watched, args.timeout, 0.5
    )
    resumed_s = time.perf_counter() - clock.t0
    wait("every adapter held", lambda: all_held(ips, want), watched, args.timeout, every)
    time.sleep(SETTLE_S)
    phase = clock.finish(Phase("restart"), h, watched, resumed_s)
    phase.note = f"(counted until {SETTLE_S:.0f} s after every adapter was held again)"
    ended(run, phase)
    say(started, f"resumed {resumed_s:.1f} s after the restart began")

    # The API server unavailable for args.outage seconds (frozen: every connection hangs), then
    # restarted (connections break; a new process on the same etcd).
    clock = Clock(h, watched)
    pid = apiserver_pid(h)
    os.kill(pid, signal.SIGSTOP)
    halfway = time.monotonic() + args.outage / 2
    while time.monotonic() < halfway:
        watched.rss_mib()
        time.sleep(1.0)
    served = holdings(ips)  # the pods answer while the API server does not
    kept = sum(1 for key in want if served.get(key) == scaleplan.REPLICAS)
    end = clock.t0 + args.outage
    while time.perf_counter() < end:
        watched.rss_mib()
        time.sleep(1.0)
    os.kill(pid, signal.SIGCONT)
    h.restart_apiserver()
    clock.requests = {}  # the new API server counts from 0
    back_s = time.perf_counter() - clock.t0
    say(started, f"API server back {back_s:.1f} s after it was stopped")
    wait(
        "every LoRAAdapter Ready after the outage",
        lambda: all_ready(h, k),
        watched,
        args.timeout,
        every,
    )
    wait("every adapter held", lambda: all_held(ips, want), watched, args.timeout, every)
    ready_again_s = time.perf_counter() - clock.t0
    time.sleep(args.after_outage)
    phase = clock.finish(Phase("API outage"), h, watched, ready_again_s)
    alive = watched.op.proc is not None and watched.op.proc.poll() is None
    phase.note = (
        f"(API back at {back_s:.0f} s; halfway {kept}/{k} adapters served on their 2 pods;"
        f" operator {'running' if alive else 'EXITED'}; writes counted from the restart"
        f" until {args.after_outage:.0f} s after all Ready)"
    )
    ended(run, phase)
    say(started, f"all Ready again {ready_again_s:.1f} s after the outage began")

    # The bare calls' copies, then delete all.
    names_by_ip: dict[str, list[str]] = {ip: [] for addresses in ips.values() for ip in addresses}
    root_by_ip = {
        ip: f"{POD_VOLUME}/{ns}/bare" for ns, addresses in ips.items() for ip in addresses
    }
    ip_of = {
        p["metadata"]["name"]: p["status"]["podIP"]
        for ns in layout.names()
        for p in h.pods(ns, pods.SELECTOR)
        if p.get("status", {}).get("podIP")
    }
    for item in list_adapters(h):
        ns, name = item["metadata"]["namespace"], item["metadata"]["name"]
        for pod in item["status"]["placedPods"]:
            names_by_ip[ip_of[pod]].append(name)
        (revision,) = (volume / ns / name / "revisions").iterdir()
        shutil.copytree(revision, volume / ns / "bare" / name, symlinks=False)
    for ns in layout.names():
        cluster.readable_by_pods(volume / ns / "bare")
    clock = Clock(h, watched)
    kubectl(h, "delete", "loraadapters", "--all", "-A", "--wait=false")
    wait(
        "every adapter unloaded and gone",
        lambda: not any_left(h) and not holdings(ips),
        watched,
        args.timeout,
        every,
    )
    ended(run, clock.finish(Phase("delete"), h, watched, time.perf_counter() - clock.t0))
    say(started, "deleted")

    run.bare_s, _, run.bare_unload_s = asyncio.run(pods.bare_calls(names_by_ip, root_by_ip))
    for ns in layout.names():
        shutil.rmtree(volume / ns / "bare")
    say(started, f"bare loads {run.bare_s:.1f} s, unloads {run.bare_unload_s:.1f} s")
    return run


def main(args: argparse.Namespace) -> None:
    layouts = [
        Layout(k, n, ns)
        for k, n, ns in zip(
            args.adapters, args.pods, args.namespaces or [1] * len(args.pods), strict=True
        )
    ]
    args.cpu_loras = args.cpu_loras or 2 * max(layout.per_pod() for layout in layouts) + 64
    started = time.monotonic()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="lora-bench-operator-scale-") as scratch:
        work = Path(scratch)
        (work / "models" / MODEL_NAME).mkdir(parents=True)
        cluster.readable_by_pods(work / "models")
        volume = work / "volume"
        volume.mkdir()
        log_dir = args.log_dir or work
        log_dir.mkdir(parents=True, exist_ok=True)
        with bench_cluster.local_cluster(work / "cluster", images.built()) as h:
            h.kubectl("apply", "-f", str(CRD))
            h.kubectl(
                "wait", "--for=condition=Established", "crd/loraadapters.lora.dev", "--timeout=60s"
            )
            kubeconfig = apiserver.operator_kubeconfig(h, work / "operator.kubeconfig")
            op = cluster.Operator(
                volume=volume,
                namespaces=[],
                log_path=log_dir / "operator.log",
                extra=["--resync-seconds", "30"],
                env={"KUBECONFIG": str(kubeconfig)},
            )
            op.start()
            watched = Watched(op)
            known: set[str] = set()
            try:
                for i, layout in enumerate(layouts):
                    if i:  # each layout's figures from an operator of its own
                        op.stop()
                        op.start()
                    set_pods(h, layout, known, lambda n: deployment(h, work, volume, n, args))
                    say(
                        started,
                        f"{layout.n} simulated pods Ready in {layout.namespaces} namespaces",
                    )
                    rest = args.rest[min(i, len(args.rest) - 1)]
                    runs.append(measure(h, watched, work, volume, layout, args, started, rest))
            finally:
                op.stop()
    memory = psutil.virtual_memory().total / 2**30
    rests = "/".join(f"{r:.0f}" for r in args.rest)
    print(
        f"\nlora-operator at scale on lora-devcluster, simulated pods ({args.simulate}, "
        f"--max-cpu-loras {args.cpu_loras}); {platform.machine()}, {os.cpu_count()} cores, "
        f"{memory:.0f} GiB; {datetime.date.today().isoformat()}; operator --resync-seconds 30, "
        f"--max-concurrent-loads 16; each adapter spec.replicas {scaleplan.REPLICAS}, a Zipf head"
        f" spec.autoscale {scaleplan.AUTOSCALE}; at rest {rests} s, API server"
        f" unavailable {args.outage:.0f} s"
    )
    for run in runs:
        print()
        print("\n".join(scaleplan.phase_table(run)))
    print(
        "\nwrites/ad: the operator's writes to LoRAAdapters (the finalizer, status patches) per"
        " adapter; events/ad: its Event writes per adapter; other req: its other requests but"
        " watches; RSS: at the phase's end, peak: the most sampled in it; CPU: the operator's;"
        " loads, unloads: its calls per pod (mean, most). apply: kubectl apply -> every adapter"
        " Ready; restart: stop -> a new process counts every adapter Ready; API outage: stop ->"
        " every adapter Ready again, its writes counted by the restarted API server."
    )
    print()
    print("\n".join(scaleplan.growth_table(runs)))
    print(
        "apply: kubectl apply itself; ready: apply -> every adapter Ready; bare: the same placed"
        " load calls made directly, one at a time per pod, the pods in parallel; CPU ms/load: the"
        " operator's CPU from apply to Ready per load call."
    )
    print("\nCPU seconds from apply to Ready, by process (the whole machine):")
    print("\n".join(scaleplan.cpu_lines(runs)))
    print(scaleplan.last_line(max(runs, key=lambda r: (r.layout.k, r.layout.n))))
