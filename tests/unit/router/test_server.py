"""The router's own server on the client side (`lora_router.server`) over real sockets: the
generations it answers itself read like aiohttp's answers, byte for byte but the Date; what it
does not take (other paths, chunked or compressed bodies, `Expect`, heads that do not parse)
goes to aiohttp's server on the same connection; keep-alive, pipelining, HTTP/1.0, streamed
answers and clients that leave behave; what RFC 9112 refuses is refused on either server; and
which requests it takes (`takes`)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
import uvloop
from aiohttp import web
from aiohttp.test_utils import TestServer
from lora_router import http1, server
from lora_router.app import create_app
from lora_router.fleet import Endpoint
from lora_router.metrics import Metrics
from lora_router.proxy import BUFFERED_ANSWER_BYTES
from lora_router.state import STATE

from tests.support.stand_ins import Pod, StartBackend, pods
from tests.unit.router.conftest import ROUTER_CONFIG, StartRouter, listed

GENERATION = b'{"model": "x", "prompt": "a lighthouse"}'


def post(
    body: bytes = GENERATION,
    *,
    target: str = "/v1/images/generations",
    version: str = "HTTP/1.1",
    headers: tuple[str, ...] = (),
    length: bool = True,
) -> bytes:
    """A generation as a client writes it."""
    lines = [f"POST {target} {version}", "Host: router", "Content-Type: application/json"]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    lines.extend(headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Answer:
    status: int
    reason: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k.lower() == name.lower()]
        return found[-1] if found else None


def read_answers(data: bytes) -> list[Answer]:
    """The answers in `data`, one after another (Content-Length, chunked, or to the end)."""
    answers = []
    while data:
        end = data.index(b"\r\n\r\n")
        lines = data[:end].decode("latin-1").split("\r\n")
        data = data[end + 4 :]
        version, status, reason = lines[0].split(" ", 2)
        headers = [(k, v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
        answer = Answer(int(status), reason, version, headers, b"")
        if answer.status < 200:
            answers.append(answer)
            continue
        if answer.header("Transfer-Encoding") == "chunked":
            body = b""
            while True:
                size_end = data.index(b"\r\n")
                size = int(data[:size_end], 16)
                body += data[size_end + 2 : size_end + 2 + size]
                data = data[size_end + 2 + size + 2 :]
                if not size:
                    break
        elif (length := answer.header("Content-Length")) is not None:
            body, data = data[: int(length)], data[int(length) :]
        elif answer.status in (204, 304):
            body = b""
        else:
            body, data = data, b""
        answer.body = body
        answers.append(answer)
    return answers


async def exchange(port: int, *messages: bytes, pause_s: float = 0.0) -> list[Answer]:
    """Write `messages` on one connection (`pause_s` between them), read until the server
    closes it (within 10 s) and return its answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for message in messages:
            writer.write(message)
            await writer.drain()
            await asyncio.sleep(pause_s)
        data = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    return read_answers(data)


@dataclass
class Twins:
    """One stand-in pod behind two routers: the router's own server (`own`) and aiohttp's
    alone (`plain`, `TestServer(create_app(...))`)."""

    own: int
    plain: int
    apps: tuple[web.Application, web.Application]
    pod: Pod

    def set_pods(self, pods: dict[str, str]) -> None:
        for app in self.apps:
            app[STATE].fleet.slices = {"s": [Endpoint(p, a, True) for p, a in pods.items()]}
            app[STATE].endpoints_changed()


@pytest_asyncio.fixture
async def twins(start_backend: StartBackend) -> AsyncIterator[Twins]:
    app = create_app(ROUTER_CONFIG, sources=[listed], metrics=Metrics())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = server.Site(runner, "127.0.0.1", 0)
    await site.start()
    plain = TestServer(create_app(ROUTER_CONFIG, sources=[listed], metrics=Metrics()))
    await plain.start_server()
    pod = Pod("a")
    assert plain.port is not None
    twins = Twins(site.port, plain.port, (app, plain.app), pod)
    twins.set_pods({"a": await start_backend(pod.app())})
    yield twins
    await plain.close()
    await runner.cleanup()


def comparable(answer: Answer) -> tuple[int, str, str, list[tuple[str, str]], bytes]:
    """An answer less its Date (and, from an echo, nothing else differs)."""
    headers = sorted((k, v) for k, v in answer.headers if k != "Date")
    return answer.status, answer.reason, answer.version, headers, answer.body


CLOSE = ("Connection: close",)
TO = "/v1/images/generations"


@pytest.mark.parametrize(
    "message",
    [
        pytest.param(post(headers=CLOSE), id="buffered"),
        pytest.param(post(target=f"{TO}?status=418", headers=CLOSE), id="pod-error"),
        pytest.param(
            post(target=f"{TO}?big={BUFFERED_ANSWER_BYTES + 2}", headers=CLOSE), id="streamed"
        ),
        pytest.param(post(version="HTTP/1.0"), id="http-1.0"),
        pytest.param(
            post(version="HTTP/1.0", headers=("Connection: keep-alive",))
            + post(version="HTTP/1.0"),
            id="http-1.0-keep-alive",
        ),
        pytest.param(post(b"{}" * 600_000, headers=CLOSE), id="too-large"),
        pytest.param(post(b" " * 1000_000 + GENERATION, headers=CLOSE), id="large-body"),
        pytest.param(post() + post(headers=CLOSE), id="keep-alive"),
    ],
)
async def test_answers_are_the_ones_aiohttps_server_gives(twins: Twins, message: bytes) -> None:
    mine, theirs = await exchange(twins.own, message), await exchange(twins.plain, message)
    assert [comparable(a) for a in mine] == [comparable(a) for a in theirs]
    assert all(a.header("Date") for a in mine)


async def test_the_routers_own_errors_are_the_ones_aiohttps_server_gives(twins: Twins) -> None:
    message = post(headers=("Connection: close",))
    twins.set_pods({})
    mine, theirs = await exchange(twins.own, message), await exchange(twins.plain, message)
    assert [comparable(a) for a in mine] == [comparable(a) for a in theirs]
    assert mine[0].status == 503 and mine[0].header("Retry-After") == "1"


async def test_a_router_without_its_pool_answers_as_aiohttps_server_does(twins: Twins) -> None:
    pools = [app[STATE].pool for app in twins.apps]
    for app in twins.apps:
        app[STATE].pool = None  # as before the app's startup
    try:
        message = post(headers=CLOSE)
        mine, theirs = await exchange(twins.own, message), await exchange(twins.plain, message)
    finally:
        for app, pool in zip(twins.apps, pools, strict=True):
            app[STATE].pool = pool
    assert [comparable(a) for a in mine] == [comparable(a) for a in theirs]
    assert mine[0].status == 503 and b"starting" in mine[0].body


async def test_answers_of_unknown_length_stream_as_aiohttps_server_streams_them(
    twins: Twins, start_backend: StartBackend
) -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        for i in range(5):
            await response.write(bytes([i]) * 100_000)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/images/generations", chunked)
    twins.set_pods({"c": await start_backend(app)})
    for message in (post(headers=CLOSE), post(version="HTTP/1.0")):
        mine, theirs = await exchange(twins.own, message), await exchange(twins.plain, message)
        assert [comparable(a) for a in mine] == [comparable(a) for a in theirs]
        assert mine[0].body == b"".join(bytes([i]) * 100_000 for i in range(5))
    assert mine[0].header("Transfer-Encoding") is None and mine[0].header("Connection") is None


async def test_a_request_that_arrives_in_pieces_is_answered_once_whole(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a"))
    message = post(headers=CLOSE)
    pieces = [message[i : i + 7] for i in range(0, len(message), 7)]
    answers = await exchange(router.site.port, *pieces, pause_s=0.002)
    assert json.loads(answers[0].body)["body"] == GENERATION.decode()


async def test_pipelined_requests_are_answered_in_order(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a"))
    messages = [post(target=f"/v1/images/generations?n={i}") for i in range(5)]
    messages.append(post(target="/v1/images/generations?n=5", headers=("Connection: close",)))
    answers = await exchange(router.site.port, b"".join(messages))
    assert [json.loads(a.body)["path"] for a in answers] == [
        f"/v1/images/generations?n={i}" for i in range(6)
    ]
    assert answers[-1].header("Connection") == "close"
    assert all(a.header("Connection") is None for a in answers[:-1])


async def test_what_it_does_not_take_goes_to_aiohttp_on_the_same_connection(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    pod = Pod("a")
    await pods(start_backend, router, pod)
    health = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"
    chunked = (
        b"POST /v1/images/generations HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n5\r\n" + GENERATION[:5] + b"\r\n"
        + f"{len(GENERATION) - 5:x}\r\n".encode() + GENERATION[5:] + b"\r\n0\r\n\r\n"
    )  # fmt: skip
    answers = await exchange(router.site.port, post(), health, post(), chunked)
    assert [a.status for a in answers] == [200, 200, 200, 200]
    assert json.loads(answers[1].body) == {"status": "ok"}
    # The chunked body reached the pod whole (aiohttp's server read it).
    assert [json.loads(a.body)["body"] for a in (answers[0], answers[2], answers[3])] == [
        GENERATION.decode()
    ] * 3
    assert pod.calls["/v1/images/generations"] == 3


async def test_expect_100_continue_is_answered_before_the_body_is_sent(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a"))
    reader, writer = await asyncio.open_connection("127.0.0.1", router.site.port)
    head = post(headers=("Expect: 100-continue", "Connection: close"))
    head, body = head[: -len(GENERATION)], GENERATION
    writer.write(head)
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    writer.write(body)
    answer = read_answers(await asyncio.wait_for(reader.read(), timeout=10))
    writer.close()
    assert answer[0].status == 200 and answer[0].header("x-lora-pod") == "a"


@pytest.mark.parametrize(
    "rest",
    [
        pytest.param(b"HTTP/1.1\r\nBad Header: x\r\n\r\n", id="space-in-name"),
        pytest.param(
            b"HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", id="two-lengths"
        ),
        pytest.param(b"HTTP/1.1\r\nContent-Length: x\r\n\r\n", id="length-not-a-number"),
        pytest.param(b"HTTP/1.1\r\nA: \x01\r\n\r\n", id="control-character"),
        pytest.param(b"HTTP/9.9\r\n\r\n", id="version"),
        pytest.param(b"HTTP/1.1\r\nA: " + b"a" * 9000 + b"\r\n\r\n", id="line-too-long"),
        pytest.param(b"HTTP/1.1\r\n\r\n", id="no-host"),
        pytest.param(b"HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", id="two-hosts"),
        pytest.param(b"HTTP/1.1\nHost: a\n\n", id="bare-lf"),
    ],
)
async def test_what_aiohttps_server_refuses_the_routers_refuses_too(
    twins: Twins, rest: bytes
) -> None:
    message = b"POST /v1/images/generations " + rest
    mine, theirs = await exchange(twins.own, message), await exchange(twins.plain, message)
    assert len(mine) == len(theirs) == 1
    assert mine[0].status >= 400 and theirs[0].status >= 400
    assert mine[0].header("Connection") == "close"
    assert twins.pod.calls["/v1/images/generations"] == 0


@pytest.mark.parametrize(
    ("request_line", "host", "status"),
    [
        pytest.param(b"POST /v1/images/generations HTTP/1.1", b"", 400, id="no-host"),
        pytest.param(
            b"POST /v1/images/generations HTTP/1.1",
            b"Host: a\r\nHost: b\r\n",
            400,
            id="two-hosts",
        ),
        pytest.param(b"POST /v1/images/generations HTTP/1.1", b"Host: a/b\r\n", 400, id="bad-host"),
        pytest.param(
            b"POST /v1/images/generations\t/x HTTP/1.1", b"Host: a\r\n", 400, id="tab-in-target"
        ),
        pytest.param(b"POST /v1/images/generations HTTP/1.1", b"Host: a\n", 400, id="bare-lf"),
        pytest.param(b"BREW /v1/images/generations HTTP/1.1", b"Host: a\r\n", 501, id="method"),
    ],
)
async def test_requests_rfc_9112_refuses_are_refused_on_either_server(
    twins: Twins, request_line: bytes, host: bytes, status: int
) -> None:
    """On the router's own server the refusal is its own (the status RFC 9112 gives); after a
    request aiohttp's server took, it is aiohttp's 400, after the answers before it."""
    message = request_line + b"\r\n" + host + b"Content-Length: 2\r\n\r\n{}"
    (answer,) = await exchange(twins.own, message)
    assert answer.status == status and answer.header("Connection") == "close"
    health = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"
    first, refused = await exchange(twins.own, health + message)
    assert first.status == 200 and refused.status == 400
    assert b"refused by the router" in refused.body
    assert twins.pod.calls["/v1/images/generations"] == 0


async def test_a_client_that_leaves_mid_answer_ends_only_its_own_exchange(
    start_router: StartRouter, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a"))
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", router.site.port)
        writer.write(post(target="/v1/images/generations?big=20000000"))
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(1000)
        writer.close()
    with caplog.at_level(logging.ERROR, logger="lora_router"):
        answers = await exchange(router.site.port, post(headers=("Connection: close",)))
    assert answers[0].status == 200
    await router.wait_until("the pod freed", lambda: router.fleet.inflight.get("a") == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_stopping_answers_the_requests_in_progress_and_closes_idle_connections(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    pod = Pod("a", mode="hang")
    await pods(start_backend, router, pod)
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", router.site.port)
    busy = asyncio.create_task(exchange(router.site.port, post()))
    await router.wait_until("the call", lambda: pod.calls["/v1/images/generations"] > 0)
    stopping = asyncio.create_task(router.site.stop())
    await asyncio.sleep(0.1)
    assert await asyncio.wait_for(idle_reader.read(), timeout=5) == b""
    assert not busy.done() and not stopping.done()
    pod.release.set()
    answers = await asyncio.wait_for(busy, timeout=10)
    assert answers[0].status == 200 and answers[0].header("Connection") == "close"
    await asyncio.wait_for(stopping, timeout=10)
    idle_writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", router.site.port)


async def test_an_idle_connection_is_closed_after_the_keep_alive(
    start_router: StartRouter, start_backend: StartBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "KEEPALIVE_S", 0.0)
    router = await start_router()
    await pods(start_backend, router, Pod("a"))
    answers = await exchange(router.site.port, post())  # the site's sweep closes it
    assert [a.status for a in answers] == [200]


def test_on_uvloop_as_the_router_runs() -> None:
    """`python -m lora_router` runs on uvloop, whose transports hand a connection over to
    aiohttp's server in their own way: the same exchanges, on that loop."""

    async def scenario() -> None:
        app = create_app(ROUTER_CONFIG, sources=[listed], metrics=Metrics())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = server.Site(runner, "127.0.0.1", 0)
        await site.start()
        pod = web.AppRunner(Pod("a").app(), access_log=None)
        await pod.setup()
        pod_site = web.TCPSite(pod, "127.0.0.1", 0)
        await pod_site.start()
        app[STATE].fleet.slices = {"s": [Endpoint("a", f"127.0.0.1:{pod_site.port}", True)]}
        app[STATE].endpoints_changed()
        try:
            health = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"
            big = post(target=f"{TO}?big={BUFFERED_ANSWER_BYTES * 4}")
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(big)  # a client that leaves mid-answer
            await reader.readuntil(b"\r\n\r\n")
            writer.close()
            answers = await exchange(site.port, post() + big + post(), health, post(headers=CLOSE))
            assert [a.status for a in answers] == [200] * 5
            assert len(answers[1].body) == BUFFERED_ANSWER_BYTES * 4
            assert json.loads(answers[3].body) == {"status": "ok"}
        finally:
            await runner.cleanup()
            await pod.cleanup()

    uvloop.run(scenario())


LIMIT = 1000


@pytest.mark.parametrize(
    ("head", "taken"),
    [
        pytest.param(f"POST {TO} HTTP/1.1\r\nContent-Length: 10", True, id="plain"),
        pytest.param(f"POST {TO}?x=%20 HTTP/1.1\r\nContent-Length: 10", True, id="query"),
        pytest.param(f"POST {TO} HTTP/1.0", True, id="http-1.0-no-body"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nContent-Length: 1001", False, id="too-large"),
        pytest.param(f"GET {TO} HTTP/1.1", False, id="get"),
        pytest.param("POST /v1/images/%67enerations HTTP/1.1", False, id="escaped-path"),
        pytest.param("POST /v1/models HTTP/1.1", False, id="not-forwarded"),
        pytest.param(f"POST http://x{TO} HTTP/1.1", False, id="absolute-form"),
        pytest.param(f"POST {TO}#x HTTP/1.1", False, id="fragment"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nTransfer-Encoding: chunked", False, id="chunked"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nContent-Encoding: gzip", False, id="compressed"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nExpect: 100-continue", False, id="expect"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nUpgrade: h2c", False, id="upgrade"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nConnection: Upgrade", False, id="connection-upgrade"),
    ],
)
def test_which_requests_the_routers_own_server_takes(head: str, taken: bool) -> None:
    if "HTTP/1.1" in head.partition("\r\n")[0]:
        line, _, rest = head.partition("\r\n")
        head = f"{line}\r\nHost: h" + (f"\r\n{rest}" if rest else "")
    assert server.takes(http1.parse_request(head.encode()), LIMIT) == taken
