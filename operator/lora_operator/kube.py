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
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import aiohttp
import kopf

from lora_operator.model import GROUP, PLURAL, VERSION

EVENTS = "/apis/events.k8s.io/v1"
# The owners an inference pod's chain may hold (trust), by kind: their plural in apps/v1.
APPS_PLURALS = {
    "ReplicaSet": "replicasets",
    "Deployment": "deployments",
    "StatefulSet": "statefulsets",
}
REPORTING_CONTROLLER = "lora.dev/operator"
WATCH_READ_TIMEOUT_S = 120.0  # a watch asks the server to end it sooner (timeoutSeconds)
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class SecretRead(NamedTuple):
    """A Secret as the operator reads it: its values (decoded) and what it says about its use."""

    data: dict[str, str]
    labels: dict[str, str]
    annotations: dict[str, str]


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
        path = object_path(f"/apis/{GROUP}/{VERSION}", PLURAL, namespace, name, "status")
        await self.request("PATCH", path, {"status": status}, "application/merge-patch+json")

    async def remove_annotation(
        self, namespace: str, name: str, key: str, resource_version: str
    ) -> None:
        """Remove one annotation, only from the object's version `resource_version` (409 when it
        changed since): a command annotation is then acted on once, however often its event
        comes."""
        path = object_path(f"/apis/{GROUP}/{VERSION}", PLURAL, namespace, name)
        body = {"metadata": {"resourceVersion": resource_version, "annotations": {key: None}}}
        await self.request("PATCH", path, body, "application/merge-patch+json")

    async def read_secret(self, namespace: str, name: str) -> SecretRead:
        """The Secret's data, decoded, with its labels and annotations. Never logged.
        InvalidName when `name` is not a Secret's name (it comes from a user's spec)."""
        path = object_path("/api/v1", "secrets", namespace, check_name(name, what="Secret name"))
        body = await self.request("GET", path)
        data = body.get("data") or {}
        meta = body.get("metadata") or {}
        return SecretRead(
            {k: base64.b64decode(v).decode() for k, v in data.items()},
            dict(meta.get("labels") or {}),
            dict(meta.get("annotations") or {}),
        )

    async def read_owner(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        """A ReplicaSet, Deployment or StatefulSet (an inference pod's owner chain), or None
        when there is none by that name. The name comes from a pod's ownerReferences."""
        plural = APPS_PLURALS[kind]
        try:
            body = await self.request("GET", object_path("/apis/apps/v1", plural, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        return dict(body)

    async def request_token(
        self, namespace: str, service_account: str, audience: str, seconds: int
    ) -> tuple[str, float]:
        """A token of `service_account` bound to `audience`, from the TokenRequest API, and its
        lifetime in seconds (the API server may shorten what was asked for). Never logged."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"audiences": [audience], "expirationSeconds": seconds},
        }
        path = object_path("/api/v1", "serviceaccounts", namespace, service_account, "token")
        out = await self.request("POST", path, body)
        status = (out.get("status") or {}) if isinstance(out, dict) else {}
        token = status.get("token")
        if not isinstance(token, str) or not token:
            raise ApiError(500, "the TokenRequest answer holds no token")
        expires = parse_time(str(status.get("expirationTimestamp") or ""))
        now = datetime.datetime.now(datetime.UTC)
        lifetime = (expires - now).total_seconds() if expires is not None else float(seconds)
        return token, max(0.0, min(lifetime, float(seconds)))

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
        await self.request("POST", object_path(EVENTS, "events", namespace), body)

    async def count_event(self, namespace: str, name: str, count: int) -> None:
        """Count one more occurrence into an Event's series (instead of a new Event)."""
        body = {"series": {"count": count, "lastObservedTime": now_iso(micro=True)}}
        await self.request(
            "PATCH",
            object_path(EVENTS, "events", namespace, name),
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
