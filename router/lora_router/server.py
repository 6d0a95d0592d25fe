"""The router's HTTP/1.1 server on the client side (`Site`): the generations it forwards are
read and answered by each connection's own protocol; every other request is aiohttp's.

A connection starts with `_Connection`. It reads a request's head with `http1` (which refuses
what is not HTTP/1.1 as RFC 9112 writes it: the router answers those itself, 4xx or 5xx, and
closes), and when that is a plain request the router forwards (`paths.forwarded`, the method as
written; a body of known length within `max_body_bytes`; no Transfer-Encoding,
Content-Encoding, Expect or Upgrade), reads its body, has `proxy.forward` answer it and writes
the answer itself: the pod's status, headers and bytes, with aiohttp's framing and its Date,
Server and Connection headers, so the client cannot tell the two servers apart. The first
request that is anything else (the router's own pages, probes and model list, a path it does
not serve, a chunked or compressed body, `Expect: 100-continue`, a body over the limit) goes,
with the rest of its connection, to aiohttp's server and the app's routes, through a
`handover.Relay` that still reads every request by `http1`'s rules before aiohttp's server sees
it: the connection is handed over between two requests, with the bytes read so far.

Requests on one connection are answered in order, one at a time (pipelined ones wait, reading
pauses past `_PIPELINED_BYTES`); a client that leaves mid-answer ends only its own exchange.
Slow clients are cut off: a head not whole within `http1.HEAD_TIMEOUT_S` of its first byte (the
first, of the connection's opening) is answered 408, and so is a body that brings less than
`http1.BODY_MIN_BYTES` (or its rest) in a `http1.BODY_WINDOW_S`; the site looks every
`SWEEP_S`. An idle connection is closed after `KEEPALIVE_S`; `stop` (the runner's cleanup) stops
listening, closes the idle connections and waits up to `SHUTDOWN_TIMEOUT_S` for the others'
answers.

Why not aiohttp's server for everything: clients behind a Service open a connection per
request, and aiohttp's server (a request handler, a task, a timer, its request and response
objects for each) costs about as much CPU as everything else the router does for a request
(docs/benchmarks.md, "The router's own cost per request").

Must not: route (`routing`), talk to the pods (`upstream`), or parse HTTP/1.1 itself (`http1`):
what it answers is `proxy.forward`'s, or, when that raises, what aiohttp's server answers then
(the HTTP error raised, or a 500).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from email.utils import formatdate

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from lora_router import bodies, handover, http1, paths, proxy
from lora_router.state import CONFIG, STATE, ProxyState

log = logging.getLogger("lora_router")

KEEPALIVE_S = 3630.0  # aiohttp's: an idle connection is closed after this long
SHUTDOWN_TIMEOUT_S = 60.0  # aiohttp's: how long `stop` waits for the answers in progress
SWEEP_S = 1.0  # how often the connections' deadlines are looked at
_PIPELINED_BYTES = 64 * 1024  # read ahead of the request being answered before pausing
_EMPTY_BODY = frozenset((204, 304, *range(100, 200)))
_SERVER_ERROR = b"500 Internal Server Error\n\nServer got itself in trouble"
# The phases of a connection, for its deadline: between requests, reading a head, reading a
# body, answering.
_IDLE, _HEAD, _BODY, _BUSY = range(4)


def takes(request: http1.Request, max_body: int) -> bool:
    """Whether the router's own server answers `request` (pure): a plain request it forwards,
    with a body of known length up to `max_body`; every other one is aiohttp's server's."""
    method = request.method
    return (
        paths.forwarded(method, request.path)
        and method.isupper()
        and "#" not in request.target
        and not request.chunked
        and not request.expect
        and not request.upgrade
        and not request.encoded
        and (request.length or 0) <= max_body
    )


class Site(web.BaseSite):
    """The router's app on `host:port`, answered as the module says. A site of the app's
    runner: the runner's cleanup stops it before the app's own cleanup closes the pool (and,
    with aiohttp's server, the connections handed to it)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, backlog: int = 128):
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self._app = runner.app
        self.connections: set[_Connection] = set()
        self.relays: set[handover.Relay] = set()  # the connections aiohttp's server answers
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
        # An app that forwards nothing (the metrics app) has every request relayed to aiohttp's
        # server, under the same rules and deadlines.
        state, max_body = self._app.get(STATE), self.max_body if CONFIG in self._app else -1
        self._server = await loop.create_server(
            lambda: _Connection(self, state, max_body),
            self._host,
            self._port,
            backlog=self._backlog,
        )
        self._sweeper = loop.call_later(SWEEP_S, self.sweep)

    async def stop(self) -> None:
        """Stop listening; answer the requests in progress (up to `SHUTDOWN_TIMEOUT_S`), close
        every connection (aiohttp's server closes those it answers)."""
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

    def sweep(self) -> None:
        """Act on every connection whose deadline passed (`_Connection.expire`,
        `handover.Relay.expire`); again in `SWEEP_S`."""
        now = time.monotonic()
        for conn in [c for c in self.connections if c.deadline <= now]:
            conn.expire(now)
        for relay in [r for r in self.relays if r.deadline <= now]:
            relay.expire(now)
        if not self.closing:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self.sweep)


class _Connection(asyncio.Protocol):
    """One client connection while the router's own server answers it; the `proxy.Reply` of
    the request in progress."""

    def __init__(self, site: Site, state: ProxyState | None, max_body: int) -> None:
        self.site, self.state, self.max_body = site, state, max_body
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.request: http1.Request | None = None  # a head read, its body still to come
        self.task: asyncio.Task[None] | None = None  # the request being answered
        self.lost = False
        self.reading_paused = False
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused
        # The deadline of the phase the connection is in (`expire` says what each one means):
        # a connection's first head is due from its opening.
        self.phase = _HEAD
        self.deadline = time.monotonic() + http1.HEAD_TIMEOUT_S
        self.body_mark = 0  # bytes of the body buffered when its current window began
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
            if self.phase == _IDLE:
                self.phase, self.deadline = _HEAD, time.monotonic() + http1.HEAD_TIMEOUT_S
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
            try:
                end = http1.head_end(buffer)
                if end < 0:
                    return
                request = http1.parse_request(bytes(buffer[: end - 4]))
            except http1.HttpError as e:
                self._refuse(e)
                return
            if self.state is None or not takes(request, self.max_body):
                self._hand_over()
                return
            del buffer[:end]
            self.request = request
        length = request.length or 0
        if len(buffer) < length:
            if self.phase != _BODY:
                self.phase, self.body_mark = _BODY, len(buffer)
                self.deadline = time.monotonic() + http1.BODY_WINDOW_S
            return
        body = bytes(buffer[:length])
        del buffer[:length]
        self.request = None
        self.phase, self.deadline = _BUSY, math.inf
        if self.state is not None:
            self.task = asyncio.get_running_loop().create_task(
                self._serve(self.state, request, body)
            )

    def expire(self, now: float) -> None:
        """The phase's deadline passed: an idle connection is closed; a head that is not whole
        is answered 408; a body that brought `http1.BODY_MIN_BYTES` (or its rest) in its window
        gets another window, else a 408."""
        if self.phase == _BODY and self.request is not None:
            got = len(self.buffer) - self.body_mark
            if got >= min(http1.BODY_MIN_BYTES, (self.request.length or 0) - self.body_mark):
                self.body_mark, self.deadline = len(self.buffer), now + http1.BODY_WINDOW_S
                return
            self._refuse(http1.HttpError(408, "the request's body did not come in time"))
        elif self.phase == _HEAD and self.buffer:
            self._refuse(http1.HttpError(408, "the request's head did not come in time"))
        elif self.phase != _BUSY:
            self.deadline = math.inf
            self.close()

    def _refuse(self, error: http1.HttpError) -> None:
        """Answer a request the router does not read (no answer is in progress), and close."""
        self.phase, self.deadline = _BUSY, math.inf
        self.buffer.clear()
        log.debug("action=refuse status=%d error=%s", error.status, error.message)
        self._write(http1.refusal(error.status, error.message, self.site.date(), SERVER_SOFTWARE))
        self.close()

    def _hand_over(self) -> None:
        """The rest of the connection to aiohttp's server, from the first byte not answered."""
        transport = self.transport
        if transport is None or self.lost:
            return
        self.site.connections.discard(self)
        self.phase, self.deadline = _BUSY, math.inf
        data = bytes(self.buffer)
        self.buffer.clear()
        relay = handover.Relay(transport, self.site.aiohttp_handler(), self.site.relays)
        if self.reading_paused:
            transport.resume_reading()
        relay.start(data)

    async def _serve(self, state: ProxyState, request: http1.Request, body: bytes) -> None:
        self.minor, self.chunked, self.started = request.minor, False, False
        self.keep_alive = request.keep_alive and not self.site.closing
        try:
            await proxy.forward(
                state, self, request.method, request.path, request.target,
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
        self.phase, self.deadline = _IDLE, time.monotonic() + KEEPALIVE_S
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buffer:
            self.phase, self.deadline = _HEAD, time.monotonic() + http1.HEAD_TIMEOUT_S
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
        self._write_answer(status, http1.reason(status), answer, body)

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
        return text.encode("utf-8", "surrogateescape")

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if not self.lost and transport is not None and not transport.is_closing():
            transport.write(data)

    async def _drain(self) -> None:
        if self.drained is not None:
            await self.drained
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
