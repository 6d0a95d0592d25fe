"""The router's HTTP/1.1 module (`lora_router.http1`) alone: what each refusal answers, which
requests stay open, the fields kept as sent, the headers a proxy drops, an answer's framing, a
body's, and the bytes of a request and of a refusal."""

from __future__ import annotations

import pytest
from lora_router import http1

TO = "/v1/images/generations"
HOST = "\r\nHost: h"


def refused(head: str | bytes) -> int:
    """The status `parse_request` refuses `head` with."""
    data = head.encode("utf-8") if isinstance(head, str) else head
    with pytest.raises(http1.HttpError) as caught:
        http1.parse_request(data)
    return caught.value.status


@pytest.mark.parametrize(
    ("head", "status"),
    [
        pytest.param(f"POST {TO} HTTP/1.1\nHost: h", 400, id="bare-lf"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nHost: h\rX: y", 400, id="bare-cr"),
        pytest.param(f"POST {TO} HTTP/1.1", 400, id="no-host"),
        pytest.param(f"POST {TO} HTTP/1.1{HOST}{HOST}", 400, id="two-hosts"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nHost: a b", 400, id="host-space"),
        pytest.param(f"POST {TO} HTTP/1.1\r\nHost: u@h", 400, id="host-userinfo"),
        pytest.param(f"POST {TO}\t HTTP/1.1{HOST}", 400, id="tab-in-target"),
        pytest.param(f"POST {TO}\x00 HTTP/1.1{HOST}", 400, id="nul-in-target"),
        pytest.param(f"POST /\u00e9 HTTP/1.1{HOST}", 400, id="not-ascii-target"),
        pytest.param(f"POST  {TO} HTTP/1.1{HOST}", 400, id="two-spaces"),
        pytest.param(f"POST {TO} HTTP/1.1{HOST}\r\nA: b\x01", 400, id="control-in-value"),
        pytest.param(f"POST {TO} HTTP/1.1{HOST}\r\nA: b\r\n c", 400, id="obs-fold"),
        pytest.param(f"POST {TO} HTTP/1.1{HOST}\r\nA : b", 400, id="space-before-colon"),
        pytest.param(f"POST {TO} HTTP/1.1{HOST}\r\nContent-Length: +1", 400, id="signed-length"),
        pytest.param(
            f"POST {TO} HTTP/1.1{HOST}\r\nContent-Length: 1\r\ncontent-length: 1",
            400,
            id="two-lengths",
        ),
        pytest.param(
            f"POST {TO} HTTP/1.1{HOST}\r\nContent-Length: 1\r\nTransfer-Encoding: chunked",
            400,
            id="length-and-chunked",
        ),
        pytest.param(f"POST {TO} HTTP/1.0\r\nTransfer-Encoding: chunked", 400, id="chunked-1.0"),
        pytest.param(f"POST {TO} HTTP/1.1{HOST}\r\nTransfer-Encoding: gzip", 501, id="gzip-te"),
        pytest.param(
            f"POST {TO} HTTP/1.1{HOST}\r\nTransfer-Encoding: gzip, chunked", 501, id="gzip-chunked"
        ),
        pytest.param(f"post {TO} HTTP/1.1{HOST}", 501, id="lower-case-method"),
        pytest.param(f"TRACE {TO} HTTP/1.1{HOST}", 501, id="trace"),
        pytest.param(f"POST {TO} HTTP/2.0{HOST}", 505, id="version"),
        pytest.param(f"GET /{'a' * 8200} HTTP/1.1{HOST}", 414, id="long-target"),
        pytest.param(f"POST {TO} HTTP/1.1{HOST}\r\nA: {'a' * 8200}", 431, id="long-field"),
        pytest.param(
            f"POST {TO} HTTP/1.1{HOST}" + "".join(f"\r\nX-{i}: v" for i in range(100)),
            431,
            id="too-many-fields",
        ),
    ],
)
def test_each_refusal_has_its_status(head: str, status: int) -> None:
    assert refused(head) == status


def test_a_head_that_can_never_end_is_refused_before_it_does() -> None:
    with pytest.raises(http1.HttpError, match="bare LF"):
        http1.head_end(bytearray(b"GET / HTTP/1.1\nHost: h\n\n"))
    with pytest.raises(http1.HttpError, match="control"):
        http1.head_end(bytearray(b"\x16\x03\x01\x00"))
    with pytest.raises(http1.HttpError) as caught:
        http1.head_end(bytearray(b"GET / HTTP/1.1\r\nA: " + b"a" * http1.MAX_HEAD_BYTES))
    assert caught.value.status == 431
    assert http1.head_end(bytearray(b"GET / HTTP/1.1\r\nHost: h\r")) == -1
    assert http1.head_end(bytearray(b"GET / HTTP/1.1\r\nHost: h\r\n\r\nrest")) == 27


@pytest.mark.parametrize(
    ("version", "connection", "keep_alive"),
    [
        ("HTTP/1.1", None, True),
        ("HTTP/1.1", "close", False),
        ("HTTP/1.1", "keep-alive, Close", False),
        ("HTTP/1.0", None, False),
        ("HTTP/1.0", "Keep-Alive", True),
        ("HTTP/1.0", "keep-alive, close", False),
    ],
)
def test_keep_alive_follows_the_version_and_connection(
    version: str, connection: str | None, keep_alive: bool
) -> None:
    head = f"POST {TO} {version}{HOST}"
    if connection is not None:
        head += f"\r\nConnection: {connection}"
    assert http1.parse_request(head.encode()).keep_alive == keep_alive


def test_a_parsed_head_keeps_the_fields_as_sent() -> None:
    head = (
        b"POST /v1/images/generations?a=1 HTTP/1.1\r\nHost: h\r\n"
        b"Authorization:  Bearer t \r\nX-Name: caf\xc3\xa9 \xff\r\nContent-Length: 3"
    )
    request = http1.parse_request(head)
    assert (request.method, request.target, request.path, request.length) == (
        "POST", "/v1/images/generations?a=1", "/v1/images/generations", 3,
    )  # fmt: skip
    assert [(k, v.encode("utf-8", "surrogateescape")) for k, v in request.headers] == [
        ("Host", b"h"), ("Authorization", b"Bearer t"), ("X-Name", b"caf\xc3\xa9 \xff"),
        ("Content-Length", b"3"),
    ]  # fmt: skip
    flags = http1.parse_request(
        f"POST {TO} HTTP/1.1{HOST}\r\nExpect: 100-continue\r\nContent-Encoding: gzip\r\n"
        "Connection: Upgrade\r\nUpgrade: h2c\r\nTransfer-Encoding: chunked".encode()
    )
    assert (flags.expect, flags.encoded, flags.upgrade, flags.chunked, flags.length) == (
        True, True, True, True, None,
    )  # fmt: skip


def test_hop_by_hop_fields_and_those_connection_names_are_not_passed_on() -> None:
    headers = [
        ("Host", "router"), ("Connection", "X-Secret, keep-alive"), ("x-secret", "1"),
        ("Keep-Alive", "timeout=5"), ("TE", "trailers"), ("Trailer", "X"), ("Upgrade", "h2c"),
        ("Proxy-Authorization", "Basic x"), ("Proxy-Connection", "keep-alive"),
        ("Transfer-Encoding", "chunked"), ("Content-Length", "3"), ("Authorization", "Bearer t"),
        ("Content-Type", "application/json"), ("Content-Encoding", "gzip"),
    ]  # fmt: skip
    assert http1.forwarded_headers(headers) == {
        "Authorization": "Bearer t",
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
    }
    assert http1.forwarded_headers([("A", "1"), ("connection", "close")]) == {"A": "1"}


@pytest.mark.parametrize(
    ("head", "method", "framing"),
    [
        ("HTTP/1.1 200 OK\r\nContent-Length: 5", "POST", (5, False, True)),
        ("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", "POST", (None, True, True)),
        ("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip", "POST", (None, False, False)),
        ("HTTP/1.1 200 OK", "POST", (None, False, False)),
        ("HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1", "POST", (1, False, False)),
        ("HTTP/1.0 200 OK\r\nContent-Length: 1", "POST", (1, False, False)),
        ("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1", "GET", (1, False, True)),
        ("HTTP/1.1 204 No Content", "POST", (0, False, True)),
        ("HTTP/1.1 304 Not Modified\r\nContent-Length: 10", "GET", (0, False, True)),
        ("HTTP/1.1 200 OK\r\nContent-Length: 10", "HEAD", (0, False, True)),
        ("HTTP/1.1 200", "POST", (None, False, False)),
    ],
)
def test_an_answers_framing(head: str, method: str, framing: tuple[int | None, bool, bool]) -> None:
    answer = http1.parse_response(head.encode(), method)
    assert answer is not None
    assert (answer.length, answer.chunked, answer.keep_alive) == framing


@pytest.mark.parametrize(
    "head",
    [
        pytest.param("HTTP/1.1 200 OK\nContent-Length: 1", id="bare-lf"),
        pytest.param("HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1", id="two"),
        pytest.param("HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", id="te"),
        pytest.param("HTTP/1.1 200 OK\r\nX: a\r\n b", id="obs-fold"),
        pytest.param("HTTP/1.1 101 Switching Protocols", id="switch"),
        pytest.param("HTTP/2 200 OK", id="version"),
        pytest.param("HTTP/1.1 200 OK\r\nX: \x00", id="nul"),
    ],
)
def test_an_answer_that_is_not_one_is_refused(head: str) -> None:
    with pytest.raises(http1.HttpError):
        http1.parse_response(head.encode(), "POST")


def test_an_interim_answer_is_skipped() -> None:
    assert http1.parse_response(b"HTTP/1.1 100 Continue", "POST") is None


def test_a_chunked_body_is_taken_as_it_comes_and_ends_where_its_framing_does() -> None:
    body = http1.Body(None, chunked=True)
    buffer = bytearray(b"5;ext=1\r\nhel")
    assert body.take(buffer) == b"hel" and not body.done
    buffer += b"lo\r\n0\r\nX-Trailer: 1\r\n\r\nNEXT"
    assert body.take(buffer) == b"lo" and body.done
    assert buffer == b"NEXT"
    sized = http1.Body(4, chunked=False)
    buffer = bytearray(b"abcdef")
    assert sized.take(buffer) == b"abcd" and sized.done and buffer == b"ef"
    until_close = http1.Body(None, chunked=False)
    assert until_close.take(bytearray(b"xyz")) == b"xyz" and not until_close.done


@pytest.mark.parametrize(
    "data",
    [b"5 \r\nhello\r\n", b"5\nhello\r\n", b"5\r\nhelloX\r\n", b"x\r\n", b"5;a\x01\r\nhello\r\n"],
)
def test_a_malformed_chunk_is_refused(data: bytes) -> None:
    with pytest.raises(http1.HttpError):
        http1.Body(None, chunked=True).take(bytearray(data))


def test_a_request_to_a_pod_is_one_buffer_that_cannot_be_split() -> None:
    message = http1.encode_request("POST", "/p?x=1", "10.0.0.1:8000", {"A": "b"}, b"{}")
    assert message == (
        b"POST /p?x=1 HTTP/1.1\r\nHost: 10.0.0.1:8000\r\nA: b\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert http1.encode_request("GET", "/", "h", {}, b"") == b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"
    for target, headers in [
        ("/p HTTP/1.1\r\nX:", {}), ("/a b", {}), ("/", {"A": "b\r\nContent-Length: 0"}),
        ("/", {"A\r\n": "b"}), ("/", {"A": "b\nc"}),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match="framing"):
            http1.encode_request("POST", target, "h", headers, b"")


def test_a_refusal_reads_as_aiohttps_and_closes() -> None:
    answer = http1.refusal(400, "an HTTP/1.1 request without Host", "DATE", "SERVER")
    assert answer == (
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: 32\r\nDate: DATE\r\nServer: SERVER\r\nConnection: close\r\n\r\n"
        b"an HTTP/1.1 request without Host"
    )
