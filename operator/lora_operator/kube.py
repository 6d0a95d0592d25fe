"""The few Kubernetes API writes the controller makes outside kopf's handlers.

kopf watches and patches what its handlers return; the controller also writes an adapter's
status when a pod changes, posts Events and reads credential Secrets. It does so with the same
credentials kopf logged in with (`kopf.ConnectionInfo`), over one aiohttp session.
"""

from __future__ import annotations

import base64
import datetime
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from lora_operator.model import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class KubeApi:
    def __init__(self, info: kopf.ConnectionInfo, *, component: str = "lora-operator") -> None:
        self.server = info.server.rstrip("/")
        self.component = component
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

    async def read_secret(self, namespace: str, name: str) -> dict[str, str]:
        """The Secret's data, decoded. Never logged."""
        body = await self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
        data = body.get("data") or {}
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    async def post_event(
        self, regarding: Mapping[str, str], type_: str, reason: str, message: str
    ) -> None:
        """A core/v1 Event about `regarding`; failures are logged, never raised."""
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        namespace = regarding["namespace"]
        body = {
            "metadata": {
                "namespace": namespace,
                "name": f"{regarding['name']}.{uuid.uuid4().hex[:16]}",
            },
            "involvedObject": dict(regarding),
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": self.component},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.request("POST", f"/api/v1/namespaces/{namespace}/events", body)
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            log.warning("could not post event %s on %s: %s", reason, regarding["name"], e)
