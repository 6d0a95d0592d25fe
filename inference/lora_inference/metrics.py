"""Prometheus metrics of one server instance (a registry per app, so tests can run several)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=_registry)

    def __post_init__(self) -> None:
        r = self.registry
        self.adapters = Gauge("lora_adapters", "Registered adapters by tier", ["tier"], registry=r)
        self.loads = Counter(
            "lora_adapter_loads",
            "Adapter loads into a tier, by result",
            ["tier", "result"],
            registry=r,
        )
        self.evictions = Counter(
            "lora_adapter_evictions", "Adapters evicted, by tier", ["tier"], registry=r
        )
        self.lookups = Counter(
            "lora_adapter_lookups",
            "Batches whose adapter was resident (hit) or not (miss)",
            ["result"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "lora_adapter_load_seconds",
            "Time to load an adapter, by tier",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_seconds = Histogram(
            "lora_generation_seconds",
            "Time to generate one batch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "lora_queue_depth", "Requests waiting for the pipeline", registry=r
        )
        self.batches = Counter(
            "lora_batches",
            "Pipeline calls by path: base, adapter (one, unmerged), merged, mixed (routed)",
            ["path"],
            registry=r,
        )
        self.batch_images = Histogram(
            "lora_batch_images", "Images per batch", buckets=(1, 2, 4, 8, 16, 32), registry=r
        )
        self.requests = Counter(
            "lora_generation_requests", "Generation requests by outcome", ["outcome"], registry=r
        )
