"""Prometheus metrics of the operator, served on `--metrics-port` at /metrics."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from lora_operator import status

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=_registry)

    def __post_init__(self) -> None:
        r = self.registry
        self.adapters = Gauge(
            "lora_operator_adapters", "LoRAAdapters by phase", ["phase"], registry=r
        )
        self.loads = Counter(
            "lora_operator_pod_loads",
            "Load calls to inference pods by result (ok, transient, permanent)",
            ["result"],
            registry=r,
        )
        self.unloads = Counter(
            "lora_operator_pod_unloads", "Unload calls by result", ["result"], registry=r
        )
        self.load_seconds = Histogram(
            "lora_operator_pod_load_seconds",
            "Time of one load call to a pod",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.staging_seconds = Histogram(
            "lora_operator_staging_seconds",
            "Time to stage an adapter's source onto the volume",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stagings = Counter(
            "lora_operator_stagings", "Stagings by result", ["result"], registry=r
        )
        self.staged_bytes = Counter(
            "lora_operator_staged_bytes", "Bytes written to the adapter volume", registry=r
        )
        self.reconcile_seconds = Histogram(
            "lora_operator_pod_reconcile_seconds",
            "Time of one pod reconciliation (read /v1/models, act, verify)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.collected_bytes = Counter(
            "lora_operator_collected_bytes", "Bytes freed by garbage collection", registry=r
        )
        self.namespace_volume = Gauge(
            "lora_operator_namespace_volume_bytes",
            "Bytes of the adapter volume a namespace uses: the distinct files its revisions "
            "hold (a file shared with another namespace counts in both) and what its downloads "
            "in progress have reserved; counted against its quota",
            ["namespace"],
            registry=r,
        )
        self.namespace_quota = Gauge(
            "lora_operator_namespace_quota_bytes",
            "Bytes of the adapter volume each namespace may use (--namespace-quota; +Inf: no "
            "limit)",
            registry=r,
        )
        self.namespace_quota.set(math.inf)

    def set_namespace_quota(self, limit: int | None) -> None:
        self.namespace_quota.set(math.inf if limit is None else limit)

    def set_namespace_usage(self, namespace: str, used: int) -> None:
        """A namespace's usage of the volume (the store's `on_usage`, from any thread); a
        namespace that uses nothing has no series."""
        if used:
            self.namespace_volume.labels(namespace).set(used)
            return
        with contextlib.suppress(KeyError):
            self.namespace_volume.remove(namespace)

    def set_phases(self, phases: dict[str, int]) -> None:
        for phase in status.PHASES:
            self.adapters.labels(phase).set(phases.get(phase, 0))


async def serve(metrics: Metrics, host: str, port: int) -> web.AppRunner:
    async def handle(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
