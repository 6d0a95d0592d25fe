"""The Kubernetes API client of the operator and the router: one aiohttp session with the
credentials of a login (`login.Login`, or kopf's `ConnectionInfo`, which the operator's kopf
handlers log in with: any `Credentials`), `request` for a call and `watch` for a watch; and
the API's own rules that every client follows: names checked before they become part of a path
(`object_path`), its timestamps (`parse_time`, `now_iso`), its errors (`ApiError`).

The operator's calls (status, Events, Secrets, tokens) are the operator's, on top of this
client (`lora_operator.edges.kube`); the router only lists and watches.
"""

from __future__ import annotations

import datetime
import json
import re
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

WATCH_READ_TIMEOUT_S = 120.0  # a watch asks the server to end it sooner (timeoutSeconds)


class Credentials(Protocol):
    """Where the API server is and how to prove who is calling (kopf's `ConnectionInfo` and
    `login.Login` both are)."""

    @property
    def server(self) -> str: ...

    def as_ssl_context(self) -> ssl.SSLContext: ...

    def as_http_headers(self) -> dict[str, str]: ...


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


# Object names as the API server validates them: a DNS-1123 subdomain (most kinds, Secrets
# among them) and a DNS-1123 label (namespaces).
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class InvalidName(Exception):
    """A string that was to become part of an API path is not a Kubernetes name."""


def check_name(name: str, *, what: str = "name", label: bool = False) -> str:
    """`name` if it is a DNS-1123 subdomain (a label with `label`), else InvalidName saying
    why. Every user string that becomes part of an API path passes here first (pure)."""
    limit, pattern, chars = (63, _LABEL, "'-'") if label else (253, _SUBDOMAIN, "'-' or '.'")
    if not isinstance(name, str) or len(name) > limit or not pattern.fullmatch(name):
        raise InvalidName(
            f"{what} {name!r} is not a Kubernetes name: use at most {limit} lowercase letters, "
            f"digits and {chars}, starting and ending with a letter or digit"
        )
    return name


def object_path(
    prefix: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The API path of a collection or object, e.g. `/api/v1/namespaces/NS/secrets/NAME`: the
    namespace and name checked as Kubernetes names and quoted, so no `..`, `/` or `?` of a
    user's ever reaches the URL (pure)."""
    path = prefix
    if namespace is not None:
        path += "/namespaces/" + quote(check_name(namespace, what="namespace", label=True), "")
    path += f"/{plural}"
    if name is not None:
        path += "/" + quote(check_name(name), "")
    if subresource is not None:
        path += f"/{subresource}"
    return path


class KubeClient:
    """Calls to one API server with one login, over one session (close it)."""

    def __init__(self, credentials: Credentials) -> None:
        self.server = credentials.server.rstrip("/")
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=credentials.as_ssl_context()),
            headers=credentials.as_http_headers(),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        """The answer's JSON; ApiError with the API's message for a status of 400 or more."""
        async with self._session.request(
            method,
            self.server + path,
            json=body,
            headers={"Content-Type": content_type} if body is not None else {},
        ) as resp:
            payload = await resp.json(content_type=None)
            if resp.status >= 400:
                message = payload.get("message", "") if isinstance(payload, dict) else payload
                raise ApiError(resp.status, str(message))
            return payload

    async def watch(
        self, collection: str, params: Mapping[str, str]
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The (type, object) events of one watch request on `collection`, until the server
        ends it (`params` should carry timeoutSeconds and resourceVersion)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_read=WATCH_READ_TIMEOUT_S)
        query = {**params, "watch": "1", "allowWatchBookmarks": "true"}
        async with self._session.get(
            self.server + collection, params=query, timeout=timeout
        ) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, (await resp.text())[:300])
            async for line in resp.content:
                if line.strip():
                    event = json.loads(line)
                    yield str(event.get("type")), dict(event.get("object") or {})


def parse_time(text: str) -> datetime.datetime | None:
    """An API timestamp (RFC 3339, UTC) as an aware datetime; None when it is not one (pure)."""
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.UTC)


def now_iso(offset_s: float = 0.0, *, micro: bool = False) -> str:
    """Now (plus `offset_s`) in RFC 3339, UTC, as the API writes it: a Time (seconds, what
    `.status` timestamps hold) or, with `micro`, a MicroTime (what events.k8s.io/v1 requires)."""
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")
