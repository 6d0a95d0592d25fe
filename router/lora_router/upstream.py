"""The router's connections to the inference pods: one owner, a pool of kept-alive HTTP/1.1
connections per pod, and the exchange of one request and its answer over them.

`Pool.request(address, method, target, headers, body)` writes the request as one buffer on an
idle connection to `address` (or a new one, within `connect_timeout_s`) and returns an `Answer`
once the answer's head has arrived: its status, reason and headers, and its body, read whole
(`read`) or as it comes (`chunks`). The bytes are the pod's, never decoded or re-encoded; a
chunked answer is de-chunked (its data untouched). The whole exchange, head and body, has
`timeout_s`. A connection goes back to the pool once its answer was read to its end and neither
side asked to close it; any other ending closes it. The request's bytes, the answer's head and
its body's framing are `http1`'s: the headers a client sent are the caller's to strip
(`http1.forwarded_headers`).

Errors, in the words the proxy maps to HTTP:
- `Unanswered("connect")`: no connection (refused, unreachable, none within the timeout).
- `Unanswered("gone")`: the pod left (`forget`) while the request waited for its answer's head.
- `Unanswered("disconnect")`: the connection closed or reset before any byte of the answer
  came back. A request that may be repeated (GET, HEAD, PUT, DELETE, OPTIONS) which meets a
  kept-alive connection the pod had just closed is sent once more on a new connection first,
  as RFC 9112 9.3.1 allows; any other request is the caller's to send elsewhere.
- `TimeoutError`: no answer head within `timeout_s` (the pod may still be working on it).
- `Broken`: the head was malformed (`http1.parse_response` refused it: a bare LF, two lengths,
  a length beside a transfer coding, ...), longer than `http1.MAX_ANSWER_HEAD_BYTES`, or the
  body was malformed, broke off or ran past the deadline.

Must not: choose pods, know what the bodies mean beyond HTTP/1.1 framing, or parse HTTP/1.1
itself (`http1`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from lora_router import http1

# A connection idle for longer is not reused: a server may close it at any moment (aiohttp's
# client keeps them 15 s, a server 75 s by default).
IDLE_S = 15.0
_HIGH_WATER = 256 * 1024  # bytes of an answer buffered before reading pauses


class Unanswered(Exception):
    """The request got no answer: sending it to another pod is safe. `kind` is `connect`,
    `disconnect` or `gone` (the metrics' words)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Broken(Exception):
    """The answer broke off (or its head made no sense) after the request was sent."""


class _Connection(asyncio.Protocol):
    """One TCP connection: the bytes received, and one waiter woken when more come."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.lost: BaseException | None = None  # set once the connection is gone
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.timed_out = False  # the exchange's deadline passed (and closed the connection)
        self.gone = False  # the pod left while this connection waited for an answer's head
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.connection_lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = exc or ConnectionResetError("the pod closed the connection")
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def expire(self) -> None:
        self.timed_out = True
        self.close()
        self.connection_lost(TimeoutError())

    async def more(self) -> None:
        """Wait for more bytes (or the end of the connection): the caller took what it could
        use, so reading resumes."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.lost is None:
            self.lost = ConnectionResetError("closed")


class Answer:
    """A pod's answer whose head has arrived; the body is read with `read` or `chunks`, then
    `close` (always) gives the connection back or closes it."""

    def __init__(
        self,
        pool: Pool,
        address: str,
        conn: _Connection,
        head: http1.Response,
        timer: asyncio.TimerHandle,
    ) -> None:
        self.status, self.reason, self.headers = head.status, head.reason, head.headers
        # The body's length when the pod gave one (None: chunked or until the connection ends).
        self.content_length = head.length
        self._pool, self._address, self._conn, self._timer = pool, address, conn, timer
        self._keep_alive = head.keep_alive
        self._body = http1.Body(head.length, head.chunked)

    async def read(self) -> bytes:
        """The whole body."""
        body, conn = self._body, self._conn
        if body.left is not None and not body.chunked:
            while len(conn.buffer) < body.left:
                await self._more()
            return body.take(conn.buffer)
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes, in the pieces it comes in."""
        body, conn = self._body, self._conn
        while not body.done:
            try:
                piece = body.take(conn.buffer)
            except http1.HttpError as e:
                raise Broken(e.message) from e
            if piece:
                yield piece
            elif not body.done:
                if body.left is None and not body.chunked and conn.lost is not None:
                    body.done = True  # a body that ends with the connection
                    return
                await self._more()

    async def _more(self) -> None:
        conn = self._conn
        if conn.lost is not None:
            if conn.timed_out:
                raise Broken("the answer did not end within the timeout")
            if self._body.left is None and not self._body.chunked:
                return  # a body that ends with the connection
            raise Broken(f"the connection closed mid-answer: {conn.lost}")
        await conn.more()

    def close(self) -> None:
        """Back to the pool when the body was read to its end and the connection may be kept;
        closed otherwise."""
        self._timer.cancel()
        conn = self._conn
        if self._body.done and self._keep_alive and conn.lost is None and not conn.buffer:
            self._pool.release(self._address, conn)
        else:
            conn.close()


class Pool:
    """Kept-alive connections per pod address (host:port), most recently used first."""

    def __init__(self, connect_timeout_s: float, timeout_s: float) -> None:
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s
        self._idle: dict[str, list[_Connection]] = {}
        # address -> the connections whose request waits for its answer's head
        self._waiting: dict[str, set[_Connection]] = {}
        self._closed = False

    async def request(
        self, address: str, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> Answer:
        """Send the request; the answer once its head is in (see the module's docstring)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        message = http1.encode_request(method, target, address, headers, body)
        retry = method in http1.IDEMPOTENT
        while True:
            conn = self._idle_connection(address, loop.time())
            reused = conn is not None
            if conn is None:
                conn = await self._connect(address, started + self.timeout_s - loop.time())
            try:
                return await self._exchange(address, conn, message, method, started)
            except _Stale:
                # The pod closed a kept-alive connection before any byte of the answer.
                if not (reused and retry):
                    raise Unanswered("disconnect", "the pod closed the connection") from None
                retry = False

    async def _exchange(
        self, address: str, conn: _Connection, message: bytes, method: str, started: float
    ) -> Answer:
        loop = asyncio.get_running_loop()
        # One timer for the whole exchange, head and body: `Answer.close` cancels it.
        timer = loop.call_at(started + self.timeout_s, conn.expire)
        waiting = self._waiting.setdefault(address, set())
        try:
            if conn.transport is None or conn.lost is not None:
                raise _Stale
            conn.transport.write(message)
            waiting.add(conn)
            while True:
                try:
                    end = http1.head_end(conn.buffer, http1.MAX_ANSWER_HEAD_BYTES)
                    if end >= 0:
                        head = http1.parse_response(bytes(conn.buffer[: end - 4]), method)
                        del conn.buffer[:end]
                        if head is not None:
                            break
                        continue  # 1xx: the real head follows
                except http1.HttpError as e:
                    raise Broken(f"the answer's head: {e.message}") from e
                if conn.lost is not None:
                    if conn.gone:
                        raise Unanswered("gone", "left the endpoints before answering")
                    if conn.timed_out:
                        raise TimeoutError(f"no answer within {self.timeout_s:.0f} s")
                    if conn.buffer:
                        raise Broken(f"the connection closed mid-head: {conn.lost}")
                    raise _Stale
                await conn.more()
        except BaseException:
            timer.cancel()
            conn.close()
            raise
        finally:
            waiting.discard(conn)
        return Answer(self, address, conn, head, timer)

    def _idle_connection(self, address: str, now: float) -> _Connection | None:
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if conn.lost is None and not conn.buffer and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, address: str, left_s: float) -> _Connection:
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        wait = min(self.connect_timeout_s, max(0.0, left_s))
        try:
            async with asyncio.timeout(wait):
                _, conn = await loop.create_connection(_Connection, host.strip("[]"), int(port))
        except TimeoutError as e:
            raise Unanswered("connect", f"no connection within {wait:g} s") from e
        except OSError as e:
            raise Unanswered("connect", f"cannot connect to {address}: {e}") from e
        return conn

    def release(self, address: str, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(address, []).append(conn)

    def forget(self, keep: set[str]) -> None:
        """The pods at addresses not in `keep` left: their idle connections are closed, and the
        requests still waiting for an answer's head there give up (`Unanswered("gone")`)."""
        for address in [a for a in self._idle if a not in keep]:
            for conn in self._idle.pop(address):
                conn.close()
        for address in [a for a in self._waiting if a not in keep]:
            for conn in self._waiting.pop(address):
                conn.gone = True
                conn.close()
                conn.connection_lost(None)

    def close(self) -> None:
        self._closed = True
        self.forget(set())


class _Stale(Exception):
    """The connection was closed before any byte of the answer came back."""
