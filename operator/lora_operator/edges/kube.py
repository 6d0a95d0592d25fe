"""The Kubernetes API calls the controller makes itself, outside kopf's handlers.

kopf watches and patches what its handlers return; the controller also writes adapters' status,
posts Events (events.k8s.io/v1, with series for repeats), reads credential Secrets and owners,
and asks for tokens. It does so on the shared client (`lora_runtime.kube`: one session, its
errors, the API's names and times), with the credentials kopf logged in with
(`kopf.ConnectionInfo`: the kopf login glue, `in_cluster_login`, lives here and nowhere else).
The errors and helpers the controller names as `kube.*` are the shared client's.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlencode

import kopf
from lora_runtime import login
from lora_runtime.kube import ApiError as ApiError
from lora_runtime.kube import Credentials, KubeClient
from lora_runtime.kube import InvalidName as InvalidName
from lora_runtime.kube import check_name as check_name
from lora_runtime.kube import now_iso as now_iso
from lora_runtime.kube import object_path as object_path
from lora_runtime.kube import parse_time as parse_time

from lora_operator.rules.model import GROUP, PLURAL, VERSION

EVENTS = "/apis/events.k8s.io/v1"
# The owners an inference pod's chain may hold (trust), by kind: their plural in apps/v1.
APPS_PLURALS = {
    "ReplicaSet": "replicasets",
    "Deployment": "deployments",
    "StatefulSet": "statefulsets",
}
REPORTING_CONTROLLER = "lora.dev/operator"
LIST_PAGE = 500  # objects per page of a LIST


class SecretRead(NamedTuple):
    """A Secret as the operator reads it: its values (decoded) and what it says about its use."""

    data: dict[str, str]
    labels: dict[str, str]
    annotations: dict[str, str]


def in_cluster_login() -> kopf.ConnectionInfo | None:
    """The pod's service account (`lora_runtime.login.in_cluster`) as kopf's login handlers
    return it; None outside a pod. Read at each call, so a rotated token is picked up."""
    found = login.in_cluster()
    if found is None:
        return None
    return kopf.ConnectionInfo(
        server=found.server,
        ca_path=found.ca_path,
        token=found.token,
        default_namespace=found.default_namespace,
    )


class KubeApi(KubeClient):
    def __init__(self, info: Credentials, *, instance: str = "lora-operator") -> None:
        super().__init__(info)
        self.instance = instance  # this process, as the Events' reportingInstance

    async def patch_adapter_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        """Merge-patch `.status` (None values remove fields; lists are replaced whole)."""
        path = object_path(f"/apis/{GROUP}/{VERSION}", PLURAL, namespace, name, "status")
        await self.request("PATCH", path, {"status": status}, "application/merge-patch+json")

    async def patch_adapter(
        self, namespace: str, name: str, ops: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """JSON-patch the object (its metadata: the operator's finalizer); the object after it."""
        path = object_path(f"/apis/{GROUP}/{VERSION}", PLURAL, namespace, name)
        return dict(await self.request("PATCH", path, ops, "application/json-patch+json"))

    async def list_adapters(
        self, namespace: str | None, page_size: int = LIST_PAGE
    ) -> list[tuple[str, str]]:
        """The (namespace, name) of every LoRAAdapter, of one namespace or all (None), read a
        page at a time: ten thousand objects never sit in memory at once."""
        collection = object_path(f"/apis/{GROUP}/{VERSION}", PLURAL, namespace)
        keys: list[tuple[str, str]] = []
        page = ""
        while True:
            query = urlencode({"limit": page_size, **({"continue": page} if page else {})})
            body = await self.request("GET", f"{collection}?{query}")
            for item in body.get("items") or ():
                meta = item.get("metadata") or {}
                keys.append((str(meta.get("namespace", "")), str(meta.get("name", ""))))
            page = str((body.get("metadata") or {}).get("continue") or "")
            if not page:
                return keys

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
