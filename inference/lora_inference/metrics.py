"""Prometheus metrics of one server instance (a registry per app, so tests can run several).

Besides our own `lora_*` series, the few that schedulers built for vLLM read, in vLLM's names
and shape (`vllm:*`), so a Gateway API inference extension or llm-d scorer routes image traffic
by adapter affinity and queue length as it does text. Only the values are ours to set; this
module decides nothing about adapters or the queue; the registry and /metrics are
`lora_runtime.metrics`'s.
"""

from __future__ import annotations

from collections.abc import Collection

from lora_runtime import metrics

# Finer at the short end than the operator's and the router's: loads and batches on a GPU.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics(metrics.Collectors):
    def __init__(self) -> None:
        super().__init__()
        self.adapters = self.gauge("lora_adapters", "Registered adapters by tier", "tier")
        self.loads = self.counter(
            "lora_adapter_loads", "Adapter loads into a tier, by result", "tier", "result"
        )
        self.evictions = self.counter("lora_adapter_evictions", "Adapters evicted, by tier", "tier")
        self.lookups = self.counter(
            "lora_adapter_lookups",
            "Batches whose adapter was resident (hit) or not (miss)",
            "result",
        )
        self.load_seconds = self.histogram(
            "lora_adapter_load_seconds",
            "Time to load an adapter, by tier",
            "tier",
            buckets=_LATENCY_BUCKETS,
        )
        self.generation_seconds = self.histogram(
            "lora_generation_seconds", "Time to generate one batch", buckets=_LATENCY_BUCKETS
        )
        self.queue_depth = self.gauge("lora_queue_depth", "Requests waiting for the pipeline")
        self.batches = self.counter(
            "lora_batches",
            "Pipeline calls by path: base, adapter (one, unmerged), merged, mixed (routed)",
            "path",
        )
        self.batch_images = self.histogram(
            "lora_batch_images", "Images per batch", buckets=(1, 2, 4, 8, 16, 32)
        )
        self.requests = self.counter(
            "lora_generation_requests", "Generation requests by outcome", "outcome"
        )
        # Per adapter, for the dashboards: one series per name the pod has answered for (its
        # registered adapters and stacks, and the base model), so as many as it has registered.
        self.model_requests = self.counter(
            "lora_model_requests",
            "Generation requests answered, by the model they named: an adapter, a stack or the "
            "base model",
            "model",
        )
        self.requests_waiting = self.gauge(
            "vllm:num_requests_waiting",
            "Requests queued, not yet in a batch (vLLM's name; model_name: the served model)",
            "model_name",
        )
        self.requests_running = self.gauge(
            "vllm:num_requests_running",
            "Requests in the batch being generated (vLLM's name; model_name: the served model)",
            "model_name",
        )
        self.lora_info = self.gauge(
            "vllm:lora_requests_info",
            "One series, valued at the unix time it was last refreshed: max_lora, the GPU slots; "
            "running_lora_adapters, the adapters in them; waiting_lora_adapters, the adapters "
            "queued requests wait for (names comma-joined, sorted; vLLM's name and labels)",
            "max_lora",
            "running_lora_adapters",
            "waiting_lora_adapters",
        )
        self._lora_info_labels: tuple[str, str, str] | None = None
        self.simulated = self.gauge(
            "lora_simulated_gpu",
            "1 on a server whose pipeline is simulated (lora-inference serve --simulate): a "
            "benchmark and test tool whose times come from the profile and whose images are "
            "stand-ins",
            "profile",
        )

    def set_lora_info(
        self, max_lora: int, *, running: Collection[str], waiting: Collection[str], at: float
    ) -> None:
        """Make the one `vllm:lora_requests_info` series say this, valued `at` (a unix time).

        vLLM adds a series at every change and readers take the one with the largest value; one
        series, replaced when its labels change, reads the same and keeps cardinality bounded.
        """
        labels = (str(max_lora), ",".join(sorted(running)), ",".join(sorted(waiting)))
        if self._lora_info_labels is not None and self._lora_info_labels != labels:
            self.lora_info.remove(*self._lora_info_labels)
        self._lora_info_labels = labels
        self.lora_info.labels(*labels).set(at)
