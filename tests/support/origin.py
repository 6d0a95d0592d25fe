"""A real HTTP(S) server the staging tests download from: the staging unit tests (plain HTTP on
127.0.0.1) and the operator on the local cluster (HTTPS with a certificate from a CA the operator
is told to trust) use the same one.

It runs its own event loop in a thread of the test process, so a synchronous cluster test can
serve while it waits, and an async unit test's client on its own loop reaches it the same way.
Handlers run on the server's thread.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Origin:
    """A server on 127.0.0.1 (or another loopback `host`, on `port`: 0 picks a free one): tests
    add routes (path -> handler, or one of the `serve*` kinds below, which return the URL) and
    read `hits` (path -> requests, unknown paths included: they answer 404) and `requests`
    (path -> the headers of each request). With `cert` and `key` it speaks HTTPS and records
    the name each client asked for in `server_names` (SNI). `close()` stops it."""

    def __init__(
        self,
        cert: Path | None = None,
        key: Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.host = host
        self.routes: dict[str, Handler] = {}
        self.hits: dict[str, int] = {}
        self.requests: dict[str, list[dict[str, str]]] = {}
        self.server_names: list[str | None] = []
        self._context: ssl.SSLContext | None = None
        if cert is not None and key is not None:
            self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._context.load_cert_chain(str(cert), str(key))
            self._context.sni_callback = self._sni
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        # Bound by the server itself (port 0), so no other process can take the port first.
        try:
            started = asyncio.run_coroutine_threadsafe(self._start(port), self._loop)
            self.port: int = started.result(10)
        except BaseException:
            self.close()
            raise

    @property
    def base(self) -> str:
        """The scheme, host and port, e.g. `https://127.0.0.1:40123`."""
        scheme = "https" if self._context is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base}{path}"

    def serve(self, path: str, data: bytes) -> str:
        async def handler(_: web.Request) -> web.StreamResponse:
            return web.Response(body=data, content_type="application/octet-stream")

        self.routes[path] = handler
        return self.url(path)

    def serve_truncated(self, path: str, data: bytes) -> str:
        """Announce the whole length, send half, drop the connection."""

        async def handler(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Length": str(len(data))})
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            assert request.transport is not None
            request.transport.close()
            return resp

        self.routes[path] = handler
        return self.url(path)

    def serve_slowly(self, path: str, data: bytes, seconds: float) -> str:
        """Send `data` in 20 pieces spread over `seconds`."""

        async def handler(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Length": str(len(data))})
            await resp.prepare(request)
            step = max(1, len(data) // 20)
            for i in range(0, len(data), step):
                await resp.write(data[i : i + step])
                await asyncio.sleep(seconds / 20)
            return resp

        self.routes[path] = handler
        return self.url(path)

    def serve_guarded(self, path: str, data: bytes, authorization: str) -> str:
        """401 unless the request carries exactly this Authorization header."""

        async def handler(request: web.Request) -> web.StreamResponse:
            if request.headers.get("Authorization") != authorization:
                return web.Response(status=401, text="who are you?")
            return web.Response(body=data, content_type="application/octet-stream")

        self.routes[path] = handler
        return self.url(path)

    def fail_first(self, path: str, data: bytes, failures: int, status: int = 500) -> str:
        """`status` for the first `failures` requests, then `data`."""
        count = [0]

        async def handler(_: web.Request) -> web.StreamResponse:
            count[0] += 1
            if count[0] <= failures:
                return web.Response(status=status, text="try again")
            return web.Response(body=data, content_type="application/octet-stream")

        self.routes[path] = handler
        return self.url(path)

    def redirect(self, path: str, location: str, status: int = 302) -> str:
        """Answer `status` with `location` (sent as it is) and a body that is never read."""

        async def handler(_: web.Request) -> web.StreamResponse:
            return web.Response(status=status, headers={"Location": location}, text="moved")

        self.routes[path] = handler
        return self.url(path)

    def _sni(self, _: ssl.SSLObject, name: str | None, __: ssl.SSLContext) -> None:
        self.server_names.append(name)

    def close(self) -> None:
        try:
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self._loop.close()

    def _app(self) -> web.Application:
        async def dispatch(request: web.Request) -> web.StreamResponse:
            self.hits[request.path] = self.hits.get(request.path, 0) + 1
            self.requests.setdefault(request.path, []).append(dict(request.headers))
            handler = self.routes.get(request.path)
            if handler is None:
                raise web.HTTPNotFound()
            return await handler(request)

        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", dispatch)
        return app

    async def _start(self, port: int) -> int:
        # A handler still sending when the test ends (serve_slowly) is not waited for long.
        self._runner = web.AppRunner(self._app(), shutdown_timeout=2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port, ssl_context=self._context)
        await site.start()
        return int(self._runner.addresses[0][1])


@pytest.fixture
def origin() -> Iterator[Origin]:
    """A plain-HTTP origin on 127.0.0.1 for one test (tests/conftest.py loads this module as a
    plugin). Staging tests build HttpsSource directly; parse_source's https-only rule is tested
    on its own."""
    server = Origin()
    try:
        yield server
    finally:
        server.close()
