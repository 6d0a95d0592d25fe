"""The router's connections to the inference pods: one owner, a pool of kept-alive HTTP/1.1
connections per pod, and the exchange of one request and its answer over them.

`Pool.request(address, method, target, headers, body)` writes the request as one buffer on an
idle connection to `address` (or a new one, within `connect_timeout_s`) and returns an `Answer`
once the answer's head has arrived: its status, reason and headers, and its body, read whole
(`read`) or as it comes (`chunks`). The bytes are the pod's, never decoded or re-encoded; a
chunked answer is de-chunked (its data untouched). The whole exchange, head and body, has
`timeout_s`. A connection goes back to the pool once its answer was read to its end and neither
side asked to close it; any other ending closes it.

Errors, in the words the proxy maps to HTTP:
- `Unanswered("connect")`: no connection (refused, unreachable, none within the timeout).
- `Unanswered("gone")`: the pod left (`forget`) while the request waited for its answer's head.
- `Unanswered("disconnect")`: the connection closed or reset before any byte of the answer
  came back. A request that may be repeated (GET, HEAD, PUT, DELETE, OPTIONS) which meets a
  kept-alive connection the pod had just closed is sent once more on a new connection first,
  as RFC 9112 9.3.1 allows; any other request is the caller's to send elsewhere.
- `TimeoutError`: no answer head within `timeout_s` (the pod may still be working on it).
- `Broken`: the head was malformed, or the body broke off or ran past the deadline.

Must not: choose pods, or know what the bodies mean beyond HTTP/1.1 framing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
MAX_HEAD_BYTES = 64 * 1024
# A connection idle for longer is not reused: a server may close it at any moment (aiohttp's
# client keeps them 15 s, a server 75 s by default).
IDLE_S = 15.0
_HIGH_WATER = 256 * 1024  # bytes of an answer buffered before reading pauses
_END = b"\r\n\r\n"


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

    def take(self, n: int) -> bytes:
        if n >= len(self.buffer):
            data = bytes(self.buffer)
            self.buffer.clear()
            return data
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

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
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        length: int | None,
        chunked: bool,
        keep_alive: bool,
        timer: asyncio.TimerHandle,
    ) -> None:
        self.status, self.reason, self.headers = status, reason, headers
        # The body's length when the pod gave one (None: chunked or until the connection ends).
        self.content_length = length
        self._pool, self._address, self._conn, self._timer = pool, address, conn, timer
        self._chunked, self._keep_alive = chunked, keep_alive
        self._left = length  # bytes of a body of known length still to come
        self._chunk_left = 0  # of the current chunk, when chunked
        self._chunk_crlf = False  # the CRLF that ends a chunk's data is still to come
        self._done = length == 0

    async def read(self) -> bytes:
        """The whole body."""
        if self._left is not None and not self._chunked:
            conn = self._conn
            while len(conn.buffer) < self._left:
                await self._more()
            data = conn.take(self._left)
            self._left, self._done = 0, True
            return data
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes, in the pieces it comes in."""
        while not self._done:
            piece = self._piece()
            if piece:
                yield piece
            elif not self._done:
                await self._more()

    def _piece(self) -> bytes:
        """Whatever of the body the buffer holds now (b"" when it holds none yet)."""
        conn = self._conn
        if not self._chunked:
            if self._left is None:  # until the connection ends
                if conn.lost is not None and not conn.buffer:
                    self._done = True
                return conn.take(len(conn.buffer))
            data = conn.take(min(self._left, len(conn.buffer)))
            self._left -= len(data)
            self._done = self._left == 0
            return data
        if self._chunk_left:
            data = conn.take(min(self._chunk_left, len(conn.buffer)))
            self._chunk_left -= len(data)
            self._chunk_crlf = self._chunk_left == 0
            return data
        if self._chunk_crlf:
            if len(conn.buffer) < 2:
                return b""
            if conn.take(2) != b"\r\n":
                raise Broken("a chunk did not end with CRLF")
            self._chunk_crlf = False
        end = conn.buffer.find(b"\r\n")
        if end < 0:
            if len(conn.buffer) > 1024:
                raise Broken("a chunk size line is too long")
            return b""
        try:
            size = int(bytes(conn.buffer[:end]).split(b";", 1)[0], 16)
        except ValueError as e:
            raise Broken(f"a chunk size is not hexadecimal: {bytes(conn.buffer[:end])!r}") from e
        if size:
            del conn.buffer[: end + 2]
            self._chunk_left = size
            return self._piece()
        trailer = conn.buffer.find(_END, end)  # the last chunk, then (no) trailers
        if conn.buffer[end : end + 4] == _END:
            del conn.buffer[: end + 4]
        elif trailer >= 0:
            del conn.buffer[: trailer + 4]
        else:
            return b""
        self._done = True
        return b""

    async def _more(self) -> None:
        conn = self._conn
        if conn.lost is not None:
            if conn.timed_out:
                raise Broken("the answer did not end within the timeout")
            if self._left is None and not self._chunked:
                return  # a body that ends with the connection
            raise Broken(f"the connection closed mid-answer: {conn.lost}")
        await conn.more()

    def close(self) -> None:
        """Back to the pool when the body was read to its end and the connection may be kept;
        closed otherwise."""
        self._timer.cancel()
        if self._done and self._keep_alive and self._conn.lost is None and not self._conn.buffer:
            self._pool.release(self._address, self._conn)
        else:
            self._conn.close()


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
        head = [f"{method} {target} HTTP/1.1\r\nHost: {address}\r\n"]
        head.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        if body or method not in IDEMPOTENT:
            head.append(f"Content-Length: {len(body)}\r\n")
        head.append("\r\n")
        message = "".join(head).encode("utf-8", "surrogateescape") + body
        retry = method in IDEMPOTENT
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
                end = conn.buffer.find(_END)
                if end >= 0:
                    parsed = _parse_head(bytes(conn.buffer[:end]), method)
                    del conn.buffer[: end + 4]
                    if parsed is not None:
                        break
                    continue  # 1xx: the real head follows
                if len(conn.buffer) > MAX_HEAD_BYTES:
                    raise Broken(f"the answer's head is longer than {MAX_HEAD_BYTES} bytes")
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
        status, reason, headers, length, chunked, keep_alive = parsed
        return Answer(
            self, address, conn, status, reason, headers, length, chunked, keep_alive, timer
        )

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


_Head = tuple[int, str, list[tuple[str, str]], int | None, bool, bool]


def _parse_head(head: bytes, method: str) -> _Head | None:
    """The answer's status, reason, headers and framing from its head (None: a 1xx, whose
    real answer follows); raises Broken when it is not HTTP/1.x."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise Broken(f"the answer does not start with an HTTP/1.x status line: {lines[0]!r}")
    status = int(code)
    if 100 <= status < 200 and status != 101:
        return None
    headers: list[tuple[str, str]] = []
    length: int | None = None
    chunked, close = False, version == "HTTP/1.0"
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise Broken(f"a header line of the answer is malformed: {line!r}")
        value = value.strip()
        lower = name.lower()
        if lower == "content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise Broken(f"the answer's Content-Length is not one length: {value!r}")
            length = int(value)
        elif lower == "transfer-encoding":
            chunked = value.lower().endswith("chunked")
        elif lower == "connection":
            tokens = {t.strip().lower() for t in value.split(",")}
            close = "close" in tokens or (close and "keep-alive" not in tokens)
        headers.append((name, value))
    if method == "HEAD" or status in (204, 304):
        length, chunked = 0, False
    elif chunked:
        length = None
    return status, reason, headers, length, chunked, not close and (chunked or length is not None)
