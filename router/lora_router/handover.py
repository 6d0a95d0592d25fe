"""A client connection once aiohttp's server answers it (`Relay`): every byte still passes through
the router's HTTP/1.1 reader (`http1`) before aiohttp's server sees it, so each request there is
read by the same rules and under the same deadlines as the generations the router answers.

The relay hands aiohttp's server a request's head only once it is whole and `http1` reads it,
then its body as it comes, and knows where each message ends. A head that `http1` refuses is
not passed on: aiohttp's server is handed a line its own parser refuses, so it answers 400 (in
order, after the answers to the requests before it) and closes the connection. A head not whole
within `http1.HEAD_TIMEOUT_S` of its first byte, a body that brings less than
`http1.BODY_MIN_BYTES` (or its rest) in a `http1.BODY_WINDOW_S` while aiohttp's server is
reading, or a malformed chunk, closes the connection. aiohttp's server has no deadline for a
head of its own; the time between requests stays its keep-alive timeout.

Must not: answer anything itself, or change a byte it passes on.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Protocol

from lora_router import http1

# The phases of a relayed connection.
_IDLE, _HEAD, _BODY, _DONE = range(4)  # _DONE: nothing more is read


class Relays(Protocol):
    """Where relays are kept while their connection is open (the site's set)."""

    def add(self, relay: Relay) -> None: ...

    def discard(self, relay: Relay) -> None: ...


class Relay(asyncio.Protocol):
    """The protocol of a connection aiohttp's server answers (the module says how)."""

    def __init__(
        self, transport: asyncio.Transport, handler: asyncio.Protocol, relays: Relays
    ) -> None:
        self.transport, self.handler, self.relays = transport, handler, relays
        self.buffer = bytearray()  # bytes read and not yet passed on
        self.body: http1.Body | None = None  # the body being passed on, when one is
        self.phase = _IDLE
        self.deadline = math.inf  # when `expire` is due (monotonic)
        self.window_need = 0  # bytes of the body the current window must bring
        self.window_got = 0
        self.last = False  # the message being passed on is the connection's last

    def start(self, data: bytes) -> None:
        """Take the connection over from the router's server, with the bytes it read and did
        not answer."""
        self.relays.add(self)
        self.transport.set_protocol(self)
        self.handler.connection_made(self.transport)
        if data:
            self.data_received(data)

    # asyncio.Protocol: the bytes go through `http1` first; the rest is aiohttp's.

    def data_received(self, data: bytes) -> None:
        if self.phase == _DONE:
            return
        self.buffer += data
        try:
            self._pass()
        except http1.HttpError as e:
            self._refuse(e)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.phase = _DONE
        self.relays.discard(self)
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def _pass(self) -> None:
        buffer = self.buffer
        while buffer and self.phase != _DONE:
            body = self.body
            if body is None:
                if self.phase != _HEAD:
                    self.phase, self.deadline = _HEAD, time.monotonic() + http1.HEAD_TIMEOUT_S
                end = http1.head_end(buffer)
                if end < 0:
                    return
                request = http1.parse_request(bytes(buffer[: end - 4]))
                head = bytes(buffer[:end])
                del buffer[:end]
                self.last = not request.keep_alive
                body = self.body = http1.Body(request.length or 0, request.chunked)
                self.phase = _BODY
                self._window(time.monotonic())
                self.handler.data_received(head)
            if not body.done:
                before = bytes(buffer)
                body.take(buffer)
                taken = len(before) - len(buffer)
                self.window_got += taken
                if taken:
                    self.handler.data_received(before[:taken])
                if not body.done:
                    return
            self.body = None
            self.phase, self.deadline = _IDLE, math.inf
            if self.last:
                # Nothing after it is read: aiohttp's server closes once it has answered.
                buffer.clear()
                self.phase = _DONE

    def _window(self, now: float) -> None:
        """A new window of `http1.BODY_WINDOW_S` for the body's progress."""
        body = self.body
        left = body.left if body is not None and not body.chunked else None
        self.window_need = http1.BODY_MIN_BYTES if left is None else min(http1.BODY_MIN_BYTES, left)
        self.window_got = 0
        self.deadline = now + http1.BODY_WINDOW_S

    def expire(self, now: float) -> None:
        """The deadline passed: a body that kept up gets another window; a head, or a body that
        did not, closes the connection."""
        if self.phase == _BODY and (
            self.window_got >= self.window_need or not self.transport.is_reading()
        ):
            # Kept up, or aiohttp's server stopped reading (its buffer is full): not the client.
            self._window(now)
            return
        self.deadline = math.inf
        self.transport.close()

    def _refuse(self, error: http1.HttpError) -> None:
        self.phase, self.deadline = _DONE, math.inf
        self.buffer.clear()
        if self.body is not None:
            self.transport.close()  # a malformed chunk: aiohttp's server is mid-body
            return
        # A line aiohttp's server refuses with a 400 (its method is no token), after it answered
        # the requests before it; the words are the router's.
        self.handler.data_received(f"(refused by the router: {error.message})\r\n\r\n".encode())
