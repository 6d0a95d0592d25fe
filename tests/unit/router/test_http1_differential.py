"""The router's HTTP/1.1 reader (`lora_router.http1`) held to two well-kept parsers on every case
of the framing corpus (`framing_cases`): llhttp (through httptools; aiohttp's server parses with
it too) and h11. On each case the router reads exactly the requests each of them reads (method,
target, version, fields, body: the same boundaries) and refuses where they refuse, except where
the case says the router is stricter than one of them: then it reads a prefix of what that one
reads and refuses the rest, never more. Fed in any pieces, it reads the same as fed whole."""

from __future__ import annotations

from dataclasses import dataclass

import h11
import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_router import http1

from tests.unit.router.framing_cases import CASES, Case


@dataclass(frozen=True)
class Message:
    method: bytes
    target: bytes
    version: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


def normal(headers: list[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """Fields as compared: h11 gives a Transfer-Encoding's value lower-cased."""
    return tuple((k, v.lower() if k.lower() == b"transfer-encoding" else v) for k, v in headers)


@dataclass(frozen=True)
class Reading:
    """What a parser read of a stream: its requests, and how it ended: `complete` (nothing
    left over), `incomplete` (waiting for more), `closed` (its last request closes the
    connection; what follows is not read) or `refused`."""

    messages: tuple[Message, ...]
    end: str


def router_reads(pieces: list[bytes]) -> Reading:
    """The stream, arriving in `pieces`, read as the router's server and relay read it:
    `http1.head_end`, `http1.parse_request`, then `http1.Body`."""
    buffer = bytearray()
    messages: list[Message] = []
    request: http1.Request | None = None
    body: http1.Body | None = None
    data = b""
    for piece in pieces:
        buffer += piece
        try:
            while buffer:
                if request is None:
                    end = http1.head_end(buffer)
                    if end < 0:
                        break
                    request = http1.parse_request(bytes(buffer[: end - 4]))
                    del buffer[:end]
                    body, data = http1.Body(request.length or 0, request.chunked), b""
                assert body is not None
                data += body.take(buffer)
                if not body.done:
                    break
                messages.append(
                    Message(
                        request.method.encode(),
                        request.target.encode("utf-8", "surrogateescape"),
                        b"1.%d" % request.minor,
                        normal(
                            [
                                (k.encode(), v.encode("utf-8", "surrogateescape"))
                                for k, v in request.headers
                            ]
                        ),
                        data,
                    )
                )
                if not request.keep_alive:
                    return Reading(tuple(messages), "closed")
                request = body = None
        except http1.HttpError:
            return Reading(tuple(messages), "refused")
    return Reading(tuple(messages), "incomplete" if buffer or request else "complete")


def llhttp_reads(data: bytes) -> Reading:
    """The stream as llhttp reads it (httptools, strict as aiohttp's server sets it)."""
    messages: list[Message] = []

    class Callbacks:
        def __init__(self) -> None:
            self.started = False
            self.target, self.body = b"", b""
            self.headers: list[tuple[bytes, bytes]] = []
            self.in_head = True
            self.keep_alive = True

        def on_message_begin(self) -> None:
            self.started, self.in_head = True, True
            self.target, self.body, self.headers = b"", b"", []

        def on_url(self, url: bytes) -> None:
            self.target += url

        def on_header(self, name: bytes, value: bytes) -> None:
            if self.in_head:  # trailers are not compared
                self.headers.append((name, value.strip(b" \t")))

        def on_headers_complete(self) -> None:
            self.in_head = False
            self.keep_alive = parser.should_keep_alive()

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            self.started = False
            messages.append(
                Message(
                    parser.get_method(),
                    self.target,
                    parser.get_http_version().encode(),
                    normal(self.headers),
                    self.body,
                )
            )

    callbacks = Callbacks()
    parser = httptools.HttpRequestParser(callbacks)
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        return Reading(tuple(messages), "closed")
    except httptools.HttpParserError:
        if messages and not callbacks.started and not callbacks.keep_alive:
            return Reading(tuple(messages), "closed")  # data after a connection's last request
        return Reading(tuple(messages), "refused")
    if messages and not callbacks.started and not callbacks.keep_alive:
        return Reading(tuple(messages), "closed")
    return Reading(tuple(messages), "incomplete" if callbacks.started else "complete")


def h11_reads(data: bytes) -> Reading:
    """The stream as h11 reads it, answering each request with an empty 404 (which declines a
    CONNECT or an Upgrade, as the router does)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    messages: list[Message] = []
    request: h11.Request | None = None
    body = b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return Reading(tuple(messages), "refused")
        if event is h11.NEED_DATA:
            waiting = request is not None or bool(conn.trailing_data[0])
            return Reading(tuple(messages), "incomplete" if waiting else "complete")
        if isinstance(event, h11.Request):
            request, body = event, b""
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            messages.append(
                Message(
                    request.method,
                    request.target,
                    request.http_version,
                    normal([(bytes(k), bytes(v)) for k, v in request.headers.raw_items()]),
                    body,
                )
            )
            request = None
            conn.send(h11.Response(status_code=404, headers=[("Content-Length", "0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return Reading(tuple(messages), "closed")
            conn.start_next_cycle()


REFERENCES = {"llhttp": llhttp_reads, "h11": h11_reads}


def stricter(mine: Reading, theirs: Reading) -> bool:
    """The router read a prefix of what the reference read and refused the rest."""
    n = len(mine.messages)
    return (
        mine.end == "refused"
        and mine.messages == theirs.messages[:n]
        and (len(theirs.messages) > n or theirs.end != "refused")
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_router_reads_what_llhttp_and_h11_read(case: Case) -> None:
    mine = router_reads([case.data])
    for name, reads in REFERENCES.items():
        theirs = reads(case.data)
        if name in case.stricter_than:
            assert stricter(mine, theirs), f"{name}: {theirs}\nrouter: {mine}"
        elif name in case.closes_sooner:
            assert theirs.end == "closed", f"{name}: {theirs}"
            assert mine.messages[: len(theirs.messages)] == theirs.messages
        else:
            assert mine == theirs, f"{name}: {theirs}\nrouter: {mine}"


def test_the_corpus_is_the_kind_attacks_use() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(CASES) >= 98
    for case in CASES:
        assert case.why or not case.stricter_than, case.id
    refused = [c for c in CASES if router_reads([c.data]).end == "refused"]
    read = [c for c in CASES if router_reads([c.data]).messages]
    assert len(refused) >= 60 and len(read) >= 40


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_read_in_any_pieces_as_read_whole(case: Case, cuts: list[int]) -> None:
    data = case.data
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert router_reads(pieces) == router_reads([data])
