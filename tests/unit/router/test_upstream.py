"""The router's pool of connections to the pods, against raw TCP servers that answer with the
exact bytes a test gives: framing (length, chunked, until the end), reuse of kept-alive
connections, a pod that closed one, timeouts and refusals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
from lora_router import upstream

from tests.support.http import free_port

# A server: each connection gets the answers in order, one per request head it reads; an
# answer of None closes the connection without a byte, "hang" never answers.
Serve = Callable[[list[bytes | str | None]], Awaitable[tuple[str, list[bytes]]]]


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def start(answers: list[bytes | str | None]) -> tuple[str, list[bytes]]:
        received: list[bytes] = []
        queue = list(answers)

        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while queue:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    received.append(head + await reader.readexactly(length))
                    answer = queue.pop(0)
                    if answer is None:
                        break
                    if answer == "hang":
                        await asyncio.sleep(3600)
                    assert isinstance(answer, bytes)
                    writer.write(answer)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        server = await asyncio.start_server(connection, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}", received

    yield start
    for server in servers:
        server.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhello"


async def test_a_request_is_one_write_and_its_answer_comes_back_unchanged(serve: Serve) -> None:
    address, received = await serve([OK])
    pool = upstream.Pool(connect_timeout_s=1, timeout_s=5)
    answer = await pool.request(address, "POST", "/p?x=1", {"A": "b"}, b"{}")
    assert (answer.status, answer.reason, answer.content_length) == (200, "OK", 5)
    assert ("X-A", "1") in answer.headers
    assert await answer.read() == b"hello"
    answer.close()
    assert received == [
        b"POST /p?x=1 HTTP/1.1\r\nHost: " + address.encode() + b"\r\nA: b\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    ]
    pool.close()


async def test_a_kept_alive_connection_is_reused(serve: Serve) -> None:
    address, received = await serve([OK, OK, OK])
    pool = upstream.Pool(connect_timeout_s=1, timeout_s=5)
    for _ in range(3):
        answer = await pool.request(address, "GET", "/", {}, b"")
        assert await answer.read() == b"hello"
        answer.close()
    assert len(received) == 3  # all on the one connection the server serves in turn
    pool.close()


@pytest.mark.parametrize(
    "answer, body",
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
         b"abcde"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n",
         b"abc"),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", b"until the end"),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", b""),
    ],
    ids=["chunked", "chunk-extension-and-trailer", "until-close", "informational-then-204"],
)  # fmt: skip
async def test_answers_of_every_framing(serve: Serve, answer: bytes, body: bytes) -> None:
    address, _ = await serve([answer])
    pool = upstream.Pool(connect_timeout_s=1, timeout_s=5)
    got = await pool.request(address, "POST", "/", {}, b"x")
    assert b"".join([c async for c in got.chunks()]) == body
    got.close()
    pool.close()


async def test_a_chunked_answer_is_read_whole_too(serve: Serve) -> None:
    address, _ = await serve([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                              b"2\r\nab\r\n0\r\n\r\n", OK])  # fmt: skip
    pool = upstream.Pool(connect_timeout_s=1, timeout_s=5)
    answer = await pool.request(address, "POST", "/", {}, b"x")
    assert answer.content_length is None and await answer.read() == b"ab"
    answer.close()
    again = await pool.request(address, "POST", "/", {}, b"x")  # the same connection, kept
    assert await again.read() == b"hello"
    again.close()
    pool.close()


async def test_a_pod_that_closed_a_kept_alive_connection(serve: Serve) -> None:
    """A GET meets the closed connection and is sent once more on a new one; a POST is not
    (the proxy sends it to another pod)."""
    address, received = await serve([OK, None, OK])
    pool = upstream.Pool(connect_timeout_s=1, timeout_s=5)
    first = await pool.request(address, "GET", "/", {}, b"")
    await first.read()
    first.close()  # kept; the server closes it when the next request comes
    retried = await pool.request(address, "GET", "/", {}, b"")
    assert retried.status == 200 and await retried.read() == b"hello"
    retried.close()
    assert len(received) == 3  # the second request twice: on the closed and a new connection
    address, _ = await serve([OK, None])
    first = await pool.request(address, "POST", "/", {}, b"x")
    await first.read()
    first.close()
    with pytest.raises(upstream.Unanswered) as e:
        await pool.request(address, "POST", "/", {}, b"x")
    assert e.value.kind == "disconnect"
    pool.close()


async def test_refused_and_silent_pods(serve: Serve) -> None:
    pool = upstream.Pool(connect_timeout_s=1, timeout_s=0.3)
    with pytest.raises(upstream.Unanswered) as e:
        await pool.request(f"127.0.0.1:{free_port()}", "POST", "/", {}, b"x")
    assert e.value.kind == "connect"
    address, _ = await serve(["hang"])
    with pytest.raises(TimeoutError):
        await pool.request(address, "POST", "/", {}, b"x")
    pool.close()


SHORT = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
SHORT_CHUNK = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"


@pytest.mark.parametrize(
    "answers, timeout_s, why",
    [
        ([SHORT], 5.0, "closed mid-answer"),  # the server closes after its answer
        ([SHORT_CHUNK], 5.0, "closed mid-answer"),
        ([SHORT, None], 0.3, "within the timeout"),  # the server keeps the connection open
    ],
    ids=["short-length", "short-chunk", "past-the-deadline"],
)
async def test_an_answer_that_breaks_off_is_broken(
    serve: Serve, answers: list[bytes | str | None], timeout_s: float, why: str
) -> None:
    address, _ = await serve(answers)
    pool = upstream.Pool(connect_timeout_s=1, timeout_s=timeout_s)
    got = await pool.request(address, "POST", "/", {}, b"x")
    with pytest.raises(upstream.Broken, match=why):
        await got.read()
    got.close()
    pool.close()


async def test_a_malformed_head_is_broken(serve: Serve) -> None:
    address, _ = await serve([b"SPDY/9 200 OK\r\n\r\n"])
    pool = upstream.Pool(connect_timeout_s=1, timeout_s=5)
    with pytest.raises(upstream.Broken):
        await pool.request(address, "POST", "/", {}, b"x")
    pool.close()
