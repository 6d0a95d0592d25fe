"""The router's HTTP/1.1 server on the client side (`Site`): the generations it forwards are
read and answered by each connection's own protocol; every other request is aiohttp's.

A connection starts with `_Connection`. It reads a request's head, and when that is a plain
request the router forwards (`paths.forwarded`; HTTP/1.0 or 1.1; a body of known length within
`max_body_bytes`; no Transfer-Encoding, Content-Encoding, Expect or Upgrade; printable ASCII
only, at most `MAX_HEAD_BYTES`), reads its body, has `proxy.forward` answer it and writes the
answer itself: the pod's status, headers and bytes, with aiohttp's framing and its Date,
Server and Connection headers, so the client cannot tell the two servers apart. The first
request that is anything else (the router's own pages, probes and model list, a path it does
not serve, a chunked or compressed body, `Expect: 100-continue`, a head that does not parse,
one too long) goes, with the rest of its connection, to aiohttp's server and the app's routes:
the connection is handed over between two requests, with the bytes read so far. Every answer
that is not a forwarded generation, and every refusal of what does not parse, is aiohttp's.

Requests on one connection are answered in order, one at a time (pipelined ones wait, reading
pauses past `_PIPELINED_BYTES`); a client that leaves mid-answer ends only its own exchange.
An idle connection is closed after `KEEPALIVE_S`; `stop` (the runner's cleanup) stops
listening, closes the idle connections and waits up to `SHUTDOWN_TIMEOUT_S` for the others'
answers.

Why not aiohttp's server for everything: clients behind a Service open a connection per
request, and aiohttp's server (a request handler, a task, a timer, its request and response
objects for each) costs about as much CPU as everything else the router does for a request
(docs/benchmarks.md, "The router's own cost per request").

Must not: route (`routing`) or talk to the pods (`upstream`): what it answers is
`proxy.forward`'s, or, when that raises, what aiohttp's server answers then (the HTTP error
raised, or a 500).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import NamedTuple

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from lora_router import bodies, paths, proxy
from lora_router.state import CONFIG, STATE, ProxyState

log = logging.getLogger("lora_router")

# aiohttp's limit on one line of a head: a longer head is aiohttp's to take (or refuse).
MAX_HEAD_BYTES = 8190
_MAX_HEADERS = 128  # aiohttp's
KEEPALIVE_S = 3630.0  # aiohttp's: an idle connection is closed after this long
SHUTDOWN_TIMEOUT_S = 60.0  # aiohttp's: how long `stop` waits for the answers in progress
_PIPELINED_BYTES = 64 * 1024  # read ahead of the request being answered before pausing
_SWEEP_S = 60.0  # how often idle connections are looked at

# Control characters but HT, CR and LF (a CR or LF outside a CRLF is found by counting).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Headers whose requests aiohttp's server takes: it decodes a compressed body, answers 100
# before reading one, de-chunks one, refuses an upgrade.
_HANDED_OVER = frozenset({"transfer-encoding", "content-encoding", "expect", "upgrade"})
_EMPTY_BODY = frozenset((204, 304, *range(100, 200)))
_SERVER_ERROR = b"500 Internal Server Error\n\nServer got itself in trouble"


class Request(NamedTuple):
    """A request head the router's own server answers."""

    method: str
    target: str  # as sent: the path and the query
    path: str
    minor: int  # HTTP/1.minor
    headers: list[tuple[str, str]]
    length: int  # of the body
    keep_alive: bool


def parse_head(head: bytes, max_body: int) -> Request | None:
    """The request whose head is `head` (the bytes before its blank line) when this server
    answers it; None when aiohttp's server is to take it: anything but a plain request the
    router forwards, with a body of known length up to `max_body` (pure)."""
    if len(head) > MAX_HEAD_BYTES or not head.isascii():
        return None
    text = head.decode("ascii")
    lines = text.split("\r\n")
    breaks = len(lines) - 1
    if text.count("\r") != breaks or text.count("\n") != breaks or _CONTROL.search(text):
        return None
    parts = lines[0].split(" ")
    if len(parts) != 3 or len(lines) > _MAX_HEADERS + 1:
        return None
    method, target, version = parts
    if version == "HTTP/1.1":
        minor = 1
    elif version == "HTTP/1.0":
        minor = 0
    else:
        return None
    path = target.partition("?")[0]
    if not paths.forwarded(method, path) or method != method.upper() or "#" in target:
        return None  # an escaped path, an absolute URL, a lower-case method: aiohttp's
    headers: list[tuple[str, str]] = []
    length: int | None = None
    close = keep_alive = False
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or _TOKEN.fullmatch(name) is None:
            return None  # obs-fold, a space before the colon, no colon
        value = value.strip(" \t")
        lower = name.lower()
        if lower == "content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif lower == "connection":
            tokens = {t.strip(" \t") for t in value.lower().split(",")}
            if "upgrade" in tokens:
                return None
            close = close or "close" in tokens
            keep_alive = keep_alive or "keep-alive" in tokens
        elif lower in _HANDED_OVER:
            return None
        headers.append((name, value))
    length = length or 0
    if length > max_body:
        return None  # aiohttp's server answers the proxy's 413
    return Request(
        method,
        target,
        path,
        minor,
        headers,
        length,
        not close if minor else keep_alive and not close,
    )


class Site(web.BaseSite):
    """The router's app on `host:port`, answered as the module says. A site of the app's
    runner: the runner's cleanup stops it before the app's own cleanup closes the pool."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, backlog: int = 128):
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self._app = runner.app
        self.connections: set[_Connection] = set()
        self.closing = False
        self._sweeper: asyncio.TimerHandle | None = None
        self._date, self._date_at = "", -1

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        """The port listened on (the one the system chose, for port 0)."""
        if self._server is not None:
            sockets = getattr(self._server, "sockets", None)
            if sockets:
                return int(sockets[0].getsockname()[1])
        return self._port

    @property
    def state(self) -> ProxyState:
        return self._app[STATE]

    @property
    def max_body(self) -> int:
        return self._app[CONFIG].max_body_bytes

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        state, max_body = self.state, self.max_body
        self._server = await loop.create_server(
            lambda: _Connection(self, state, max_body),
            self._host,
            self._port,
            backlog=self._backlog,
        )
        self._sweeper = loop.call_later(_SWEEP_S, self._sweep)

    async def stop(self) -> None:
        """Stop listening; answer the requests in progress (up to `SHUTDOWN_TIMEOUT_S`), close
        every connection."""
        self.closing = True
        await super().stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = []
        for conn in list(self.connections):
            if conn.task is None:
                conn.close()
            else:
                tasks.append(conn.task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_S)
            for task in pending:
                task.cancel()
        for conn in list(self.connections):
            conn.close()

    def aiohttp_handler(self) -> asyncio.Protocol:
        """A connection protocol of aiohttp's server for the app."""
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        return server()

    def date(self) -> str:
        """The Date header's value, made once a second."""
        now = int(time.time())
        if now != self._date_at:
            self._date, self._date_at = formatdate(now, usegmt=True), now
        return self._date

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self.connections if c.task is None]:
            if now - conn.idle_since > KEEPALIVE_S:
                conn.close()
        self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)


class _Connection(asyncio.Protocol):
    """One client connection while the router's own server answers it; the `proxy.Reply` of
    the request in progress."""

    def __init__(self, site: Site, state: ProxyState, max_body: int) -> None:
        self.site, self.state, self.max_body = site, state, max_body
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.request: Request | None = None  # a head read, its body still to come
        self.task: asyncio.Task[None] | None = None  # the request being answered
        self.lost = False
        self.reading_paused = False
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused
        self.idle_since = time.monotonic()
        # The answer in progress: HTTP/1.minor, whether the connection stays open after it,
        # whether its body is chunked, whether its head was sent.
        self.minor, self.keep_alive, self.chunked, self.started = 1, True, False, False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.site.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._next()
        elif len(self.buffer) > _PIPELINED_BYTES and not self.reading_paused:
            self.reading_paused = True
            if self.transport is not None:
                self.transport.pause_reading()

    def eof_received(self) -> bool:
        # As aiohttp's server: a client that stops sending gets its connection closed.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.site.connections.discard(self)
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    # Reading requests

    def _next(self) -> None:
        """Start answering the next request in the buffer, once it is whole."""
        buffer, request = self.buffer, self.request
        if request is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    self._hand_over()
                return
            request = parse_head(bytes(buffer[:end]), self.max_body)
            if request is None:
                self._hand_over()
                return
            del buffer[: end + 4]
            self.request = request
        if len(buffer) < request.length:
            return
        body = bytes(buffer[: request.length])
        del buffer[: request.length]
        self.request = None
        self.task = asyncio.get_running_loop().create_task(self._serve(request, body))

    def _hand_over(self) -> None:
        """The rest of the connection to aiohttp's server, from the first byte not answered."""
        transport = self.transport
        if transport is None or self.lost:
            return
        self.site.connections.discard(self)
        handler = self.site.aiohttp_handler()
        data = bytes(self.buffer)
        self.buffer.clear()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self.reading_paused:
            transport.resume_reading()
        if data:
            handler.data_received(data)

    async def _serve(self, request: Request, body: bytes) -> None:
        self.minor, self.chunked, self.started = request.minor, False, False
        self.keep_alive = request.keep_alive and not self.site.closing
        try:
            await proxy.forward(
                self.state, self, request.method, request.path, request.target,
                request.headers, body,
            )  # fmt: skip
        except ConnectionError:
            self.keep_alive = False  # the client left mid-answer
        except web.HTTPException as e:  # as aiohttp's server answers one a handler raised
            if self.started:
                self.keep_alive = False
            else:
                headers = {**e.headers, "Content-Type": "text/plain; charset=utf-8"}
                self._write_answer(e.status, e.reason, headers, (e.text or "").encode())
        except Exception:
            log.exception("action=proxy result=error")
            self.keep_alive = False
            if not self.started:
                self._write_answer(
                    500, "Internal Server Error", {"Content-Type": "text/plain; charset=utf-8"},
                    _SERVER_ERROR,
                )  # fmt: skip
        finally:
            self.task = None
        if self.lost or self.transport is None:
            return
        if not self.keep_alive or self.site.closing:
            self.transport.close()
            return
        self.idle_since = time.monotonic()
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buffer:
            self._next()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # proxy.Reply: the answer

    def error(
        self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        """The router's own error, as aiohttp's `json_response` writes it."""
        body = json.dumps(bodies.error_body(message, error_type, status)).encode()
        answer = dict(headers or {})
        answer["Content-Type"] = "application/json; charset=utf-8"
        self._write_answer(status, _reason(status), answer, body)

    def send(self, status: int, reason: str, headers: dict[str, str], body: bytes) -> None:
        self._write_answer(status, reason, headers, body)

    async def start(
        self, status: int, reason: str, headers: dict[str, str], length: int | None
    ) -> None:
        if length is None and status not in _EMPTY_BODY:
            if self.minor:
                self.chunked = True
            else:
                self.keep_alive = False  # HTTP/1.0: the body ends with the connection
        self._write(self._head(status, reason, headers, length))
        await self._drain()

    async def write(self, data: bytes) -> None:
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        if not data:
            return
        if self.chunked:
            self._write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._write(data)
        await self._drain()

    async def end(self) -> None:
        if self.chunked:
            self._write(b"0\r\n\r\n")

    def abort(self) -> None:
        self.keep_alive = False
        self.close()

    def _write_answer(self, status: int, reason: str, headers: dict[str, str], body: bytes) -> None:
        if status in _EMPTY_BODY:
            self._write(self._head(status, reason, headers, None))
        else:
            self._write(self._head(status, reason, headers, len(body)) + body)

    def _head(self, status: int, reason: str, headers: dict[str, str], length: int | None) -> bytes:
        """The answer's head as aiohttp's server writes it: the headers given, then the framing,
        a Content-Type when there is a body and none was given, Date, Server, Connection."""
        self.started = True
        lines = [f"HTTP/1.{self.minor} {status} {reason}\r\n"]
        names = set()
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n")
            names.add(name.lower())
        empty = status in _EMPTY_BODY
        if empty:
            pass
        elif length is not None:
            lines.append(f"Content-Length: {length}\r\n")
        elif self.chunked:
            lines.append("Transfer-Encoding: chunked\r\n")
        if not empty and length != 0 and "content-type" not in names:
            lines.append("Content-Type: application/octet-stream\r\n")
        if "date" not in names:
            lines.append(f"Date: {self.site.date()}\r\n")
        if "server" not in names:
            lines.append(f"Server: {SERVER_SOFTWARE}\r\n")
        if self.site.closing:
            self.keep_alive = False
        if not self.keep_alive and self.minor:
            lines.append("Connection: close\r\n")
        elif self.keep_alive and not self.minor:
            lines.append("Connection: keep-alive\r\n")
        lines.append("\r\n")
        text = "".join(lines)
        if text.count("\n") != len(lines) or text.count("\r") != len(lines):
            # A CR or LF inside a header (the pod's): aiohttp refuses to write it too.
            self.started = False
            raise ValueError("a header of the answer holds a line break")
        return text.encode("utf-8")

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if not self.lost and transport is not None and not transport.is_closing():
            transport.write(data)

    async def _drain(self) -> None:
        if self.drained is not None:
            await self.drained
        if self.lost:
            raise ConnectionResetError("the client closed the connection")


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
