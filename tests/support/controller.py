"""The controller's test rig: the controller with its seams swapped for pods that answer from
memory (our own PodClient's interface), an API client that records what it is asked to write,
and the real store on a temporary volume. The controller's unit tests share it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Self

import pytest
from lora_operator.controller import Controller
from lora_operator.edges import kube
from lora_operator.edges.config import OperatorConfig
from lora_operator.edges.podclient import PodError
from lora_operator.rules import consent, planning
from lora_operator.rules.model import PodInfo, pod_info
from lora_operator.store import staging

from tests.support.loras import lora_bytes

SHA = "d" * 64
NS = "ns"
FAST: dict[str, Any] = dict(
    resync_s=0.3,
    max_backoff_s=0.02,
    verify_every_s=0.05,
    status_settle_s=3.0,
    status_progress_s=10.0,
    status_loss_grace_s=1.0,
    retry_bound=3,
)


class FakePods:
    """Inference pods in memory: /v1/models from what was loaded, failures on cue."""

    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.held: dict[str, dict[str, planning.Card]] = {}
        self.log = log
        self.fail: dict[tuple[str, str], list[PodError]] = {}
        self.blocked: dict[str, asyncio.Event] = {}
        self.in_flight: set[tuple[str, str]] = set()
        self.delay = 0.0  # seconds per load call
        self.reads: dict[str, int] = {}  # pod -> /v1/models calls
        # A load answers with the adapter's card, as this project's server does when asked for
        # JSON; False: with nothing (vLLM, an older server).
        self.answers_cards = True
        # (pod, name) -> the revision a load of it makes the pod serve and answer with, instead
        # of the wanted one (a server that loaded another file).
        self.misloads: dict[tuple[str, str], str] = {}

    async def models(self, pod: PodInfo) -> planning.PodReport:
        self.reads[pod.name] = self.reads.get(pod.name, 0) + 1
        if pod.name in self.blocked:
            await self.blocked[pod.name].wait()
        return planning.PodReport("sd", dict(self.held.setdefault(pod.name, {})))

    async def load(
        self, pod: PodInfo, want: planning.Want, *, inplace: bool
    ) -> planning.Card | None:
        key = (pod.name, want.name)
        assert key not in self.in_flight, f"{key} loaded twice at once"
        self.in_flight.add(key)
        try:
            await asyncio.sleep(self.delay)
            self.log.append(("load", pod.name, want.name))
            if self.fail.get(key):
                raise self.fail[key].pop(0)
            revision = self.misloads.get(key, want.sha256)
            card = planning.Card(want.name, revision, want.scale, want.pinned, adapter=want.adapter)
            self.held.setdefault(pod.name, {})[want.name] = card
            return card if self.answers_cards else None
        finally:
            self.in_flight.discard(key)

    async def unload(self, pod: PodInfo, name: str) -> None:
        self.log.append(("unload", pod.name, name))
        self.held.setdefault(pod.name, {}).pop(name, None)

    async def close(self) -> None:
        pass


class FakeApi:
    """Records status patches and Events; serves a peering object from a queue of states."""

    def __init__(self) -> None:
        self.status: dict[str, list[dict[str, Any]]] = {}
        self.events: list[tuple[str, str, str, str]] = []  # (object, type, reason, note)
        self.counted: list[tuple[str, int]] = []
        self.peering: dict[str, Any] = {}
        self.peering_changes: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.secret_errors: list[Exception] = []  # raised by the next reads of a Secret
        self.secrets: dict[str, kube.SecretRead] = {}  # by name; else an empty one that consents
        self.removed: list[tuple[str, str, str]] = []  # (object, annotation, resourceVersion)
        self.remove_errors: list[Exception] = []  # raised by the next annotation removals
        # apps/v1 objects by (kind, name), what an inference pod's owner chain is read from.
        self.owners: dict[tuple[str, str], dict[str, Any]] = {}
        self.owner_errors: list[Exception] = []  # raised by the next reads of an owner
        self.owner_reads: list[tuple[str, str]] = []
        # The LoRAAdapters the API lists, (namespace, name): a controller acts once its records
        # hold them all. None of them: it acts at once.
        self.listed: list[tuple[str, str]] = []
        # Each object's metadata.finalizers as the JSON patches left them, the patches, and the
        # errors the next patches raise.
        self.finalizers: dict[str, list[str]] = {}
        self.patches: list[tuple[str, list[dict[str, Any]]]] = []
        self.patch_errors: list[Exception] = []

    async def list_adapters(self, namespace: str | None) -> list[tuple[str, str]]:
        return [key for key in self.listed if namespace in (None, key[0])]

    async def patch_adapter_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        self.status.setdefault(name, []).append(dict(status))

    async def patch_adapter(
        self, namespace: str, name: str, ops: list[dict[str, Any]]
    ) -> dict[str, Any]:
        if self.patch_errors:
            raise self.patch_errors.pop(0)
        self.patches.append((name, ops))
        for op in ops:
            if op["path"] == "/metadata/finalizers":
                self.finalizers[name] = list(op["value"]) if op["op"] == "add" else []
        version = str(len(self.patches))
        return {"metadata": {"finalizers": self.finalizers[name], "resourceVersion": version}}

    async def read_secret(self, namespace: str, name: str) -> kube.SecretRead:
        if self.secret_errors:
            raise self.secret_errors.pop(0)
        return self.secrets.get(name, kube.SecretRead({}, {consent.CONSENT_KEY: "true"}, {}))

    async def read_owner(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        self.owner_reads.append((kind, name))
        if self.owner_errors:
            raise self.owner_errors.pop(0)
        return self.owners.get((kind, name))

    async def request_token(
        self, namespace: str, service_account: str, audience: str, seconds: int
    ) -> tuple[str, float]:
        return f"token-for-{audience}", float(seconds)

    async def create_event(
        self, regarding: Mapping[str, str], name: str, type_: str, reason: str, note: str
    ) -> None:
        self.events.append((regarding["name"], type_, reason, note))

    async def count_event(self, namespace: str, name: str, count: int) -> None:
        self.counted.append((name, count))

    async def remove_annotation(
        self, namespace: str, name: str, key: str, resource_version: str
    ) -> None:
        if self.remove_errors:
            raise self.remove_errors.pop(0)
        if (name, key, resource_version) in self.removed:  # that version is gone
            raise kube.ApiError(409, "the object has been modified")
        self.removed.append((name, key, resource_version))

    async def request(self, method: str, path: str) -> Any:
        items = [{"status": self.peering}] if self.peering else []
        return {"metadata": {"resourceVersion": "1"}, "items": items}

    async def watch(
        self, collection: str, params: Mapping[str, str]
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        while True:
            self.peering = await self.peering_changes.get()
            yield "MODIFIED", {"metadata": {"resourceVersion": "2"}, "status": self.peering}

    async def close(self) -> None:
        pass

    def phases(self, name: str) -> list[str]:
        return [s["phase"] for s in self.status.get(name, [])]

    def reasons(self, name: str) -> list[str]:
        return [reason for obj, _, reason, _ in self.events if obj == name]


class RecordingStore(staging.Store):
    """The real store, noting when an adapter is unpublished (to order it against unloads)."""

    def __init__(self, root: Path, log: list[tuple[str, ...]]) -> None:
        super().__init__(root)
        self.log = log

    async def unpublish(self, namespace: str, name: str) -> bool:
        self.log.append(("unpublish", name))
        return await super().unpublish(namespace, name)


def pod(name: str, namespace: str = NS, ip: str = "10.0.0.1") -> PodInfo:
    """A Ready inference pod of `namespace`, its UID its name (the rig's fake pods key by name)."""
    return pod_info(
        {
            "metadata": {
                "namespace": namespace,
                "name": name,
                "uid": name,
                "labels": {"lora.dev/inference": "true"},
            },
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )


def adapter(volume: Path, name: str, seed: int = 0, **spec: Any) -> dict[str, Any]:
    src = volume / NS / "src" / f"{name}.safetensors"
    if not src.exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_bytes(lora_bytes(seed))
    return {
        "metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}", "generation": 1},
        "spec": {"baseModel": "sd", "source": {"uri": str(src)}, **spec},
    }


class Rig:
    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.log: list[tuple[str, ...]] = []
        self.volume = tmp_path / "volume"
        self.volume.mkdir()
        self.pods = FakePods(self.log)
        self.api = FakeApi()
        self.store = RecordingStore(self.volume, self.log)
        self.controller = Controller(
            OperatorConfig(volume_root=self.volume, **{**FAST, **config}),
            pods=self.pods,
            volume=self.store,
            api=self.api,
            identity="me",
        )

    def ready(self, name: str) -> bool:
        return "Ready" in self.api.phases(name)

    def delete(self, body: dict[str, Any]) -> None:
        """`kubectl delete`: the object's event with a deletion timestamp and the finalizers
        the operator's patches left on it."""
        meta = body["metadata"]
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        meta["finalizers"] = list(self.api.finalizers.get(meta["name"], []))
        self.controller.adapter_changed(body)

    def restarted(self, **config: Any) -> tuple[Controller, FakeApi]:
        """A second controller on the same pods, volume and store, with an API of its own:
        the operator after a restart (`config` over FAST). Its caller starts and stops it."""
        api = FakeApi()
        controller = Controller(
            OperatorConfig(volume_root=self.volume, **{**FAST, **config}),
            pods=self.pods,
            volume=self.store,
            api=api,
            identity="me",
        )
        return controller, api

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.controller.stop()


class CountingPods(FakePods):
    """Pods that advertise their tiers and count requests per adapter, as the server does."""

    def __init__(self, log: list[tuple[str, ...]], max_loras: int = 4, max_cpu: int = 8) -> None:
        super().__init__(log)
        self.max_loras, self.max_cpu = max_loras, max_cpu
        self.hits: dict[tuple[str, str], int] = {}

    async def models(self, pod: PodInfo) -> planning.PodReport:
        report = await super().models(pod)
        cards = {
            name: dataclasses.replace(card, hits=self.hits.get((pod.name, name), 0))
            for name, card in report.cards.items()
        }
        return planning.PodReport(
            report.base_model, cards, max_loras=self.max_loras, max_cpu_loras=self.max_cpu
        )


class PlacedRig(Rig):
    """The rig with pods that advertise their tiers and count requests (placement, autoscale)."""

    pods: CountingPods

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        super().__init__(tmp_path, **config)
        self.pods = CountingPods(self.log)
        self.controller.pod_client = self.pods


def placed_rig(tmp_path: Path, **config: Any) -> PlacedRig:
    return PlacedRig(tmp_path, **config)


def holders(rig: Rig, name: str) -> set[str]:
    return {p for p, cards in rig.pods.held.items() if name in cards}


def count_planned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the number of candidates each `planning.plan_wants` call plans (how much of
    a namespace a pass plans)."""
    planned: list[int] = []
    plan_wants = planning.plan_wants

    def counting(*args: Any, **kwargs: Any) -> tuple[dict[str, planning.Want], set[str]]:
        pod_, base_model, candidates, placed = args
        candidates = list(candidates)
        planned.append(len(candidates))
        return plan_wants(pod_, base_model, candidates, placed, **kwargs)

    monkeypatch.setattr(planning, "plan_wants", counting)
    return planned


def start_with_adapters(rig: Rig, count: int, **spec: Any) -> list[str]:
    """Start the controller with pods p1 and p2 and `count` adapters a0, a1 ... (`spec` for
    each); returns their names."""
    c = rig.controller
    c.start()
    for p in ("p1", "p2"):
        c.pod_changed(pod(p))
    names = [f"a{i}" for i in range(count)]
    for i, name in enumerate(names):
        c.adapter_changed(adapter(rig.volume, name, seed=i % 5, **spec))
    return names
