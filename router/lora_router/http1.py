"""HTTP/1.1 on the wire (RFC 9110, RFC 9112) for both sides of the router, without I/O: where a
request's head ends (`head_end`) and what it says (`parse_request`), an answer's head
(`parse_response`), a body as its framing delimits it (`Body`), the headers a proxy passes on
(`forwarded_headers`), and the bytes of a request to a pod and of a refusal (`encode_request`,
`refusal`). The router's server (`server`, and `handover` in front of aiohttp's server) and its
pool to the pods (`upstream`) frame every message with it; nothing else in the router parses
HTTP/1.1. tests/unit/router/test_http1_differential.py holds it to llhttp and h11.

A request is refused (`HttpError`, with its status) rather than read leniently:
- 400: a line that ends in a bare LF or holds a bare CR; a control character (NUL, tab in the
  target, ...) or a space where the grammar has none; obs-fold; a field name that is not a token
  or has a space before its colon; an HTTP/1.1 request without exactly one Host, or a Host that
  is not `host[:port]`; a Content-Length that is not digits, or given twice (even equal);
  Transfer-Encoding in HTTP/1.0, or with a Content-Length; an empty line before the request line;
  a chunk size line with whitespace or more than 16 hex digits; chunk data not ended by CRLF.
- 501: a method other than GET, HEAD, POST, PUT, DELETE, OPTIONS and PATCH, as written (no
  CONNECT, TRACE or WebDAV: the router serves none); a transfer coding other than `chunked`
  alone (`gzip, chunked` too).
- 505: an HTTP version other than 1.0 and 1.1. 414: a request line over `MAX_LINE_BYTES`.
- 431: a field line over `MAX_LINE_BYTES`, a head over `MAX_HEAD_BYTES`, more than
  `MAX_HEADERS` fields, trailers over `MAX_HEAD_BYTES`.
Field values may hold obs-text (bytes 0x80-0xFF), as llhttp and aiohttp allow. Strings are the
bytes decoded as UTF-8 with surrogateescape (aiohttp's choice), so encoding them the same way
gives the bytes back.

Must not: do I/O, or know which paths the router serves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import NamedTuple

# Limits of a request from a client.
MAX_LINE_BYTES = 8190  # the request line and each field line (aiohttp's own limit)
MAX_HEAD_BYTES = 16 * 1024  # a whole head; trailers too
MAX_HEADERS = 100
MAX_CHUNK_LINE_BYTES = 4096  # a chunk's size line, extensions included
# An answer's head from a pod.
MAX_ANSWER_HEAD_BYTES = 64 * 1024
MAX_ANSWER_HEADERS = 256
# Slow clients: a head must be whole within HEAD_TIMEOUT_S of its first byte (a connection's
# first head, of the connection's opening); a body must bring BODY_MIN_BYTES (or the rest of
# it, when less is left) in every BODY_WINDOW_S.
HEAD_TIMEOUT_S = 10.0
BODY_WINDOW_S = 10.0
BODY_MIN_BYTES = 16 * 1024

_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_TOKEN_RE = re.compile(_TOKEN)
_FIELD = re.compile(rf"{_TOKEN}:".encode())
_TOKEN_CHARS = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Every byte but the control characters (HT, CR and LF are not: they are counted apart).
_NOT_CONTROL = bytes(b for b in range(256) if 0x20 <= b != 0x7F or b in (0x09, 0x0A, 0x0D))
_REQUEST_LINE = re.compile(rf"({_TOKEN}) ([\x21-\x7e]+) HTTP/1\.([01])")
_VERSION = re.compile(r".* HTTP/[0-9]\.[0-9]")
_STATUS_LINE = re.compile(r"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: (.*))?")
# uri-host [ ":" port ] (RFC 3986: an IP literal, or a reg-name of unreserved, pct-encoded and
# sub-delims characters; an IPv4 address is a reg-name too).
_HOST = re.compile(
    r"(?:\[[0-9A-Za-z:.\-_~!$&'()*+,;=%]+\]|[0-9A-Za-z\-._~!$&'()*+,;=%]*)(?::[0-9]*)?"
)
_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_TOKEN_B = _TOKEN.encode()
_CHUNK_LINE = re.compile(
    rb"([0-9A-Fa-f]{1,16})(?:;" + _TOKEN_B + rb"(?:=(?:" + _TOKEN_B + rb"|" + _QUOTED + rb"))?)*"
)
# Fields that frame a message, or that a server acts on before the application does.
_FRAMING = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "expect",
        "upgrade",
        "content-encoding",
    }
)
# Hop-by-hop fields (RFC 9110 7.6.1), and those the writer of each hop sets itself.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_ANSWER_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})


class HttpError(Exception):
    """A message that is not HTTP/1.1 as the router reads it: `status` is the answer a client
    gets for it (400, 408, 414, 431, 501, 505)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Request(NamedTuple):
    """A request's head."""

    method: str
    target: str  # as sent: the path and the query
    path: str  # the target before its query
    minor: int  # HTTP/1.minor
    headers: list[tuple[str, str]]  # as sent, values without their surrounding whitespace
    length: int | None  # Content-Length; None when none was given or the body is chunked
    chunked: bool
    keep_alive: bool
    expect: bool  # an Expect field (aiohttp's server answers 100 Continue)
    upgrade: bool  # asks to switch protocols (the router never does)
    encoded: bool  # a Content-Encoding field


class Response(NamedTuple):
    """An answer's head; `length` 0 for answers without a body, None for chunked or until the
    connection ends (then `keep_alive` is False)."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    length: int | None
    chunked: bool
    keep_alive: bool


def head_end(buffer: bytes | bytearray, limit: int = MAX_HEAD_BYTES) -> int:
    """Where the head at the start of `buffer` ends: the index past its blank line (the head is
    `buffer[:end - 4]`), or -1 while it is incomplete. Raises HttpError as soon as it can never
    be one: a bare LF (a client that sends one never sends CRLF CRLF), longer than `limit`."""
    end = buffer.find(b"\r\n\r\n")
    if end >= 0:
        return end + 4
    if len(buffer) > limit + 3:
        raise HttpError(431, f"the head is longer than {limit} bytes")
    if buffer.count(b"\n") != buffer.count(b"\r\n"):
        raise HttpError(400, "a line of the head ends with a bare LF, not CRLF")
    if buffer.translate(None, _NOT_CONTROL):
        raise HttpError(400, "the head holds a control character")
    return -1


def _head(
    head: bytes, limit: int, most: int, wanted: frozenset[str]
) -> tuple[str, list[tuple[str, str]], dict[str, list[str]]]:
    """A head's start line, its fields as sent (the whitespace around each value removed), and
    the values of those whose lower-cased name is in `wanted`. HttpError for a head over
    `limit` bytes or `most` fields, a bare CR or LF, a control character, a field line over
    `MAX_LINE_BYTES` or not a token, a colon and a value (obs-fold among them)."""
    if len(head) > limit:
        raise HttpError(431, f"the head is longer than {limit} bytes")
    if head.translate(None, _NOT_CONTROL):
        raise HttpError(400, "the head holds a control character")
    text = head.decode("utf-8", "surrogateescape")
    lines = text.split("\r\n")
    breaks = len(lines) - 1
    if text.count("\n") != breaks:
        raise HttpError(400, "a line of the head ends with a bare LF, not CRLF")
    if text.count("\r") != breaks:
        raise HttpError(400, "the head holds a CR that does not end a line")
    if breaks > most:
        raise HttpError(431, f"more than {most} header fields")
    it = iter(lines)
    start = next(it)
    if len(head) > MAX_LINE_BYTES and max(map(len, lines)) > MAX_LINE_BYTES:
        if len(start) > MAX_LINE_BYTES:
            raise HttpError(414, f"the start line is longer than {MAX_LINE_BYTES} bytes")
        raise HttpError(431, f"a field line is longer than {MAX_LINE_BYTES} bytes")
    fields: list[tuple[str, str]] = []
    found: dict[str, list[str]] = {}
    for line in it:
        name, colon, value = line.partition(":")
        if not colon or not name:
            raise _malformed(line)
        value = value.strip(" \t")
        fields.append((name, value))
        lower = name.lower()
        if lower in wanted:
            found.setdefault(lower, []).append(value)
    names = "".join([name for name, _ in fields])
    if not names.isascii() or names.encode().translate(None, _TOKEN_CHARS):
        raise _malformed(next(f"{k}:" for k, _ in fields if _TOKEN_RE.fullmatch(k) is None))
    return start, fields, found


def _malformed(line: str) -> HttpError:
    if line[:1] in (" ", "\t"):
        return HttpError(400, "obsolete line folding (a field line starting with whitespace)")
    return HttpError(400, f"a malformed field line: {line[:80]!r}")


def _tokens(values: list[str]) -> set[str]:
    """The comma-separated tokens of a list field's values, lower-cased."""
    return {t.strip(" \t").lower() for v in values for t in v.split(",")} - {""}


def parse_request(head: bytes) -> Request:
    """The request whose head is `head` (the bytes before its blank line); HttpError when it is
    not one the router reads (the module's list) (pure)."""
    line, headers, found = _head(head, MAX_HEAD_BYTES, MAX_HEADERS, _FRAMING)
    match = _REQUEST_LINE.fullmatch(line)
    if match is None:
        if _VERSION.fullmatch(line) and " " in line and not line.endswith(("1.0", "1.1")):
            raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are served")
        raise HttpError(400, f"a malformed request line: {line[:80]!r}")
    method, target, version = match.groups()
    if method not in METHODS:
        raise HttpError(501, f"the method {method[:20]!r} is not served")
    minor = 1 if version == "1" else 0
    hosts = found.get("host", [])
    if len(hosts) > 1:
        raise HttpError(400, "Host is given more than once")
    if not hosts and minor == 1:
        raise HttpError(400, "an HTTP/1.1 request without Host")
    if hosts and _HOST.fullmatch(hosts[0]) is None:
        raise HttpError(400, f"Host is not host[:port]: {hosts[0][:80]!r}")
    length = None
    lengths = found.get("content-length")
    if lengths is not None:
        if len(lengths) > 1:
            raise HttpError(400, "Content-Length is given twice")
        value = lengths[0]
        if not value.isdigit() or not value.isascii() or len(value) > 18:
            raise HttpError(400, f"Content-Length is not a length: {value[:40]!r}")
        length = int(value)
    connection = _tokens(found["connection"]) if "connection" in found else set()
    close = "close" in connection
    codings = found.get("transfer-encoding")
    chunked = codings is not None
    if codings is not None:
        if minor == 0:
            raise HttpError(400, "Transfer-Encoding in an HTTP/1.0 request")
        if [t.strip(" \t").lower() for v in codings for t in v.split(",")] != ["chunked"]:
            raise HttpError(501, "the only transfer coding served is chunked, alone")
        if length is not None:
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
    return Request(
        method,
        target,
        target.partition("?")[0],
        minor,
        headers,
        length,
        chunked,
        not close if minor else "keep-alive" in connection and not close,
        "expect" in found,
        "upgrade" in found or "upgrade" in connection,
        "content-encoding" in found,
    )


def parse_response(head: bytes, method: str) -> Response | None:
    """The answer whose head is `head`, to a request of `method`; None for an interim (1xx)
    answer, whose real answer follows. HttpError when it is not one the router passes on: as a
    request's (bare CR or LF, control characters, obs-fold, two Content-Lengths), and a
    Content-Length beside a Transfer-Encoding, or a 101 the router never asked for (pure)."""
    line, headers, found = _head(head, MAX_ANSWER_HEAD_BYTES, MAX_ANSWER_HEADERS, _ANSWER_FRAMING)
    match = _STATUS_LINE.fullmatch(line)
    if match is None:
        raise HttpError(502, f"not an HTTP/1.x status line: {line[:80]!r}")
    version, code, reason = match.groups()
    status = int(code)
    if status == 101:
        raise HttpError(502, "the pod switched protocols, which the router never asks for")
    if status < 200:
        return None
    length = None
    lengths = found.get("content-length")
    if lengths is not None:
        value = lengths[0]
        if len(lengths) > 1 or not value.isdigit() or not value.isascii():
            raise HttpError(502, f"the Content-Length is not one length: {lengths!r}")
        length = int(value)
    connection = _tokens(found["connection"]) if "connection" in found else set()
    close = "close" in connection or (version == "0" and "keep-alive" not in connection)
    codings = found.get("transfer-encoding")
    chunked = False
    if codings is not None:
        if length is not None:
            raise HttpError(502, "both Transfer-Encoding and Content-Length")
        chunked = codings[-1].rpartition(",")[2].strip(" \t").lower() == "chunked"
        length = None  # chunked, or (another coding last) until the connection ends
    if method == "HEAD" or status in (204, 304):
        length, chunked = 0, False
    return Response(
        status, reason or "", headers, length, chunked,
        not close and (chunked or length is not None),
    )  # fmt: skip


# A chunked body's parts, in the order they come.
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class Body:
    """One message's body, taken from the front of its connection's buffer as its framing
    delimits it: `length` bytes, chunked (de-chunked; trailers checked and dropped), or, with
    neither (an answer), everything until the connection ends. `done` once it was all taken."""

    __slots__ = ("_state", "_trailers", "chunked", "done", "left")

    def __init__(self, length: int | None, chunked: bool) -> None:
        self.chunked = chunked
        # What is still to come: of the body, or of the current chunk when chunked; None: until
        # the connection ends.
        self.left = 0 if chunked else length
        self.done = not chunked and length == 0
        self._state = _SIZE
        self._trailers = 0

    def take(self, buffer: bytearray) -> bytes:
        """The body's bytes at the front of `buffer`, removed from it (b"" when none are there
        yet); HttpError (400) when a chunk is malformed."""
        if not self.chunked:
            left = self.left
            n = len(buffer) if left is None else min(left, len(buffer))
            data = bytes(buffer[:n])
            del buffer[:n]
            if left is not None:
                self.left = left - n
                self.done = self.left == 0
            return data
        pieces = []
        while not self.done and buffer:
            state = self._state
            if state == _DATA:
                left = self.left or 0
                n = min(left, len(buffer))
                pieces.append(bytes(buffer[:n]))
                del buffer[:n]
                self.left = left - n
                if self.left:
                    break
                self._state = _DATA_END
            elif state == _DATA_END:
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise HttpError(400, "chunk data longer than its size, or not ended by CRLF")
                del buffer[:2]
                self._state = _SIZE
            else:
                line = self._line(buffer, MAX_CHUNK_LINE_BYTES)
                if line is None:
                    break
                if state == _SIZE:
                    match = _CHUNK_LINE.fullmatch(line)
                    if match is None:
                        raise HttpError(400, f"a malformed chunk size line: {line[:40]!r}")
                    self.left = int(match.group(1), 16)
                    self._state = _DATA if self.left else _TRAILER
                elif not line:
                    self.done = True
                else:
                    self._trailers += len(line) + 2
                    if self._trailers > MAX_HEAD_BYTES:
                        raise HttpError(431, f"trailers longer than {MAX_HEAD_BYTES} bytes")
                    if line.translate(None, _NOT_CONTROL) or _FIELD.match(line) is None:
                        raise HttpError(400, f"a malformed trailer: {line[:80]!r}")
        return b"".join(pieces)

    @staticmethod
    def _line(buffer: bytearray, limit: int) -> bytes | None:
        """The line at the front of `buffer`, removed with its CRLF; None while incomplete."""
        end = buffer.find(b"\r\n")
        if end < 0:
            if b"\n" in buffer:
                raise HttpError(400, "a chunk line ends with a bare LF, not CRLF")
            if len(buffer) > limit:
                raise HttpError(400, f"a chunk line is longer than {limit} bytes")
            return None
        if end > limit:
            raise HttpError(400, f"a chunk line is longer than {limit} bytes")
        line = bytes(buffer[:end])
        del buffer[: end + 2]
        if b"\n" in line or b"\r" in line:
            raise HttpError(400, "a chunk line holds a bare CR or LF")
        return line


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The (name, value) pairs a proxy passes on: not the hop-by-hop ones, nor those the
    Connection field names (RFC 9110 7.6.1) (pure)."""
    out: dict[str, str] = {}
    named: set[str] = set()
    for name, value in headers:
        lower = name.lower()
        if lower not in _HOP:
            out[name] = value
        elif lower == "connection":
            named |= _tokens([value])
    if named:
        named -= _HOP
        if named:
            out = {k: v for k, v in out.items() if k.lower() not in named}
    return out


def encode_request(
    method: str, target: str, host: str, headers: dict[str, str], body: bytes
) -> bytes:
    """A request to a pod as one buffer: `headers` after Host, then the body's Content-Length
    (always, but for a bodiless idempotent request). ValueError for a target or a field that
    would break the framing (pure)."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
    if body or method not in IDEMPOTENT:
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    breaks = len(lines) + 1
    if text.count("\n") != breaks or text.count("\r") != breaks or " " in target:
        raise ValueError("a request whose target or a field would break its framing")
    return text.encode("utf-8", "surrogateescape") + body


def refusal(status: int, message: str, date: str, server: str) -> bytes:
    """The answer to a request the router refuses before any application sees it, in the
    shape of aiohttp's server's refusals (plain text), closing the connection (pure)."""
    body = message.encode("utf-8", "backslashreplace")
    return (
        f"HTTP/1.1 {status} {reason(status)}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nDate: {date}\r\nServer: {server}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


def reason(status: int) -> str:
    """The status's reason phrase ("" for a code without one)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
