"""The Kubernetes API calls the controller makes itself, outside kopf's handlers.

kopf watches and patches what its handlers return; the controller also writes adapters' status,
posts Events (events.k8s.io/v1, with series for repeats), reads credential Secrets and watches
kopf's peering object; the router lists and watches with it too. It does so with the credentials
kopf logged in with (`kopf.ConnectionInfo`; `in_cluster_login` in a pod), over one aiohttp
session. `now_iso` is the operator's one clock in the
API's timestamp formats.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import kopf

from lora_operator.model import GROUP, PLURAL, VERSION

EVENTS = "/apis/events.k8s.io/v1"
REPORTING_CONTROLLER = "lora.dev/operator"
WATCH_READ_TIMEOUT_S = 120.0  # a watch asks the server to end it sooner (timeoutSeconds)
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class SecretRead(NamedTuple):
    """A Secret as the operator reads it: its values (decoded) and what it says about its use."""

    data: dict[str, str]
    labels: dict[str, str]
    annotations: dict[str, str]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def in_cluster_login() -> kopf.ConnectionInfo | None:
    """The pod's service account, at the address Kubernetes gives every pod in its environment
    (as client-go does; kopf's own helper assumes the kubernetes.default.svc DNS name). None
    outside a pod. The token file is read at each call, so a rotated token is picked up."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    token_file = SERVICE_ACCOUNT / "token"
    if not host or not token_file.is_file():
        return None
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    server_host = f"[{host}]" if ":" in host else host
    ca = SERVICE_ACCOUNT / "ca.crt"
    return kopf.ConnectionInfo(
        server=f"https://{server_host}:{port}",
        ca_path=str(ca) if ca.is_file() else None,
        token=token_file.read_text().strip(),
        default_namespace=pod_namespace(),
    )


def pod_namespace() -> str | None:
    """The namespace of the pod this process runs in (None outside a pod)."""
    path = SERVICE_ACCOUNT / "namespace"
    return path.read_text().strip() if path.is_file() else None


class KubeApi:
    def __init__(self, info: kopf.ConnectionInfo, *, instance: str = "lora-operator") -> None:
        self.server = info.server.rstrip("/")
        self.instance = instance  # this process, as the Events' reportingInstance
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers=info.as_http_headers(),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
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

    async def patch_adapter_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        """Merge-patch `.status` (None values remove fields; lists are replaced whole)."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        await self.request("PATCH", path, {"status": status}, "application/merge-patch+json")

    async def remove_annotation(
        self, namespace: str, name: str, key: str, resource_version: str
    ) -> None:
        """Remove one annotation, only from the object's version `resource_version` (409 when it
        changed since): a command annotation is then acted on once, however often its event
        comes."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        body = {"metadata": {"resourceVersion": resource_version, "annotations": {key: None}}}
        await self.request("PATCH", path, body, "application/merge-patch+json")

    async def read_secret(self, namespace: str, name: str) -> SecretRead:
        """The Secret's data, decoded, with its labels and annotations. Never logged."""
        body = await self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
        data = body.get("data") or {}
        meta = body.get("metadata") or {}
        return SecretRead(
            {k: base64.b64decode(v).decode() for k, v in data.items()},
            dict(meta.get("labels") or {}),
            dict(meta.get("annotations") or {}),
        )

    async def create_event(
        self, regarding: Mapping[str, str], name: str, type_: str, reason: str, note: str
    ) -> None:
        """An events.k8s.io/v1 Event about `regarding` (what `kubectl describe` lists)."""
        namespace = regarding["namespace"]
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"namespace": namespace, "name": name},
            "eventTime": now_iso(micro=True),
            "reportingController": REPORTING_CONTROLLER,
            "reportingInstance": self.instance,
            "action": "Reconcile",
            "regarding": dict(regarding),
            "type": type_,
            "reason": reason,
            "note": note,
        }
        await self.request("POST", f"{EVENTS}/namespaces/{namespace}/events", body)

    async def count_event(self, namespace: str, name: str, count: int) -> None:
        """Count one more occurrence into an Event's series (instead of a new Event)."""
        body = {"series": {"count": count, "lastObservedTime": now_iso(micro=True)}}
        await self.request(
            "PATCH",
            f"{EVENTS}/namespaces/{namespace}/events/{name}",
            body,
            "application/merge-patch+json",
        )

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


def now_iso(offset_s: float = 0.0, *, micro: bool = False) -> str:
    """Now (plus `offset_s`) in RFC 3339, UTC, as the API writes it: a Time (seconds, what
    `.status` timestamps hold) or, with `micro`, a MicroTime (what events.k8s.io/v1 requires)."""
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")
