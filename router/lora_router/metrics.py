"""Prometheus metrics of the router, served on `--metrics-port` at /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=_registry)
    # The counters each request touches, by their labels: `labels()` takes a lock and builds
    # its key on every call.
    _answers: dict[tuple[str, str], Counter] = field(default_factory=dict, repr=False)
    _failures: dict[str, Counter] = field(default_factory=dict, repr=False)

    def answered(self, reason: str, code: int) -> None:
        """Count one answer in `lora_router_requests_total` (`reason` "none": no pod took it)."""
        key = (reason, str(code))
        child = self._answers.get(key)
        if child is None:
            child = self._answers[key] = self.requests.labels(*key)
        child.inc()

    def failure(self, kind: str) -> None:
        """Count one upstream failure of `kind` in `lora_router_upstream_failures_total`."""
        child = self._failures.get(kind)
        if child is None:
            child = self._failures[kind] = self.failures.labels(kind)
        child.inc()

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "lora_router_requests",
            "Requests routed, by routing reason (gpu-resident, cpu-resident, free-slot, "
            "least-queued, no-residency, overflow, unplaced, base, balanced) and the status "
            "answered",
            ["reason", "code"],
            registry=r,
        )
        self.affinity_hits = Counter(
            "lora_router_affinity_hits",
            "Requests sent to a pod that reported their adapter resident (GPU or CPU tier)",
            registry=r,
        )
        self.retries = Counter(
            "lora_router_retries",
            "Requests sent again to another pod after a connection failed before the answer",
            registry=r,
        )
        self.failures = Counter(
            "lora_router_upstream_failures",
            "Upstream failures by kind (connect, disconnect, gone, timeout, midstream)",
            ["kind"],
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "lora_router_upstream_seconds",
            "Time from sending a request to a pod to the end of its answer",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pods = Gauge(
            "lora_router_pods",
            "Inference pods by state: ready (routable) and reporting (a fresh residency report)",
            ["state"],
            registry=r,
        )
        self.load = Gauge(
            "lora_router_load",
            "Requests queued or running on the Ready pods as the router counts them (per pod, "
            "its own requests in flight plus the rest of the pod's last report)",
            registry=r,
        )
        self.report_failures = Counter(
            "lora_router_report_failures",
            "Residency polls (GET /v1/adapters) that failed",
            registry=r,
        )
        self.rollout_requests = Counter(
            "lora_router_rollout_requests",
            "Requests for adapters under a weighted rollout, by adapter, revision (the first 12 "
            "hex of its sha256) and the status answered: each revision's traffic and errors",
            ["adapter", "revision", "code"],
            registry=r,
        )
