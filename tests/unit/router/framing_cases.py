"""Framing cases for the router's HTTP/1.1 reader: valid requests and the malicious kinds that
request smuggling and desync attacks use (CL/TE conflicts, duplicate lengths, obs-fold, chunk
extensions and sizes, bare CR and LF, NUL and other control characters, Host, oversized heads,
pipelining). Many carry a request for a pod's admin path (`/v1/load_lora_adapter`, `/metrics`,
`/v1/adapters`) where a reader that frames wrongly would find a second request.

`stricter_than` names the reference parsers (`llhttp`, `h11`) that read more of a case than the
router does, where the router refuses on purpose; `why` says on what grounds. `closes_sooner`
names those that stop reading a connection earlier by a rule of their own. Anywhere else the
router must read exactly what both read (tests/unit/router/test_http1_differential.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    id: str
    data: bytes
    stricter_than: frozenset[str] = frozenset()
    why: str = ""
    # References that close the connection sooner by a rule of their own (h11 keeps no HTTP/1.0
    # connection alive): the router reads what they read, and more.
    closes_sooner: frozenset[str] = frozenset()


LLHTTP, H11, BOTH = frozenset({"llhttp"}), frozenset({"h11"}), frozenset({"llhttp", "h11"})

GEN = b"POST /v1/images/generations HTTP/1.1\r\nHost: router\r\n"
BODY = b'{"model": "pixel-art", "prompt": "a lighthouse"}'
CL = b"Content-Length: %d\r\n" % len(BODY)
TE = b"Transfer-Encoding: chunked\r\n"
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
LOAD = (
    b"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: pod\r\nContent-Length: 41\r\n\r\n"
    b'{"lora_name": "x", "lora_path": "/etc/x"}'
)
METRICS = b"GET /metrics HTTP/1.1\r\nHost: pod\r\n\r\n"
ADAPTERS = b"GET /v1/adapters?smuggled=1 HTTP/1.1\r\nHost: pod\r\n\r\n"
CLOSE = b"Connection: close\r\n"


def gen(*headers: bytes, body: bytes = BODY, length: bool = True) -> bytes:
    """A generation with `headers` after Host (and its Content-Length unless told not to)."""
    return GEN + b"".join(headers) + (CL if length and body == BODY else b"") + b"\r\n" + body


def chunked(*chunks: bytes, tail: bytes = b"0\r\n\r\n", head: bytes = TE) -> bytes:
    return GEN + head + b"\r\n" + b"".join(chunks) + tail


def get(target: bytes = b"/health", *headers: bytes, version: bytes = b"HTTP/1.1") -> bytes:
    return b"GET " + target + b" " + version + b"\r\nHost: router\r\n" + b"".join(headers) + b"\r\n"


BARE_LF = "RFC 9112 2.2 lets a recipient take a bare LF as a line end; the router refuses it"
LEADING = "RFC 9112 2.2: a server SHOULD ignore an empty line before a request; the router refuses"
OBS_FOLD = "RFC 9112 5.2 lets a server unfold obs-fold; the router refuses it (400), as it may"
HOST = "RFC 9112 3.2: 400 for an HTTP/1.1 request without exactly one valid Host"
LIMIT = "the router's limits (http1.MAX_LINE_BYTES, MAX_HEAD_BYTES, MAX_HEADERS)"
CODING = "RFC 9112 6.1: a transfer coding other than chunked alone is not served (501)"
CONFLICT = "RFC 9112 6.3: Transfer-Encoding with Content-Length ought to be an error; it is"
DUP_LENGTH = "RFC 9110 8.6: a list of equal lengths may be taken as one; the router refuses it"
CHUNK_WS = "RFC 9112 7.1.1 has no whitespace after a chunk size (BWS only around ';')"
CTL = "RFC 9110 5.5: control characters are not field content"
METHOD = "methods the router serves none of (RFC 9110 9.1: 501)"
VERSION = "only HTTP/1.0 and HTTP/1.1 (505); llhttp reads a line without a version as HTTP/0.9"
ONE_SP = "RFC 9112 3: one SP between the request line's parts"

CASES = [
    # Valid requests: every reader frames them the same.
    Case("generation", gen()),
    Case("generation-no-body", gen(body=b"", length=False) + b""),
    Case("generation-length-0", GEN + b"Content-Length: 0\r\n\r\n"),
    Case("get", get()),
    Case("head", b"HEAD /health HTTP/1.1\r\nHost: router\r\n\r\n"),
    Case("delete", b"DELETE /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"),
    Case("options-asterisk", b"OPTIONS * HTTP/1.1\r\nHost: router\r\n\r\n"),
    Case("absolute-form", get(b"http://router/v1/models")),
    Case("query", gen().replace(b"generations ", b"generations?a=%20b&c=%0d%0a ")),
    Case("fragment", get(b"/health#x")),
    Case("http-1.0", b"POST /v1/images/generations HTTP/1.0\r\n" + CL + b"\r\n" + BODY),
    Case("http-1.0-host", get(version=b"HTTP/1.0")),
    Case(
        "http-1.0-keep-alive",
        get(b"/health", b"Connection: keep-alive\r\n", version=b"HTTP/1.0") * 2,
        closes_sooner=H11,
    ),
    Case("http-1.0-then-ignored", get(version=b"HTTP/1.0") + LOAD),
    Case("pipelined", gen() + gen() + gen(CLOSE)),
    Case("pipelined-mixed", gen() + get() + METRICS + gen()),
    Case("pipelined-admin", gen() + LOAD + ADAPTERS),
    Case("close-then-ignored", gen(CLOSE) + LOAD),
    Case("keep-alive-header", gen(b"Connection: keep-alive\r\n")),
    Case("connection-named", gen(b"Connection: X-Secret, keep-alive\r\n", b"X-Secret: 1\r\n")),
    Case("get-with-body", get(b"/health", b"Content-Length: 4\r\n") + b"abcd"),
    Case("expect", gen(b"Expect: 100-continue\r\n")),
    Case(
        "upgrade-h2c",
        get(b"/health", b"Connection: Upgrade, HTTP2-Settings\r\n", b"Upgrade: h2c\r\n"),
        closes_sooner=LLHTTP,
    ),
    Case(
        "upgrade-then-request",
        get(b"/health", b"Connection: Upgrade\r\n", b"Upgrade: websocket\r\n") + METRICS,
        closes_sooner=LLHTTP,
    ),
    Case("chunked", chunked(b"%x\r\n%s\r\n" % (len(BODY), BODY))),
    Case(
        "chunked-pieces",
        chunked(b"5\r\n" + BODY[:5] + b"\r\n", b"%x\r\n%s\r\n" % (len(BODY) - 5, BODY[5:])),
    ),
    Case("chunked-upper-hex", chunked(b"1A\r\n" + b"x" * 26 + b"\r\n")),
    Case("chunked-leading-zeros", chunked(b"0005\r\nhello\r\n")),
    Case("chunked-extension", chunked(b"5;name=value\r\nhello\r\n")),
    Case("chunked-extension-no-value", chunked(b"5;a;b\r\nhello\r\n")),
    Case("chunked-extension-quoted", chunked(b'5;a="b c;d"\r\nhello\r\n')),
    Case("chunked-trailers", chunked(b"5\r\nhello\r\n", tail=b"0\r\nX-Sum: 1\r\nX-B: 2\r\n\r\n")),
    Case("chunked-coding-case", chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding: Chunked\r\n")),
    Case(
        "chunked-coding-ows", chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding:  chunked \r\n")
    ),
    Case("chunked-then-admin", chunked(b"5\r\nhello\r\n") + LOAD),
    Case("ows", gen(b"X-A:   spaced \t \r\n")),
    Case("empty-value", gen(b"X-Empty:\r\n")),
    Case("obs-text", gen(b"X-Name: caf\xc3\xa9 \xff\r\n")),
    Case("host-port", get().replace(b"Host: router", b"Host: router:8000")),
    Case("host-ipv6", get().replace(b"Host: router", b"Host: [::1]:8000")),
    Case("host-empty", get().replace(b"Host: router", b"Host:")),
    Case("length-leading-zeros", GEN + b"Content-Length: 002\r\n\r\n{}"),
    Case("length-ows", GEN + b"Content-Length:  2 \r\n\r\n{}"),
    Case("body-with-nul", GEN + b"Content-Length: 3\r\n\r\na\x00b"),
    Case("body-is-a-request", GEN + b"Content-Length: %d\r\n\r\n" % len(LOAD) + LOAD),
    Case("many-headers", GEN + b"".join(b"X-%d: v\r\n" % i for i in range(98)) + b"\r\n"),
    Case("long-line", GEN + b"X-Long: " + b"a" * 8000 + b"\r\n\r\n"),
    Case("incomplete-head", GEN + b"X-A: b\r\n"),
    Case("incomplete-body", GEN + CL + b"\r\n" + BODY[:10]),
    Case("incomplete-chunk", chunked(b"10\r\nhello", tail=b"")),
    Case("incomplete-trailers", chunked(b"5\r\nhello\r\n", tail=b"0\r\nX-A: 1\r\n")),
    # Content-Length and Transfer-Encoding together, or odd transfer codings.
    Case("te-and-cl", GEN + TE + CL + b"\r\n" + CHUNKED, H11, CONFLICT),
    Case("cl-and-te", GEN + CL + TE + b"\r\n" + CHUNKED, H11, CONFLICT),
    Case(
        "te-and-cl-0-smuggle",
        GEN + b"Content-Length: 0\r\n" + TE + b"\r\n5\r\nhello\r\n0\r\n\r\n" + LOAD,
        H11,
        CONFLICT,
    ),
    Case(
        "cl-shorter-than-chunks",
        GEN + b"Content-Length: 3\r\n" + TE + b"\r\n0\r\n\r\n" + METRICS,
        H11,
        CONFLICT,
    ),
    Case(
        "te-gzip-chunked",
        chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding: gzip, chunked\r\n"),
        LLHTTP,
        CODING,
    ),
    Case(
        "te-chunked-chunked",
        chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding: chunked, chunked\r\n"),
    ),
    Case("te-two-lines", chunked(b"5\r\nhello\r\n", head=TE + TE)),
    Case("te-identity", GEN + b"Transfer-Encoding: identity\r\n" + CL + b"\r\n" + BODY),
    Case(
        "te-chunked-identity",
        chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding: chunked, identity\r\n"),
    ),
    Case("te-xchunked", chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding: xchunked\r\n")),
    Case("te-chunked-vtab", chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding: chunked\x0b\r\n")),
    Case("te-chunked-nul", chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding: chunked\x00\r\n")),
    Case(
        "te-obs-fold",
        chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding:\r\n chunked\r\n") + LOAD,
        H11,
        OBS_FOLD,
    ),
    Case(
        "te-space-before-colon",
        chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding : chunked\r\n") + LOAD,
    ),
    Case("te-tab-in-name", chunked(b"5\r\nhello\r\n", head=b"Transfer-Encoding\t: chunked\r\n")),
    Case("te-underscore", chunked(b"5\r\nhello\r\n", head=b"Transfer_Encoding: chunked\r\n")),
    Case(
        "te-http-1.0",
        b"POST /v1/images/generations HTTP/1.0\r\n" + TE + b"\r\n5\r\nhello\r\n0\r\n\r\n",
        BOTH,
        "RFC 9112 6.1: Transfer-Encoding in HTTP/1.0 is a faulty framing (400)",
    ),
    Case("te-empty", GEN + b"Transfer-Encoding:\r\n\r\n"),
    # Content-Length given twice, or not a length.
    Case("cl-twice-equal", GEN + CL + CL + b"\r\n" + BODY, H11, DUP_LENGTH),
    Case("cl-twice-different", GEN + b"Content-Length: 2\r\nContent-Length: 5\r\n\r\n{}" + LOAD),
    Case("cl-list-equal", GEN + b"Content-Length: 2, 2\r\n\r\n{}", H11, DUP_LENGTH),
    Case("cl-list-different", GEN + b"Content-Length: 2, 5\r\n\r\n{}abc"),
    Case("cl-plus", GEN + b"Content-Length: +2\r\n\r\n{}"),
    Case("cl-minus", GEN + b"Content-Length: -1\r\n\r\n{}"),
    Case("cl-hex", GEN + b"Content-Length: 0x2\r\n\r\n{}"),
    Case("cl-decimal", GEN + b"Content-Length: 2.0\r\n\r\n{}"),
    Case("cl-space-inside", GEN + b"Content-Length: 1 1\r\n\r\n{}"),
    Case("cl-underscore", GEN + b"Content-Length: 1_0\r\n\r\n{}"),
    Case("cl-empty", GEN + b"Content-Length:\r\n\r\n{}"),
    Case("cl-unicode-digit", GEN + "Content-Length: \u0662\r\n\r\n{}".encode()),
    Case(
        "cl-huge",
        GEN + b"Content-Length: 99999999999999999999\r\n\r\n{}",
        H11,
        "a length of 20 digits (over 18) is refused, not waited for",
    ),
    Case("cl-obs-fold", GEN + b"Content-Length:\r\n 2\r\n\r\n{}" + LOAD, H11, OBS_FOLD),
    Case("cl-name-case", GEN + b"content-LENGTH: 2\r\n\r\n{}" + METRICS),
    # Chunk sizes and extensions.
    Case("chunk-size-space", chunked(b"5 \r\nhello\r\n"), H11, CHUNK_WS),
    Case("chunk-size-tab", chunked(b"5\t\r\nhello\r\n"), H11, CHUNK_WS),
    Case("chunk-ext-space", chunked(b"5 ;a=b\r\nhello\r\n")),
    Case("chunk-size-0x", chunked(b"0x5\r\nhello\r\n")),
    Case("chunk-size-minus", chunked(b"-5\r\nhello\r\n")),
    Case("chunk-size-empty", chunked(b"\r\nhello\r\n")),
    Case(
        "chunk-size-17-digits",
        chunked(b"1" * 17 + b"\r\nhello\r\n"),
        H11,
        "a chunk size over 16 hex digits",
    ),
    Case("chunk-size-not-hex", chunked(b"5g\r\nhello\r\n")),
    Case("chunk-ext-bare-lf", chunked(b"5;a=b\nc\r\nhello\r\n")),
    Case("chunk-ext-ctl", chunked(b"5;a=\x01\r\nhello\r\n"), H11, CTL),
    Case(
        "chunk-ext-long",
        chunked(b"5;a=" + b"b" * 5000 + b"\r\nhello\r\n"),
        BOTH,
        "a chunk line over http1.MAX_CHUNK_LINE_BYTES",
    ),
    Case("chunk-data-longer", chunked(b"3\r\nhello\r\n") + LOAD),
    Case("chunk-data-shorter", chunked(b"7\r\nhello\r\n") + LOAD),
    Case("chunk-data-no-crlf", chunked(b"5\r\nhelloXX0\r\n\r\n")),
    Case("chunk-bare-lf-size", chunked(b"5\nhello\r\n")),
    Case("chunk-bare-lf-data-end", chunked(b"5\r\nhello\n")),
    Case("chunk-bare-lf-last", chunked(b"5\r\nhello\r\n", tail=b"0\n\n") + METRICS),
    Case("chunk-bare-cr", chunked(b"5\rhello\r\n")),
    Case(
        "trailer-obs-fold",
        chunked(b"5\r\nhello\r\n", tail=b"0\r\nX-A: 1\r\n b\r\n\r\n"),
        H11,
        OBS_FOLD,
    ),
    Case("trailer-bad-name", chunked(b"5\r\nhello\r\n", tail=b"0\r\nX A: 1\r\n\r\n")),
    Case(
        "trailer-no-colon", chunked(b"5\r\nhello\r\n", tail=b"0\r\nGET /metrics HTTP/1.1\r\n\r\n")
    ),
    # Line ends: bare LF, bare CR.
    Case(
        "bare-lf",
        b"POST /v1/images/generations HTTP/1.1\nHost: router\n"
        + CL.replace(b"\r", b"")
        + b"\n"
        + BODY,
        H11,
        BARE_LF,
    ),
    Case("bare-lf-get", b"GET /metrics HTTP/1.1\nHost: pod\n\n", H11, BARE_LF),
    Case(
        "bare-lf-after-request-line", get().replace(b"HTTP/1.1\r\n", b"HTTP/1.1\n", 1), H11, BARE_LF
    ),
    Case("bare-lf-in-header", gen(b"X-A: a\nContent-Length: 0\r\n")),
    Case("bare-lf-blank-line", GEN + CL + b"\n" + BODY, H11, BARE_LF),
    Case("bare-cr-in-value", gen(b"X-A: a\rb\r\n")),
    Case("bare-cr-request-line", b"GET /health HTTP/1.1\rHost: router\r\n\r\n"),
    Case("cr-cr-lf", gen(b"X-A: a\r\r\n")),
    Case("leading-crlf", b"\r\n" + get(), LLHTTP, LEADING),
    Case("leading-lf", b"\n" + get(), LLHTTP, LEADING),
    Case("crlf-between", gen() + b"\r\n" + gen(), LLHTTP, LEADING),
    # NUL and other control characters.
    Case("nul-target", get(b"/health\x00/metrics")),
    Case("nul-value", gen(b"X-A: a\x00b\r\n")),
    Case("nul-name", gen(b"X-\x00A: b\r\n")),
    Case("nul-method", b"PO\x00ST /v1/images/generations HTTP/1.1\r\nHost: router\r\n\r\n"),
    Case("ctl-value", gen(b"X-A: a\x01b\r\n"), H11, CTL),
    Case("del-value", gen(b"X-A: a\x7fb\r\n"), H11, CTL),
    Case("vtab-value", gen(b"X-A: a\x0bb\r\n")),
    Case("tab-target", get(b"/health\t/metrics")),
    Case("space-target", get(b"/health /metrics")),
    Case("ctl-target", get(b"/health\x01")),
    Case("del-target", get(b"/health\x7f")),
    Case("non-ascii-target", get(b"/h\xc3\xa9alth")),
    Case("tab-separators", b"GET\t/health\tHTTP/1.1\r\nHost: router\r\n\r\n"),
    Case("two-spaces", b"GET  /health HTTP/1.1\r\nHost: router\r\n\r\n", LLHTTP, ONE_SP),
    Case("leading-space", b" GET /health HTTP/1.1\r\nHost: router\r\n\r\n"),
    Case("trailing-space-version", b"GET /health HTTP/1.1 \r\nHost: router\r\n\r\n"),
    # Field lines.
    Case("obs-fold", gen(b"X-A: a\r\n b\r\n"), H11, OBS_FOLD),
    Case("obs-fold-first", GEN.replace(b"\r\nHost", b"\r\n Host") + b"\r\n"),
    Case("space-before-colon", gen(b"X-A : b\r\n")),
    Case("no-colon", gen(b"X-A b\r\n")),
    Case("empty-name", gen(b": b\r\n")),
    Case("name-not-token", gen(b"X@A: b\r\n")),
    Case("name-non-ascii", gen(b"X-\xc3\xa9: b\r\n")),
    Case(
        "header-smuggles-request",
        gen(b"X-A: b\r\n\r\nGET /metrics HTTP/1.1\r\n", length=False),
        LLHTTP,
        HOST,
    ),
    # Host.
    Case("no-host", b"GET /metrics HTTP/1.1\r\n\r\n", LLHTTP, HOST),
    Case(
        "no-host-generation",
        b"POST /v1/images/generations HTTP/1.1\r\n" + CL + b"\r\n" + BODY,
        LLHTTP,
        HOST,
    ),
    Case("two-hosts", gen(b"Host: pod\r\n"), LLHTTP, HOST),
    Case("host-space", get().replace(b"Host: router", b"Host: rou ter"), BOTH, HOST),
    Case("host-userinfo", get().replace(b"Host: router", b"Host: user@pod"), BOTH, HOST),
    Case("host-path", get().replace(b"Host: router", b"Host: pod/metrics"), BOTH, HOST),
    Case("host-bad-port", get().replace(b"Host: router", b"Host: router:http"), BOTH, HOST),
    # Oversized heads.
    Case("long-request-line", get(b"/" + b"a" * 8200), BOTH, LIMIT),
    Case("long-field-line", gen(b"X-Long: " + b"a" * 8200 + b"\r\n"), BOTH, LIMIT),
    Case("too-many-headers", gen(*(b"X-%d: v\r\n" % i for i in range(101))), BOTH, LIMIT),
    Case(
        "head-over-16k", gen(*(b"X-%d: %s\r\n" % (i, b"v" * 200) for i in range(90))), BOTH, LIMIT
    ),
    Case(
        "endless-head",
        GEN + b"X-A: " + b"a" * 8000 + b"\r\n" + b"X-B: " + b"b" * 8000 + b"\r\n" + b"X-C: c" * 200,
        LLHTTP,
        LIMIT,
    ),
    # Methods and versions.
    Case("method-lower-case", gen().replace(b"POST", b"post", 1), H11, METHOD),
    Case("method-unknown", gen().replace(b"POST", b"BREW", 1), H11, METHOD),
    Case("method-trace", get().replace(b"GET", b"TRACE", 1), BOTH, METHOD),
    Case("method-connect", b"CONNECT pod:8000 HTTP/1.1\r\nHost: pod:8000\r\n\r\n", BOTH, METHOD),
    Case("version-1.2", get(version=b"HTTP/1.2"), H11, VERSION),
    Case("version-2.0", get(version=b"HTTP/2.0"), BOTH, VERSION),
    Case("version-0.9", get(version=b"HTTP/0.9"), BOTH, VERSION),
    Case("version-lower-case", get(version=b"http/1.1")),
    Case("version-1.10", get(version=b"HTTP/1.10")),
    Case("version-missing", b"GET /health\r\nHost: router\r\n\r\n", LLHTTP, VERSION),
    Case("not-http", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40),
]
