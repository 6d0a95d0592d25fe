"""Every case of the framing corpus (`framing_cases`) sent to a live router, whose own server and
aiohttp's behind it (`handover.Relay`) read it, in front of a pod that records every request it
reads with aiohttp's server: no case reaches a pod's admin path (`/v1/load_lora_adapter`,
`/metrics`, `/v1/adapters`: only the router's own polls do; the router asks for `/v1/models`
itself), every generation that reaches the
pod is one the router's reader read, with its body, and no hop-by-hop field crosses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from lora_router import http1, server

from tests.support.stand_ins import StartBackend
from tests.unit.router.conftest import StartRouter
from tests.unit.router.framing_cases import CASES
from tests.unit.router.test_http1_differential import router_reads
from tests.unit.router.test_server import read_answers

# The router's own requests: its residency polls, and `GET /v1/models` asked of every pod.
OWN = {("GET", "/v1/adapters?view=residency"), ("GET", "/v1/models")}
HOP = {"connection", "keep-alive", "te", "trailer", "upgrade", "transfer-encoding", "x-secret"}
HOP |= {"proxy-authorization", "proxy-connection"}


@dataclass
class RecordingPod:
    """Answers every request, and records each one: method, target, fields, body."""

    seen: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((request.method, request.path_qs, dict(request.headers), body))
        if request.path == "/v1/adapters":
            return web.json_response({"object": "list", "data": [], "max_loras": 2})
        return web.json_response({"created": 0, "data": []})

    def requests(self) -> Iterator[tuple[str, str, dict[str, str], bytes]]:
        """What the pod read but the router's own requests."""
        return (r for r in self.seen if (r[0], r[1]) not in OWN)


@pytest.fixture
def quick_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deadlines short enough that an incomplete case ends in a moment."""
    monkeypatch.setattr(http1, "HEAD_TIMEOUT_S", 0.2)
    monkeypatch.setattr(http1, "BODY_WINDOW_S", 0.2)
    monkeypatch.setattr(server, "SWEEP_S", 0.05)


async def send(port: int, data: bytes, answers: int) -> list[int]:
    """Write `data` on a new connection; read until `answers` final answers came or the router
    closed the connection (within 10 s); their statuses."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    statuses: list[int] = []
    try:
        writer.write(data)
        async with asyncio.timeout(10):
            while len(statuses) < answers:
                more = await reader.read(65536)
                if not more:
                    break
                received += more
                try:
                    statuses = [a.status for a in read_answers(received) if a.status >= 200]
                except (ValueError, IndexError):
                    continue  # an answer not whole yet
    finally:
        writer.close()
    return statuses


@pytest.mark.usefixtures("quick_deadlines")
async def test_no_framing_case_reaches_a_pods_admin_path(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    pod = RecordingPod()
    router.set_pods({"a": await start_backend(pod.app())})
    await router.wait_reports({"a"})
    forwarded = 0
    for case in CASES:
        reading = router_reads([case.data])
        expected = [
            (m.target.decode("latin-1"), m.body)
            for m in reading.messages
            if m.method == b"POST" and m.target.startswith(b"/v1/images/generations")
        ]
        before = len(list(pod.requests()))
        answers = len(reading.messages) + (reading.end == "refused")
        statuses = await send(router.site.port, case.data, answers)
        got = list(pod.requests())[before:]
        assert [(target, body) for _, target, _, body in got] == expected, case.id
        assert len(statuses) == answers or reading.end != "complete", case.id
        if reading.end == "refused":
            # A 4xx or 5xx, or, for a body aiohttp's server was reading, a closed connection.
            assert all(s >= 400 for s in statuses[len(reading.messages) :]), case.id
        forwarded += len(got)
    for method, target, headers, _ in pod.seen:
        assert (method, target) in OWN or (method, target.partition("?")[0]) == (
            "POST", "/v1/images/generations",
        )  # fmt: skip
        assert not {k.lower() for k in headers} & HOP, headers
    assert forwarded >= 30
