"""The router's reads of the Kubernetes API: list, then watch, again after any break.

The calls go through the client the operator uses too (`lora_runtime.kube`), without kopf or
the operator. Credentials: the pod's service account (read again at every new list, so a
rotated token is picked up), or the kubeconfig outside a cluster (`lora_runtime.login`). The
router only reads: its RBAC grants get, list and watch on LoRAAdapters and EndpointSlices of its
namespace.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable
from typing import Any

import aiohttp
from lora_runtime import backoff
from lora_runtime import login as logins
from lora_runtime.kube import ApiError, KubeClient

log = logging.getLogger("lora_router")

WATCH_SECONDS = 60  # the server ends each watch after this; the router watches again
RETRY_CAP_S = 10.0

Obj = dict[str, Any]


def login() -> logins.Login:
    """The service account in a pod, else the kubeconfig."""
    info = logins.in_cluster() or logins.from_kubeconfig()
    if info is None:
        raise RuntimeError("no service account and no kubeconfig: set KUBECONFIG")
    return info


async def _watch(
    api: KubeClient, path: str, params: dict[str, str], on_event: Callable[[str, Obj], None]
) -> str | None:
    """One watch request; calls `on_event` per event and returns the last resourceVersion,
    or None when the server said the version is too old (list again)."""
    version = params.get("resourceVersion")
    async for kind, obj in api.watch(path, {**params, "timeoutSeconds": str(WATCH_SECONDS)}):
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
    connect: Callable[[], logins.Login] = login,
) -> None:
    """Keep a collection mirrored for ever: list (handing `replace` every object), then watch,
    and list again after a break, an expired version or an API server restart."""
    attempt = 0
    listing_path = f"{path}?{urllib.parse.urlencode(params)}" if params else path
    while True:
        api = KubeClient(connect())
        try:
            listing = await api.request("GET", listing_path)
            replace(list(listing.get("items") or ()))
            version: str | None = (listing.get("metadata") or {}).get("resourceVersion")
            attempt = 0
            while version is not None:
                version = await _watch(api, path, {**params, "resourceVersion": version}, on_event)
        except (ApiError, aiohttp.ClientError, TimeoutError, ValueError) as e:
            attempt += 1
            delay = backoff.delay(attempt, cap=RETRY_CAP_S)
            log.warning("action=watch path=%s result=error retry_in=%.1f error=%s", path, delay, e)
            await asyncio.sleep(delay)
        finally:
            await api.close()
