"""The shared origin server (tests/support/origin.py), alone: what each kind of route sends,
what it counts, and HTTPS with a certificate from a CA the client trusts."""

from __future__ import annotations

import http.client
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from lora_devcluster.certs import write_pki

from tests.support.origin import Origin


def get(
    url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_serves_what_it_was_given_and_counts_every_request(origin: Origin) -> None:
    url = origin.serve("/a.safetensors", b"weights")
    assert url == f"http://127.0.0.1:{origin.port}/a.safetensors" == origin.url("/a.safetensors")
    assert get(url) == (200, b"weights")
    assert get(url) == (200, b"weights")
    assert get(origin.url("/nothing"))[0] == 404
    assert origin.hits == {"/a.safetensors": 2, "/nothing": 1}


def test_a_route_is_any_handler(origin: Origin) -> None:
    from aiohttp import web

    async def teapot(request: web.Request) -> web.StreamResponse:
        return web.Response(status=418, text=request.path)

    origin.routes["/tea"] = teapot
    assert get(f"{origin.base}/tea") == (418, b"/tea")


def test_failing_first_then_serving(origin: Origin) -> None:
    url = origin.fail_first("/flaky", b"at last", failures=2, status=503)
    assert [get(url)[0] for _ in range(3)] == [503, 503, 200]
    assert get(url) == (200, b"at last")


def test_guarded_needs_exactly_the_authorization(origin: Origin) -> None:
    url = origin.serve_guarded("/private", b"secret", "Bearer right")
    assert get(url)[0] == 401
    assert get(url, {"Authorization": "Bearer wrong"})[0] == 401
    assert get(url, {"Authorization": "Bearer right"}) == (200, b"secret")


def test_truncated_announces_everything_and_sends_half(origin: Origin) -> None:
    origin.serve_truncated("/t", b"x" * 1000)
    conn = http.client.HTTPConnection("127.0.0.1", origin.port, timeout=10)
    conn.request("GET", "/t")
    resp = conn.getresponse()
    assert resp.getheader("Content-Length") == "1000"
    with pytest.raises(http.client.IncompleteRead) as e:
        resp.read()
    assert len(e.value.partial) == 500
    conn.close()


def test_slowly_spreads_the_body_over_the_time_given(origin: Origin) -> None:
    url = origin.serve_slowly("/slow", b"y" * 2000, seconds=0.5)
    start = time.monotonic()
    assert get(url) == (200, b"y" * 2000)
    assert time.monotonic() - start >= 0.4


def test_https_with_a_certificate_the_client_trusts(tmp_path: Path) -> None:
    pki = write_pki(tmp_path / "pki", ["127.0.0.1"], ["localhost"], "origin", "127.0.0.1")
    server = Origin(pki.server_cert, pki.server_key)
    try:
        url = server.serve("/w", b"over tls")
        assert url.startswith(f"https://127.0.0.1:{server.port}/")
        trusted = ssl.create_default_context(cafile=str(pki.ca_cert))
        assert get(url, context=trusted) == (200, b"over tls")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(url, context=ssl.create_default_context())
    finally:
        server.close()


def test_closed_it_refuses_connections() -> None:
    server = Origin()
    url = server.serve("/a", b"a")
    server.close()
    with pytest.raises(urllib.error.URLError):
        get(url)
