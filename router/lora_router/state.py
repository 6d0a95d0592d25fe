"""What the router's handlers and background loops share: the application's keys and
`ProxyState`, the I/O side of routing (the connection pool to the pods, the client session of
the polls, the signal that a pod left, the loops that stopped, draining).

Must not: route (that is `routing`, pure) or answer requests (`proxy`, `app`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from lora_router import upstream as upstream_mod
from lora_router.config import RouterConfig
from lora_router.fleet import Fleet
from lora_router.metrics import Metrics

log = logging.getLogger("lora_router")

CONFIG = web.AppKey("config", RouterConfig)
FLEET = web.AppKey("fleet", Fleet)
METRICS = web.AppKey("metrics", Metrics)


class PodGone(Exception):
    """The pod left the endpoints while a request to it waited for its answer."""


class ProxyState:
    """The I/O side of routing: the pool that forwards requests, the client session of the
    polls and the model list, and the signal that a pod left (its waiting requests go
    elsewhere)."""

    def __init__(self, config: RouterConfig, fleet: Fleet, metrics: Metrics) -> None:
        self.config, self.fleet, self.metrics = config, fleet, metrics
        self.session: aiohttp.ClientSession | None = None
        self.pool: upstream_mod.Pool | None = None
        self._gone: dict[str, asyncio.Event] = {}
        # Background loops that raised (each should run for ever): name -> the error. The
        # liveness probe fails while any did, so the kubelet restarts a router whose view froze.
        self.stopped: dict[str, str] = {}
        self.draining = False  # SIGTERM came: still answering, no longer Ready

    def gone_event(self, pod: str) -> asyncio.Event:
        return self._gone.setdefault(pod, asyncio.Event())

    def endpoints_changed(self) -> None:
        """Requests waiting on a pod that is no longer an endpoint at all give up on it."""
        present = set(self.fleet.endpoints())
        for pod in [p for p in self._gone if p not in present]:
            self._gone.pop(pod).set()
        self.fleet.forget_reports(present)
        if self.pool is not None:
            self.pool.forget({ep.address for ep in self.fleet.endpoints().values()})
        self.update_gauges()

    def update_gauges(self) -> None:
        now = time.monotonic()
        backends = self.fleet.backends(now)
        self.metrics.pods.labels("ready").set(len(backends))
        self.metrics.pods.labels("reporting").set(
            sum(1 for b in backends if b.residency is not None)
        )
        self.metrics.load.set(sum(b.load for b in backends))

    def loop_ended(self, task: asyncio.Task[None]) -> None:
        """A background loop ended: one that raised is recorded for the liveness probe."""
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error(
            "action=background loop=%s result=stopped error=%r", task.get_name(), error,
            exc_info=error,
        )  # fmt: skip
        self.stopped[task.get_name()] = repr(error)

    def http(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise web.HTTPServiceUnavailable(reason="the router is starting")
        return self.session

    def upstream(self) -> upstream_mod.Pool:
        if self.pool is None:
            raise web.HTTPServiceUnavailable(reason="the router is starting")
        return self.pool


STATE = web.AppKey("state", ProxyState)
# Background work that keeps the fleet current: the API watches, the residency poller.
Source = Callable[[Fleet, ProxyState], Coroutine[Any, Any, None]]
