"""Prometheus metrics of the router, served on `--metrics-port` at /metrics
(`lora_runtime.metrics.app`)."""

from __future__ import annotations

from lora_runtime import metrics
from prometheus_client import Counter


class Metrics(metrics.Collectors):
    def __init__(self) -> None:
        super().__init__()
        # The counters each request touches, by their labels: `labels()` takes a lock and builds
        # its key on every call.
        self._answers: dict[tuple[str, str], Counter] = {}
        self._failures: dict[str, Counter] = {}
        self.requests = self.counter(
            "lora_router_requests",
            "Requests routed, by routing reason (gpu-resident, cpu-resident, free-slot, "
            "least-queued, no-residency, overflow, unplaced, base, balanced) and the status "
            "answered",
            "reason",
            "code",
        )
        self.affinity_hits = self.counter(
            "lora_router_affinity_hits",
            "Requests sent to a pod that reported their adapter resident (GPU or CPU tier)",
        )
        self.retries = self.counter(
            "lora_router_retries",
            "Requests sent again to another pod after a connection failed before the answer",
        )
        self.failures = self.counter(
            "lora_router_upstream_failures",
            "Upstream failures by kind (connect, disconnect, gone, timeout, midstream)",
            "kind",
        )
        self.upstream_seconds = self.histogram(
            "lora_router_upstream_seconds",
            "Time from sending a request to a pod to the end of its answer",
        )
        self.pods = self.gauge(
            "lora_router_pods",
            "Inference pods by state: ready (routable) and reporting (a fresh residency report)",
            "state",
        )
        self.load = self.gauge(
            "lora_router_load",
            "Requests queued or running on the Ready pods as the router counts them (per pod, "
            "its own requests in flight plus the rest of the pod's last report)",
        )
        self.report_failures = self.counter(
            "lora_router_report_failures", "Residency polls (GET /v1/adapters) that failed"
        )
        self.rollout_requests = self.counter(
            "lora_router_rollout_requests",
            "Requests for adapters under a weighted rollout, by adapter, revision (the first 12 "
            "hex of its sha256) and the status answered: each revision's traffic and errors",
            "adapter",
            "revision",
            "code",
        )

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
