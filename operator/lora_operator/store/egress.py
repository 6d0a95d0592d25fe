"""Every connection the operator opens to fetch an adapter source: one guarded HTTP client.

https://, hf:// (the Hub's plain HTTP endpoints) and s3:// (presigned requests) all go through
`get`, which for the first request and for every redirect it follows:

1. reads the URL one way (`sources.parse_url`), refusing one that URL parsers read differently;
2. refuses a redirect from https to http, and more than `MAX_REDIRECTS` redirects;
3. checks the host against `consent.Rules.hosts` (before any DNS lookup of a name not allowed);
4. resolves the name once (`resolve`, the only lookup) and checks every address it resolves to
   (`consent.connect_refusal`: the API server, metadata, loopback, private ... ranges);
5. connects to those checked addresses only, with TLS verified against the host name and the
   host name as SNI: a second resolution (DNS rebinding) never happens.

Authorization and cookies are dropped when a redirect leaves the origin. Messages name the
origin (scheme, host, port) of a URL, never its path or query (a signature may be in it), and
nothing of what a refused host would have answered: it is never asked.

Owns no decision (consent and sources decide); must not be bypassed: no fetcher opens a socket
to a source any other way.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin

import urllib3
from urllib3 import connection as u3_connection
from urllib3 import exceptions as u3

from lora_operator.rules import consent, errors
from lora_operator.store import sources

MAX_REDIRECTS = 10
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# Sent only to the origin they were meant for.
_ORIGIN_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
# getaddrinfo's "no such name" (NXDOMAIN, or a name with no address): permanent. Any other
# failure (EAI_AGAIN: the resolver did not answer) is temporary.
_NO_SUCH_NAME = frozenset(
    getattr(socket, name)
    for name in ("EAI_NONAME", "EAI_NODATA", "EAI_ADDRFAMILY")
    if hasattr(socket, name)
)


class DnsUnavailable(Exception):
    """The resolver failed for now (not a missing name): the fetch is retried, nothing is
    connected to."""


class NameNotFound(Exception):
    """The name does not exist in DNS (or has no address)."""


def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, in the resolver's order, each once: the one lookup a
    fetch makes per request (tests patch this function)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        if e.errno in _NO_SUCH_NAME:
            raise NameNotFound(host) from e
        raise DnsUnavailable(host) from e
    except UnicodeError as e:
        raise NameNotFound(host) from e
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _no_endpoint() -> tuple[str, int] | None:
    return None


@dataclass(frozen=True)
class Guard:
    """What `get` checks each request against: the rules, and where the API server is (its
    Service's address from KUBERNETES_SERVICE_HOST on every port, and the address the
    operator logged in to, `api_endpoint()`, on its port)."""

    rules: consent.Rules
    api_endpoint: Callable[[], tuple[str, int] | None] = field(default=_no_endpoint)

    def addresses(self, target: sources.Target, what: str) -> list[str]:
        """The checked addresses to connect to for `target`; raises consent.HostRefused
        (saying which value opens it) or DnsUnavailable."""
        literal = _literal(target.host)
        if literal is None:
            consent.check_host(target.host, self.rules, what)
            try:
                addresses = resolve(target.host, target.port)
            except NameNotFound:
                raise consent.HostRefused(
                    f"{what}: host {target.host} does not resolve (no such name in DNS); "
                    "check the URI"
                ) from None
        else:
            addresses = [literal]
        reason = consent.connect_refusal(
            target.host,
            target.port,
            addresses,
            self.rules,
            self._api_addresses(),
            self._api_endpoints(),
        )
        if reason is not None:
            raise consent.HostRefused(f"{what}: {reason}")
        if literal is not None:  # an address passes the ranges first, then the host list
            consent.check_host(target.host, self.rules, what)
        if not addresses:
            raise DnsUnavailable(target.host)
        return addresses

    def _api_addresses(self) -> set[str]:
        service = os.environ.get("KUBERNETES_SERVICE_HOST", "").strip()
        return _quietly_resolved(service, 443) if service else set()

    def _api_endpoints(self) -> set[tuple[str, int]]:
        endpoint = self.api_endpoint()
        if endpoint is None:
            return set()
        host, port = endpoint
        return {(a, port) for a in _quietly_resolved(host, port)}


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def _quietly_resolved(host: str, port: int) -> set[str]:
    literal = _literal(host.strip("[]"))
    if literal is not None:
        return {literal}
    try:
        return set(resolve(host, port))
    except (NameNotFound, DnsUnavailable):
        return set()


# ---- connections that connect to the checked addresses only


def _connect_pinned(conn: u3_connection.HTTPConnection, pinned: tuple[str, ...]) -> socket.socket:
    """A socket connected to the first of `pinned` that answers, never to what the host name
    resolves to now; everything else (TLS verified against the host name, SNI) is urllib3's."""
    failure: Exception = u3.NewConnectionError(conn, "no address to connect to")
    for address in pinned:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        try:
            for option in conn.socket_options or ():
                sock.setsockopt(*option)
            if conn.timeout is None or isinstance(conn.timeout, int | float):
                sock.settimeout(conn.timeout)
            if conn.source_address:
                sock.bind(conn.source_address)
            sock.connect((address, conn.port))
            return sock
        except TimeoutError:
            sock.close()
            failure = u3.ConnectTimeoutError(conn, f"connecting to {conn.host} timed out")
        except OSError as e:
            sock.close()
            failure = u3.NewConnectionError(conn, f"cannot connect: {e.strerror or e}")
    raise failure


class _PinnedHTTPConnection(u3_connection.HTTPConnection):
    def __init__(self, *args: Any, pinned: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pinned = pinned

    def _new_conn(self) -> socket.socket:
        return _connect_pinned(self, self._pinned)


class _PinnedHTTPSConnection(u3_connection.HTTPSConnection):
    def __init__(self, *args: Any, pinned: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pinned = pinned

    def _new_conn(self) -> socket.socket:
        return _connect_pinned(self, self._pinned)


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _PinnedHTTPConnection


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _PinnedHTTPSConnection


def _pool(
    target: sources.Target, addresses: list[str], timeout: urllib3.Timeout
) -> urllib3.HTTPConnectionPool:
    cls = _HTTPSPool if target.scheme == "https" else _HTTPPool
    host = f"[{target.host}]" if ":" in target.host else target.host
    return cls(
        host, target.port, timeout=timeout, retries=False, maxsize=1, pinned=tuple(addresses)
    )


# ---- requests, redirects included


@contextlib.contextmanager
def get(
    url: str,
    *,
    guard: Guard,
    headers: Mapping[str, str],
    timeout: urllib3.Timeout,
    what: str,
) -> Iterator[urllib3.BaseHTTPResponse]:
    """GET `url`, following redirects, each request checked as the module docstring says;
    yields the first answer that is not a redirect (its body unread). Raises
    consent.HostRefused or errors.InvalidSource (permanent), DnsUnavailable, and urllib3's
    errors for a connection that fails."""
    pools: list[urllib3.HTTPConnectionPool] = []
    response: urllib3.BaseHTTPResponse | None = None
    try:
        target = _parse(url, what)
        if target.scheme not in ("http", "https"):
            raise consent.HostRefused(f"{what}: only http and https URLs are fetched")
        hop_headers = dict(headers)
        here = what
        for hop in range(MAX_REDIRECTS + 1):
            addresses = guard.addresses(target, here)
            pool = _pool(target, addresses, timeout)
            pools.append(pool)
            response = pool.urlopen(
                "GET",
                target.request_target,
                headers=hop_headers,
                retries=False,
                redirect=False,
                preload_content=False,
                release_conn=False,
                assert_same_host=False,
            )
            location = response.headers.get("Location")
            if response.status not in REDIRECT_STATUSES or location is None:
                yield response
                return
            response.close()  # the body of a redirect is never read
            response = None
            if hop == MAX_REDIRECTS:
                break
            following = _parse_location(target, location, what)
            if target.scheme == "https" and following.scheme == "http":
                raise consent.HostRefused(
                    f"{what}: a redirect from https to http ({following.origin}) is refused; "
                    "the source must stay on https"
                )
            if _origin(following) != _origin(target):
                hop_headers = {
                    k: v for k, v in hop_headers.items() if k.lower() not in _ORIGIN_HEADERS
                }
            target = following
            here = f"{what} (redirected to {target.origin})"
        raise errors.InvalidSource(f"{what}: more than {MAX_REDIRECTS} redirects; check the URI")
    finally:
        if response is not None:
            response.close()
        for pool in pools:
            pool.close()


def _origin(target: sources.Target) -> tuple[str, str, int]:
    return target.scheme, target.host, target.port


def _parse(url: str, what: str) -> sources.Target:
    try:
        return sources.parse_url(url)
    except ValueError as e:
        raise consent.HostRefused(f"{what}: the URL is refused: {e}") from e


def _parse_location(current: sources.Target, location: str, what: str) -> sources.Target:
    """The target of a redirect's Location (relative to the current URL); the Location's text
    is checked before it is joined, and never quoted in a message."""
    try:
        sources.check_url_text(location)
        base = f"{current.origin}{current.request_target}"
        return sources.parse_url(urljoin(base, location))
    except ValueError as e:
        raise consent.HostRefused(f"{what}: answered with a redirect that is refused: {e}") from e
