"""The Prometheus plumbing of the operator, the router and the inference server: each declares
its own metrics on a `Collectors` (a registry per instance, so tests run several servers in one
process) and serves them at /metrics with `exposition` (in an app of its own) or `serve` (on a
port of its own).

Owns: the registry and the exposition. Must not: name a metric (each component names its own, in
its own `metrics` module, where `make docs` finds them).
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Seconds, from a fast API call to a long staging or generation.
LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Collectors:
    """One component's metrics, in a registry of their own: a subclass declares each as an
    attribute, made by `counter`, `gauge` or `histogram`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, *labels: str, buckets: Sequence[float] = LATENCY_BUCKETS_S
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)


def exposition(registry: CollectorRegistry) -> web.Response:
    """The answer to a scrape: every metric of `registry` in Prometheus' text format."""
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def app(registry: CollectorRegistry) -> web.Application:
    """An application that answers `GET /metrics` with `registry`, and nothing else."""

    async def handle(_: web.Request) -> web.Response:
        return exposition(registry)

    application = web.Application()
    application.router.add_get("/metrics", handle)
    return application


async def serve(registry: CollectorRegistry, host: str, port: int) -> web.AppRunner:
    """`app(registry)` listening on `host:port`; the caller cleans the runner up."""
    runner = web.AppRunner(app(registry), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
