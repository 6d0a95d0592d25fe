"""Prometheus metrics of the operator, served on `--metrics-port` at /metrics
(`lora_runtime.metrics.serve`)."""

from __future__ import annotations

import contextlib
import math

from lora_runtime import metrics

from lora_operator.rules import status


class Metrics(metrics.Collectors):
    def __init__(self) -> None:
        super().__init__()
        self.adapters = self.gauge("lora_operator_adapters", "LoRAAdapters by phase", "phase")
        self.loads = self.counter(
            "lora_operator_pod_loads",
            "Load calls to inference pods by result (ok, transient, permanent)",
            "result",
        )
        self.unloads = self.counter("lora_operator_pod_unloads", "Unload calls by result", "result")
        self.load_seconds = self.histogram(
            "lora_operator_pod_load_seconds", "Time of one load call to a pod"
        )
        self.staging_seconds = self.histogram(
            "lora_operator_staging_seconds", "Time to stage an adapter's source onto the volume"
        )
        self.stagings = self.counter("lora_operator_stagings", "Stagings by result", "result")
        self.staged_bytes = self.counter(
            "lora_operator_staged_bytes", "Bytes written to the adapter volume"
        )
        self.reconcile_seconds = self.histogram(
            "lora_operator_pod_reconcile_seconds",
            "Time of one pod reconciliation (read /v1/models, act, verify)",
        )
        self.collected_bytes = self.counter(
            "lora_operator_collected_bytes", "Bytes freed by garbage collection"
        )
        self.namespace_volume = self.gauge(
            "lora_operator_namespace_volume_bytes",
            "Bytes of the adapter volume a namespace uses: the distinct files its revisions "
            "hold (a file shared with another namespace counts in both) and what its downloads "
            "in progress have reserved; counted against its quota",
            "namespace",
        )
        self.namespace_quota = self.gauge(
            "lora_operator_namespace_quota_bytes",
            "Bytes of the adapter volume each namespace may use (--namespace-quota; +Inf: no "
            "limit)",
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
