"""The finalizer actor on the controller rig: the operator's finalizer added once per adapter,
a deletion unpublished, waited on and released by the controller itself (no kopf handler, no
task per deletion), a refused write tried again, a grace that runs out."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from lora_operator.edges import kube
from lora_operator.edges.podclient import PodError
from lora_operator.rules import planning
from lora_operator.rules.finalizing import FINALIZER

from tests.support.controller import SHA, Rig, adapter, pod
from tests.support.polling import until


async def test_a_live_adapter_is_held_by_one_write(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        body = adapter(rig.volume, "a")
        c.adapter_changed(body)
        await until("held", lambda: rig.api.finalizers.get("a") == [FINALIZER])
        # Its next events carry the finalizer: nothing more is written.
        body["metadata"].update(finalizers=[FINALIZER], resourceVersion="2")
        for _ in range(3):
            c.adapter_changed(body)
        await asyncio.sleep(0.3)
        assert [name for name, _ in rig.api.patches] == ["a"]


async def test_another_controllers_finalizer_is_kept(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        body = adapter(rig.volume, "a")
        body["metadata"].update(finalizers=["team.io/backup"], resourceVersion="7")
        c.adapter_changed(body)
        await until("held", lambda: "a" in rig.api.finalizers)
        assert rig.api.finalizers["a"] == ["team.io/backup", FINALIZER]
        assert rig.api.patches[0][1][0] == {
            "op": "test",
            "path": "/metadata/resourceVersion",
            "value": "7",
        }
        rig.delete(body)
        await until("let go", lambda: ("ns", "a") not in c.adapters)
        assert rig.api.finalizers["a"] == ["team.io/backup"]


async def test_a_refused_write_is_tried_again(tmp_path: Path) -> None:
    """The API refused the patch: made against an older version (422: the object's next event
    brings the newer one), then away (500: a backoff)."""
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        rig.api.patch_errors = [
            kube.ApiError(422, "the test operation failed"),
            kube.ApiError(500, "etcd unavailable"),
        ]
        c.adapter_changed(adapter(rig.volume, "a"))
        await until("held", lambda: rig.api.finalizers.get("a") == [FINALIZER], timeout=10)
        assert not rig.api.patch_errors and len(rig.api.patches) == 1


async def test_an_adapter_deleted_before_it_was_held_is_let_go_without_a_write(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        body = adapter(rig.volume, "a")
        rig.delete(body)  # first seen deleting, no finalizer of ours on it
        await until("let go", lambda: ("ns", "a") not in c.adapters)
        assert rig.api.patches == [] and ("unpublish", "a") in rig.log


async def test_pods_that_keep_it_past_the_grace_do_not_hold_it_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Rig(tmp_path, unload_grace_s=0.5) as rig:
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        body = adapter(rig.volume, "a")
        c.adapter_changed(body)
        await until("Ready", lambda: rig.ready("a"))

        async def refused(pod: Any, name: str) -> None:
            raise PodError("busy", permanent=False)  # the pod keeps it

        monkeypatch.setattr(rig.pods, "unload", refused)
        rig.delete(body)
        await until("let go", lambda: ("ns", "a") not in c.adapters, timeout=10)
        assert rig.api.finalizers["a"] == []
        incomplete = [e for e in rig.api.events if e[2] == "UnloadIncomplete"]
        assert len(incomplete) == 1 and "p1" in incomplete[0][3], rig.api.events


async def test_a_deletion_waits_until_this_replica_acts(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        rig.api.finalizers["a"] = [FINALIZER]
        rig.delete(adapter(rig.volume, "a"))
        await asyncio.sleep(0.3)
        assert ("unpublish", "a") not in rig.log and ("ns", "a") in c.adapters
        c.start()
        await until("let go", lambda: ("ns", "a") not in c.adapters)
        assert rig.api.finalizers["a"] == []


async def test_a_deletion_waits_for_a_ready_pod_that_has_not_answered_yet(tmp_path: Path) -> None:
    """A Ready pod whose first /v1/models answer has not come may hold the adapter: its
    deletion is not released until that pod answers, and then unloads it."""
    async with Rig(tmp_path, unload_grace_s=60.0) as rig:
        c = rig.controller
        rig.pods.held["p1"] = {"a": planning.Card("a", SHA, 1.0, False, adapter="a")}
        rig.pods.blocked["p1"] = asyncio.Event()
        c.start()
        c.pod_changed(pod("p1"))
        rig.api.finalizers["a"] = [FINALIZER]
        rig.delete(adapter(rig.volume, "a"))
        await until("unpublished", lambda: ("unpublish", "a") in rig.log)
        await asyncio.sleep(0.5)
        assert rig.api.finalizers["a"] == [FINALIZER] and ("ns", "a") in c.adapters
        rig.pods.blocked.pop("p1").set()
        await until("let go", lambda: ("ns", "a") not in c.adapters)
        assert ("unload", "p1", "a") in rig.log and rig.api.finalizers["a"] == []


async def test_a_thousand_deletions_wait_as_records_not_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kubectl delete --all` of a thousand adapters two pods hold: every deletion waits for
    its unloads with no task of its own, and each is released once no pod holds it."""
    k = 1000
    async with Rig(tmp_path, unload_grace_s=60.0) as rig:
        c = rig.controller
        names = [f"a-{i:04d}" for i in range(k)]
        for p in ("p1", "p2"):
            rig.pods.held[p] = {n: planning.Card(n, SHA, 1.0, False, adapter=n) for n in names}
        unloads = asyncio.Event()
        real_unload = rig.pods.unload

        async def unload_when_let(pod: Any, name: str) -> None:
            await unloads.wait()
            await real_unload(pod, name)

        monkeypatch.setattr(rig.pods, "unload", unload_when_let)
        c.start()
        for p in ("p1", "p2"):
            c.pod_changed(pod(p))
        for n in names:
            rig.api.finalizers[n] = [FINALIZER]
            rig.delete(adapter(rig.volume, n))
        await until("unpublished", lambda: sum(e[0] == "unpublish" for e in rig.log) == k)
        await asyncio.sleep(0.3)
        assert len(c.adapters) == k  # every one waits: the pods still hold them
        assert len(asyncio.all_tasks()) < 30, len(asyncio.all_tasks())
        unloads.set()
        await until("all let go", lambda: not c.adapters, timeout=60)
        assert all(rig.api.finalizers[n] == [] for n in names)
        assert len(rig.api.patches) == k  # one release each, nothing else
