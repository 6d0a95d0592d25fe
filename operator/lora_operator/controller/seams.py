"""What the controller talks to: the inference pods, the adapter volume and the API server.
Injected (tests swap them), and held in one `Seams` that every actor reads at the time of each
call, so a swapped seam takes effect everywhere at once. This module owns no state of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import kopf
from lora_volume import description, stacks, targeting

from lora_operator.edges import kube, peering
from lora_operator.rules import gc, planning
from lora_operator.rules.model import PodInfo
from lora_operator.store import publishing, sinks, sources

Key = tuple[str, str]  # (namespace, name)
Body = kopf.Body | Mapping[str, Any]


class Pods(Protocol):
    async def models(self, pod: PodInfo) -> planning.PodReport: ...

    async def load(
        self, pod: PodInfo, want: planning.Want, *, inplace: bool
    ) -> planning.Card | None:
        """Load `want`; the card the pod answers with for it, None when it answers none."""

    async def unload(self, pod: PodInfo, name: str) -> None: ...

    async def close(self) -> None: ...


class Volume(Protocol):
    async def stage(
        self,
        namespace: str,
        name: str,
        source: sources.Source,
        *,
        credentials: sources.Credentials | None = None,
        sha256: str | None = None,
        progress: sinks.ProgressCallback | None = None,
        target: targeting.Target | None = None,
    ) -> publishing.StagedRevision: ...

    async def stage_composition(
        self,
        namespace: str,
        name: str,
        entries: Sequence[stacks.StackEntry],
        *,
        target: targeting.Target | None = None,
    ) -> publishing.StagedRevision: ...

    def publish_target(self, namespace: str, name: str, target: targeting.Target) -> bool: ...

    async def unpublish(self, namespace: str, name: str) -> bool: ...

    async def collect(self, in_use: Collection[gc.RevisionRef]) -> tuple[gc.GcPlan, int]: ...

    def current_revision(self, namespace: str, name: str) -> str | None: ...

    def describe_current(self, namespace: str, name: str) -> description.Description | None: ...

    def clean_tmp(self) -> int: ...


class Api(peering.Watcher, Protocol):
    async def patch_adapter_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None: ...

    async def patch_adapter(
        self, namespace: str, name: str, ops: list[dict[str, Any]]
    ) -> dict[str, Any]: ...

    async def list_adapters(self, namespace: str | None) -> list[tuple[str, str]]: ...

    async def read_secret(self, namespace: str, name: str) -> kube.SecretRead: ...

    async def read_owner(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None: ...

    async def request_token(
        self, namespace: str, service_account: str, audience: str, seconds: int
    ) -> tuple[str, float]: ...

    async def create_event(
        self, regarding: Mapping[str, str], name: str, type_: str, reason: str, note: str
    ) -> None: ...

    async def count_event(self, namespace: str, name: str, count: int) -> None: ...

    async def remove_annotation(
        self, namespace: str, name: str, key: str, resource_version: str
    ) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Seams:
    """The injected clients, and whether this replica acts (every actor waits on `active`)."""

    pods: Pods
    volume: Volume
    api: Api | None = None
    logged_in: asyncio.Event = field(default_factory=asyncio.Event)
    active: asyncio.Event = field(default_factory=asyncio.Event)
    api_endpoint: tuple[str, int] | None = None  # the API server's, from the login

    def api_now(self) -> Api:
        if self.api is None:
            raise RuntimeError("the API client is used only after login")
        return self.api

    async def api_after_login(self) -> Api:
        await self.logged_in.wait()
        return self.api_now()
