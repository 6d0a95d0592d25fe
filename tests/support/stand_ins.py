"""Stand-in inference pods for the router's tests (`Pod`: answers, or fails as told) and `pods`,
which starts them and makes them a router's fleet. Imports no torch."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from lora_podapi import headers as answers

if TYPE_CHECKING:
    from tests.unit.router.conftest import Router

StartBackend = Callable[[web.Application], Awaitable[str]]


class Pod:
    """A stand-in inference pod: answers, or fails as told."""

    def __init__(
        self, name: str, gpu: tuple[str, ...] = (), mode: str = "ok", token: str | None = None
    ) -> None:
        self.name, self.gpu, self.mode = name, gpu, mode
        self.calls: Counter[str] = Counter()
        self.reporting = True
        self.release = asyncio.Event()
        self.token = token  # the client token it requires, as `--client-token-file` makes it
        self.report_gate: asyncio.Event | None = None  # set: /v1/adapters waits for it
        self.queue: tuple[int, int] | None = None  # (waiting, running) it reports, if any
        self.answered_queue: int | None = None  # the x-lora-queue of its answers, if any

    def refusal(self, request: web.Request) -> web.Response | None:
        """The server's 401 when a client token is required and not given."""
        if self.token is None or request.headers.get("Authorization") == f"Bearer {self.token}":
            return None
        error = {"message": "needs the client token", "type": "Unauthorized", "code": 401}
        return web.json_response({"error": {**error, "param": None}}, status=401)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_get("/v1/adapters", self.adapters)
        app.router.add_get("/v1/models", self.models)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def adapters(self, request: web.Request) -> web.Response:
        if refusal := self.refusal(request):
            return refusal
        if self.report_gate is not None:
            await self.report_gate.wait()
        if not self.reporting:
            return web.json_response({"error": "broken"}, status=500)
        data = [{"id": a, "tier": "gpu"} for a in self.gpu]
        report: dict[str, Any] = {"object": "list", "data": data, "max_loras": 2}
        if self.queue is not None:
            report["num_requests_waiting"], report["num_requests_running"] = self.queue
        return web.json_response(report)

    async def models(self, request: web.Request) -> web.Response:
        if refusal := self.refusal(request):
            return refusal
        cards = [{"id": "base", "parent": None}] + [{"id": a, "parent": "base"} for a in self.gpu]
        return web.json_response({"object": "list", "data": cards})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls[request.path] += 1
        body = await request.read()
        if refusal := self.refusal(request):
            return refusal
        if self.mode == "reset":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "midstream":
            response = web.StreamResponse(status=200)
            response.content_length = 1000
            await response.prepare(request)
            await response.write(b"x" * 10)
            assert request.transport is not None
            request.transport.close()
            return response
        if request.query.get("status"):
            status = int(request.query["status"])
            error = {"error": {"message": "teapot", "type": "X", "param": None, "code": status}}
            return web.json_response(error, status=status, headers={"X-Upstream": "yes"})
        if request.query.get("big"):
            return web.Response(body=b"\x01\x02" * (int(request.query["big"]) // 2))
        echo = {
            "pod": self.name,
            "method": request.method,
            "path": request.path_qs,
            "authorization": request.headers.get("Authorization"),
            "body": body.decode(),
        }
        queue = self.answered_queue
        headers = {} if queue is None else {answers.QUEUE: answers.render_queue(queue)}
        return web.json_response(echo, headers=headers)


async def pods(
    start_backend: StartBackend, router: Router, *stand_ins: Pod, ready: bool = True
) -> dict[str, str]:
    """Start the stand-ins and make them the router's pods; returns name -> host:port."""
    addresses = {p.name: await start_backend(p.app()) for p in stand_ins}
    router.set_pods(addresses, ready=ready)
    return addresses
