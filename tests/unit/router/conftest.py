"""A live router on 127.0.0.1 whose fleet a test sets directly (the API watches are a seam:
`create_app(sources=...)`), in front of live HTTP backends. The router listens as
`python -m lora_router` does: its own server for the generations, aiohttp's for the rest
(`lora_router.server.Site`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest_asyncio
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from lora_router.app import create_app
from lora_router.config import RouterConfig
from lora_router.fleet import AdapterPlacement, Endpoint, Fleet
from lora_router.metrics import Metrics
from lora_router.server import Site
from lora_router.state import STATE, ProxyState

from tests.support import polling

ROUTER_CONFIG = RouterConfig(namespace="test", poll_interval_s=0.05, stale_after_s=1.0)


async def listed(fleet: Fleet, state: ProxyState) -> None:
    """A source that lists nothing: the test sets the fleet."""
    fleet.synced.update({"endpoints", "adapters"})


@dataclass
class Router:
    site: Site
    runner: web.AppRunner
    app: web.Application
    fleet: Fleet
    metrics: Metrics
    session: ClientSession

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.site.port}{path}"

    def set_pods(self, pods: dict[str, str], ready: bool = True) -> None:
        """Pod name -> host:port, as one EndpointSlice."""
        self.fleet.slices = {"slice": [Endpoint(p, a, ready) for p, a in pods.items()]}
        self.app[STATE].endpoints_changed()

    def place(self, adapter: str, pods: frozenset[str] | None) -> None:
        self.fleet.adapters[adapter] = AdapterPlacement(adapter, pods)

    def metric(self, name: str, **labels: str) -> float:
        return float(self.metrics.registry.get_sample_value(name, labels) or 0.0)

    async def wait_until(self, what: str, check: Callable[[], bool]) -> None:
        """Until `check()` holds (a failure after 20 s, not a hang)."""
        await polling.until(f"the router to see {what}", check, interval=0.02)

    async def wait_reports(self, pods: set[str]) -> None:
        await self.wait_until(f"reports from {pods}", lambda: pods <= set(self.fleet.reports))


StartRouter = Callable[..., Awaitable[Router]]


@pytest_asyncio.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    started: list[Router] = []

    async def start(**overrides: Any) -> Router:
        metrics = Metrics()
        app = create_app(replace(ROUTER_CONFIG, **overrides), sources=[listed], metrics=metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = Site(runner, "127.0.0.1", 0)
        await site.start()
        router = Router(site, runner, app, app[STATE].fleet, metrics, ClientSession())
        started.append(router)
        return router

    yield start
    for router in started:
        await router.session.close()
        await router.runner.cleanup()


@pytest_asyncio.fixture
async def start_backend() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """Start an aiohttp app on 127.0.0.1; returns its host:port."""
    servers: list[TestServer] = []

    async def start(app: web.Application) -> str:
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return f"127.0.0.1:{server.port}"

    yield start
    for server in servers:
        await server.close()
