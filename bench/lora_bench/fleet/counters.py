"""The pods' own counters, read through the API server before and after every round (GET
/metrics and GET /v1/adapters), and the CPU time of the inference and router containers."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
from lora_demo import release
from lora_devcluster.harness import Harness
from prometheus_client.parser import text_string_to_metric_families

from lora_bench.fleet import objects


@dataclass(frozen=True)
class Snapshot:
    """Every inference pod's counters at one moment, and the CPU time of the containers."""

    metrics: dict[str, dict[str, float]]  # pod -> sample -> value
    hits: dict[str, dict[str, int]]  # pod -> adapter -> requests (GET /v1/adapters `hits`)
    tiers: dict[str, dict[str, str]]  # pod -> adapter -> gpu, cpu or disk (GET /v1/adapters)
    inference_cpu_s: float
    router_cpu_s: float


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label=value,...}': value}, buckets left out."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = float(s.value)
    return out


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def snapshot(
    h: Harness, pods: list[str], inference: list[psutil.Process], router: list[psutil.Process]
) -> Snapshot:
    metrics, hits, tiers = {}, {}, {}
    for pod in pods:
        status, raw = h.proxy(objects.NS, release.pod_target(pod), "/metrics", timeout=30)
        if status != 200:
            raise RuntimeError(f"/metrics of {pod} answered {status}")
        metrics[pod] = parse_metrics(raw.decode())
        listing = release.call(h, objects.NS, release.pod_target(pod), "/v1/adapters")
        hits[pod] = {a["id"]: int(a["hits"]) for a in listing["data"]}
        tiers[pod] = {a["id"]: str(a["tier"]) for a in listing["data"]}
    return Snapshot(metrics, hits, tiers, cpu_seconds(inference), cpu_seconds(router))


def counted(before: Snapshot, after: Snapshot, sample: str) -> float:
    """The increase of one sample, summed over the pods."""
    return sum(
        after.metrics[p].get(sample, 0.0) - before.metrics[p].get(sample, 0.0)
        for p in after.metrics
    )


def pids_of(h: Harness, selector: str, container: str) -> list[psutil.Process]:
    out = []
    for pod in h.pods(objects.NS, selector):
        out += [psutil.Process(pid) for pid in h.container_pids(pod["metadata"]["uid"], container)]
    if not out:
        raise RuntimeError(f"no process of the {container} containers ({selector}) on the node")
    return out
