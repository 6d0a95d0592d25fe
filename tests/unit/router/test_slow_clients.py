"""Slow clients over real sockets: a head not whole within `http1.HEAD_TIMEOUT_S`, or a body that
brings less than `http1.BODY_MIN_BYTES` (or its rest) in a `http1.BODY_WINDOW_S`, is cut off, on
the router's own server (a 408) and on a connection aiohttp's server answers (closed); a body
that keeps up is not. The deadlines are made short here; the clients are slower than any of
them, so what is asserted is the outcome, not a time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
from aiohttp import web
from lora_router import http1, server
from lora_router.metrics import Metrics
from lora_runtime import metrics as prometheus

from tests.support.stand_ins import Pod, StartBackend, pods
from tests.unit.router.conftest import Router, StartRouter
from tests.unit.router.test_server import GENERATION, exchange, post, read_answers

HEALTH = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"
CHUNKED = (
    b"POST /v1/images/generations HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n\r\n"
    + f"{len(GENERATION):x}\r\n".encode() + GENERATION + b"\r\n0\r\n\r\n"
)  # fmt: skip


@pytest.fixture
def short_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "HEAD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(http1, "BODY_WINDOW_S", 0.3)
    monkeypatch.setattr(server, "SWEEP_S", 0.05)


async def trickle(port: int, first: bytes, slow: bytes) -> bytes:
    """Send `first` at once, then `slow` a byte every 50 ms until the router closes the
    connection; what the router wrote (a failure after 10 s, not a hang)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        writer.write(first)
        for i in range(len(slow)):
            await asyncio.sleep(0.05)
            writer.write(slow[i : i + 1])
            await writer.drain()

    sending = asyncio.create_task(send())
    try:
        return await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sending
        writer.close()


async def router_with_pod(
    start_router: StartRouter, start_backend: StartBackend
) -> tuple[Router, Pod]:
    router = await start_router()
    pod = Pod("a")
    await pods(start_backend, router, pod)
    return router, pod


@pytest.mark.usefixtures("short_deadlines")
@pytest.mark.parametrize(
    ("first", "slow"),
    [
        pytest.param(b"", post(), id="head"),
        pytest.param(post()[: -len(GENERATION)], GENERATION, id="body"),
    ],
)
async def test_a_generation_sent_a_byte_at_a_time_is_answered_408(
    start_router: StartRouter, start_backend: StartBackend, first: bytes, slow: bytes
) -> None:
    router, pod = await router_with_pod(start_router, start_backend)
    data = await trickle(router.site.port, first, slow)
    (answer,) = read_answers(data)
    assert answer.status == 408 and answer.header("Connection") == "close"
    assert pod.calls["/v1/images/generations"] == 0


@pytest.mark.usefixtures("short_deadlines")
@pytest.mark.parametrize(
    ("first", "slow"),
    [
        pytest.param(HEALTH, HEALTH, id="head"),
        pytest.param(HEALTH + CHUNKED[:90], CHUNKED[90:], id="chunked-body"),
        pytest.param(CHUNKED[:90], CHUNKED[90:], id="chunked-body-first"),
    ],
)
async def test_a_client_of_aiohttps_server_that_sends_a_byte_at_a_time_is_cut_off(
    start_router: StartRouter, start_backend: StartBackend, first: bytes, slow: bytes
) -> None:
    router, pod = await router_with_pod(start_router, start_backend)
    data = await trickle(router.site.port, first, slow)
    assert [a.status for a in read_answers(data)] == [200] * first.count(b"/health")
    assert pod.calls["/v1/images/generations"] == 0


@pytest.mark.usefixtures("short_deadlines")
async def test_a_connection_that_never_sends_is_closed(start_router: StartRouter) -> None:
    router = await start_router()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.site.port)
    assert await asyncio.wait_for(reader.read(), timeout=10) == b""
    writer.close()


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("handed_over", [False, True], ids=["own-server", "aiohttp"])
async def test_a_body_that_keeps_up_gets_another_window_and_one_that_stops_does_not(
    start_router: StartRouter,
    start_backend: StartBackend,
    monkeypatch: pytest.MonkeyPatch,
    handed_over: bool,
) -> None:
    # Windows that end at once and a site that looks only when told: each `sweep` below ends one.
    monkeypatch.setattr(server, "SWEEP_S", 3600.0)
    monkeypatch.setattr(http1, "BODY_WINDOW_S", 0.0)
    monkeypatch.setattr(http1, "BODY_MIN_BYTES", 4)
    router, pod = await router_with_pod(start_router, start_backend)
    site = router.site
    reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    if handed_over:
        head = CHUNKED.index(b"\r\n\r\n") + 4
        writer.write(HEALTH + CHUNKED[:head])
        pieces = [CHUNKED[head : head + 4], CHUNKED[head + 4 : head + 8]]
        await until(lambda: len(site.relays) == 1)
        relay = next(iter(site.relays))
        await until(lambda: relay.body is not None)
        progress: Callable[[], int] = lambda: relay.window_got  # noqa: E731
    else:
        writer.write(post()[: -len(GENERATION)])
        pieces = [GENERATION[:4], GENERATION[4:8]]
        await until(lambda: len(site.connections) == 1)
        conn = next(iter(site.connections))
        await until(lambda: conn.request is not None)
        progress = lambda: len(conn.buffer) - conn.body_mark  # noqa: E731
    for piece in pieces:
        writer.write(piece)
        await until(lambda: progress() >= 4)
        site.sweep()  # 4 bytes in the window: another one
    site.sweep()  # none in this one
    data = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    statuses = [a.status for a in read_answers(data)]
    assert statuses == ([200] if handed_over else [408])
    assert pod.calls["/v1/images/generations"] == 0
    assert not site.connections and not site.relays


@pytest.mark.usefixtures("short_deadlines")
async def test_a_site_of_an_app_that_forwards_nothing_reads_every_request_by_the_same_rules() -> (
    None
):
    """The metrics app behind a `server.Site`: every request is aiohttp's server's, through the
    relay (a generation too: there is nothing to forward it to), and slow clients are cut off."""
    runner = web.AppRunner(prometheus.app(Metrics().registry), access_log=None)
    await runner.setup()
    site = server.Site(runner, "127.0.0.1", 0)
    await site.start()
    try:
        metrics = b"GET /metrics HTTP/1.1\r\nHost: router\r\n\r\n"
        answers = await exchange(site.port, metrics + post(headers=("Connection: close",)))
        assert [a.status for a in answers] == [200, 404]
        assert b"lora_router_requests_total" in answers[0].body
        data = await trickle(site.port, metrics, metrics)
        assert [a.status for a in read_answers(data)] == [200]
        (refused,) = await exchange(site.port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert refused.status == 400
    finally:
        await runner.cleanup()
