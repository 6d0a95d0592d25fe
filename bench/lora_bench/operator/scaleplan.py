"""The scale benchmark's own arithmetic (pure; `scale` runs it on a cluster): how K adapters and N
simulated pods are spread over the namespaces, which adapters autoscale (a Zipf head), the
LoRAAdapter documents, the operator's calls per pod read from its log, and the report: one row
per phase, the growth table and the last line.

An adapter targets the pods of its own namespace (docs/operator.md), so every namespace gets
pods of its own, at least `spec.replicas` of them: N pods serve at most N // replicas namespaces.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REPLICAS = 2
AUTOSCALE = {"minReplicas": 2, "maxReplicas": 4}
ZIPF_S = 1.0
AUTOSCALE_SHARE = 0.5  # the head of the Zipf stream that asks for this share of the requests
PHASES = ("apply", "at rest", "restart", "API outage", "delete")


@dataclass(frozen=True)
class Layout:
    """K adapters and N pods over NS namespaces."""

    k: int
    n: int
    namespaces: int

    def __post_init__(self) -> None:
        if self.namespaces < 1 or self.k < 1 or self.n < 1:
            raise ValueError("K, N and the namespaces must be at least 1")
        if self.n // self.namespaces < REPLICAS:
            raise ValueError(
                f"{self.n} pods cannot serve {self.namespaces} namespaces with spec.replicas "
                f"{REPLICAS}: an adapter targets the pods of its own namespace, so each needs "
                f"{REPLICAS}; at most {self.n // REPLICAS} namespaces"
            )

    def namespace(self, i: int) -> str:
        return f"team-{i:03d}"

    def names(self) -> list[str]:
        return [self.namespace(i) for i in range(self.namespaces)]

    def pods_in(self, i: int) -> int:
        """Pods of namespace i: N spread evenly, the first ones one more."""
        return self.n // self.namespaces + (1 if i < self.n % self.namespaces else 0)

    def adapters(self) -> list[tuple[str, str, int]]:
        """(namespace, name, global index) of every adapter: round-robin over the namespaces."""
        return [(self.namespace(i % self.namespaces), f"a-{i:05d}", i) for i in range(self.k)]

    def per_pod(self) -> int:
        """The most adapters placement may give one pod at the widest autoscale."""
        per_ns = math.ceil(self.k / self.namespaces)
        fewest = self.n // self.namespaces
        return math.ceil(per_ns * AUTOSCALE["maxReplicas"] / fewest)


def autoscaled(k: int, share: float = AUTOSCALE_SHARE, s: float = ZIPF_S) -> int:
    """How many of the K adapters, the hottest first, a Zipf(s) stream sends `share` of its
    requests to: those have spec.autoscale, the rest spec.replicas."""
    weights = [1 / (r + 1) ** s for r in range(k)]
    total, running = sum(weights), 0.0
    for i, w in enumerate(weights):
        running += w
        if running >= share * total:
            return i + 1
    return k


def adapter_doc(namespace: str, name: str, uri: str, model: str, autoscale: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"baseModel": model, "source": {"uri": uri}}
    if autoscale:
        spec["autoscale"] = dict(AUTOSCALE)
    else:
        spec["replicas"] = REPLICAS
    return {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


_ACTION = re.compile(r"action=(load|load-inplace|unload) pod=(\S+) .*result=ok")


def calls_per_pod(log_lines: Iterable[str]) -> dict[str, Counter[str]]:
    """The operator's successful load and unload calls by pod (`ns/pod`), from its log lines
    (`action=load pod=ns/p adapter=... result=ok`)."""
    out: dict[str, Counter[str]] = {"load": Counter(), "unload": Counter()}
    for line in log_lines:
        m = _ACTION.search(line)
        if m is not None:
            out["unload" if m.group(1) == "unload" else "load"][m.group(2)] += 1
    return out


@dataclass
class Phase:
    """What one phase cost: its wall time and the operator's API writes, Events, memory, CPU
    and calls to the pods."""

    name: str
    wall_s: float = 0.0
    writes: int = 0  # to LoRAAdapters: the finalizer and status patches
    events: int = 0  # Event creates and series patches
    other: int = 0  # every other request but watches
    rss_mib: float = 0.0  # at the end of the phase
    peak_rss_mib: float = 0.0  # the most sampled during it
    cpu_s: float = 0.0
    loads: Counter[str] = field(default_factory=Counter)  # per pod
    unloads: Counter[str] = field(default_factory=Counter)
    note: str = ""


def per_pod(counts: Counter[str], pods: int) -> tuple[float, int]:
    """(mean, most) calls per pod over `pods` pods."""
    return sum(counts.values()) / pods, max(counts.values(), default=0)


@dataclass
class Run:
    layout: Layout
    phases: list[Phase]
    apply_s: float = 0.0  # `kubectl apply` itself (creates the objects one by one)
    bare_s: float = 0.0  # the placed load calls made directly, all pods
    bare_unload_s: float = 0.0
    requests: Mapping[str, int] | None = None
    apply_cpu_by: Mapping[str, float] | None = None  # every process's CPU, apply to Ready, by kind

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


def phase_table(run: Run) -> list[str]:
    return [*phase_header(run), *(phase_row(run, p) for p in run.phases)]


def phase_header(run: Run) -> list[str]:
    return [
        f"K={run.layout.k} N={run.layout.n} NS={run.layout.namespaces}",
        f"{'phase':<11}{'wall s':>8}{'writes/ad':>10}{'events/ad':>10}{'other req':>10}"
        f"{'RSS MiB':>8}{'peak':>6}{'CPU s':>8}{'loads/pod':>10}{'max':>5}{'unloads/pod':>12}"
        f"{'max':>5}",
    ]


def phase_row(run: Run, p: Phase) -> str:
    """One phase's row of `phase_table`: printed as the phase ends too, so that a run stopped
    part-way leaves the phases it finished."""
    n, k = run.layout.n, run.layout.k
    loads, most_loads = per_pod(p.loads, n)
    unloads, most_unloads = per_pod(p.unloads, n)
    return (
        f"{p.name:<11}{p.wall_s:8.1f}{p.writes / k:10.2f}{p.events / k:10.2f}{p.other:10d}"
        f"{p.rss_mib:8.0f}{p.peak_rss_mib:6.0f}{p.cpu_s:8.1f}{loads:10.1f}{most_loads:5d}"
        f"{unloads:12.1f}{most_unloads:5d}" + (f"  {p.note}" if p.note else "")
    )


def cpu_per_load_ms(run: Run) -> float:
    apply = run.phase("apply")
    loads = sum(apply.loads.values())
    return 1000 * apply.cpu_s / loads if loads else math.nan


def ready_over_bare(run: Run) -> float:
    """(apply -> Ready, less `kubectl apply` itself) over the bare load calls: kubectl creates
    the objects one by one and the operator starts on each as it arrives."""
    return (run.phase("apply").wall_s - run.apply_s) / run.bare_s if run.bare_s else math.nan


def growth_table(runs: Sequence[Run]) -> list[str]:
    lines = [
        f"{'K':>6}{'N':>4}{'NS':>4} |{'apply s':>8}{'ready s':>8}{'bare s':>8}"
        f"{'(ready-apply)/bare':>19}"
        f"{'writes/ad':>10}{'events/ad':>10}{'RSS MiB':>8}{'CPU ms/load':>12}"
        f"{'restart s':>10}{'restart loads':>14}{'outage writes/ad':>17}"
    ]
    for r in runs:
        apply, restart, outage = r.phase("apply"), r.phase("restart"), r.phase("API outage")
        k = r.layout.k
        lines.append(
            f"{k:6d}{r.layout.n:4d}{r.layout.namespaces:4d} |{r.apply_s:8.1f}{apply.wall_s:8.1f}"
            f"{r.bare_s:8.1f}{ready_over_bare(r):19.2f}{apply.writes / k:10.2f}"
            f"{apply.events / k:10.2f}{max(p.peak_rss_mib for p in r.phases):8.0f}"
            f"{cpu_per_load_ms(r):12.2f}{restart.wall_s:10.1f}"
            f"{sum(restart.loads.values()):14d}{outage.writes / k:17.2f}"
        )
    return lines


def cpu_lines(runs: Sequence[Run]) -> list[str]:
    """The machine's CPU seconds from apply to Ready by kind of process, per run."""
    return [
        f"K={r.layout.k} N={r.layout.n}: "
        + ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in (r.apply_cpu_by or {}).items())
        for r in runs
    ]


def last_line(run: Run) -> str:
    apply, restart = run.phase("apply"), run.phase("restart")
    rss = max(p.peak_rss_mib for p in run.phases)
    return (
        f"operator-scale: K={run.layout.k} N={run.layout.n} ready s = {apply.wall_s:.0f}, "
        f"writes/adapter = {apply.writes / run.layout.k:.2f}, rss MiB = {rss:.0f}, "
        f"restart loads = {sum(restart.loads.values())}"
    )
