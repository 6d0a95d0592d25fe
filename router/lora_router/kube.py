"""The router's reads of the Kubernetes API: list, then watch, again after any break.

Credentials: the pod's service account (its token file is read again at every new list, so a
rotated token is picked up), or the kubeconfig outside a cluster (kopf's loader). The router only
reads: its RBAC grants get, list and watch on LoRAAdapters and EndpointSlices of its namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf

log = logging.getLogger("lora_router")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_SECONDS = 60  # the server ends each watch after this; the router watches again
RETRY_CAP_S = 10.0

Obj = dict[str, Any]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def login() -> kopf.ConnectionInfo:
    """The service account in a pod (at the address Kubernetes puts in every pod's environment),
    else the kubeconfig."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    token = SERVICE_ACCOUNT / "token"
    if host and token.is_file():
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        ca = SERVICE_ACCOUNT / "ca.crt"
        return kopf.ConnectionInfo(
            server=f"https://{f'[{host}]' if ':' in host else host}:{port}",
            ca_path=str(ca) if ca.is_file() else None,
            token=token.read_text().strip(),
        )
    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    if info is None:
        raise RuntimeError("no service account and no kubeconfig: set KUBECONFIG")
    return info


def pod_namespace() -> str | None:
    path = SERVICE_ACCOUNT / "namespace"
    return path.read_text().strip() if path.is_file() else None


class Api:
    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.server = info.server.rstrip("/")
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers=info.as_http_headers(),
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=WATCH_SECONDS + 30),
        )

    async def close(self) -> None:
        await self._session.close()

    async def list(self, path: str, params: dict[str, str]) -> Obj:
        async with self._session.get(self.server + path, params=params) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, (await resp.text())[:300])
            body: Obj = await resp.json()
            return body

    async def watch(
        self, path: str, params: dict[str, str], on_event: Callable[[str, Obj], None]
    ) -> str | None:
        """One watch request; calls `on_event` per event and returns the last resourceVersion,
        or None when the server said the version is too old (list again)."""
        query = {**params, "watch": "1", "allowWatchBookmarks": "true"}
        query["timeoutSeconds"] = str(WATCH_SECONDS)
        version = params.get("resourceVersion")
        async with self._session.get(self.server + path, params=query) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, (await resp.text())[:300])
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = str(event.get("type")), dict(event.get("object") or {})
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return None
                    raise ApiError(int(obj.get("code") or 500), str(obj.get("message")))
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind != "BOOKMARK":
                    on_event(kind, obj)
        return version


async def mirror(
    path: str,
    params: dict[str, str],
    replace: Callable[[list[Obj]], None],
    on_event: Callable[[str, Obj], None],
    *,
    connect: Callable[[], kopf.ConnectionInfo] = login,
) -> None:
    """Keep a collection mirrored for ever: list (handing `replace` every object), then watch,
    and list again after a break, an expired version or an API server restart."""
    attempt = 0
    while True:
        api = Api(connect())
        try:
            listing = await api.list(path, params)
            replace(list(listing.get("items") or ()))
            version: str | None = (listing.get("metadata") or {}).get("resourceVersion")
            attempt = 0
            while version is not None:
                version = await api.watch(path, {**params, "resourceVersion": version}, on_event)
        except (ApiError, aiohttp.ClientError, TimeoutError, ValueError) as e:
            attempt += 1
            delay = min(RETRY_CAP_S, 0.5 * 2**attempt)
            log.warning("action=watch path=%s result=error retry_in=%.1f error=%s", path, delay, e)
            await asyncio.sleep(delay)
        finally:
            await api.close()
