"""A restarted operator resumes from the pods' own state and the adapters' status (the
controller's rig: pods answering from memory, a recording API, the real store). What is tested:
with every adapter Ready on its pods (on every pod, with spec.replicas, with spec.autoscale), a
new controller on the same pods, volume and objects makes no load or unload call, posts no Event
and writes no status: nothing it would write differs from what the objects hold."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from tests.support.controller import NS, PlacedRig, adapter, placed_rig, pod
from tests.support.polling import until

PODS = ("p1", "p2", "p3", "p4")


def merged(patches: list[dict[str, Any]]) -> dict[str, Any]:
    """The status object after these merge patches, as the API server keeps it."""
    out: dict[str, Any] = {}
    for patch in patches:
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
    return out


def bodies(rig: PlacedRig) -> dict[str, dict[str, Any]]:
    """Six adapters: two on every pod, two with spec.replicas, two with spec.autoscale."""
    out = {}
    for i in range(6):
        spec: dict[str, Any] = {}
        if i in (2, 3):
            spec["replicas"] = 2
        elif i in (4, 5):
            spec["autoscale"] = {"minReplicas": 2, "maxReplicas": 3}
        body = adapter(rig.volume, f"a{i}", seed=i, **spec)
        body["metadata"]["creationTimestamp"] = f"2026-01-01T00:0{i}:00Z"
        out[f"a{i}"] = body
    return out


async def read_twice_since(rig: PlacedRig, reads: dict[str, int]) -> None:
    """Until every pod has been read twice since `reads`: each has been reconciled, and the
    status writer has passed over every adapter with every pod heard."""
    await until(
        "every pod read twice",
        lambda: all(rig.pods.reads.get(p, 0) >= reads.get(p, 0) + 2 for p in PODS),
        timeout=30,
    )


async def all_ready(
    tmp_path: Path,
) -> tuple[PlacedRig, dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The adapters of `bodies` Ready on PODS under a first controller, stopped: the rig, the
    objects, and the status each object holds."""
    async with placed_rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        for p in PODS:
            c.pod_changed(pod(p))
        objects = bodies(rig)
        for body in objects.values():
            c.adapter_changed(body)
        await until("all Ready", lambda: all(rig.ready(name) for name in objects), timeout=30)
        await asyncio.sleep(1.0)  # the last progress writes
        return rig, objects, {name: merged(rig.api.status[name]) for name in objects}


async def test_a_restart_loads_nothing_posts_no_event_and_writes_no_status(
    tmp_path: Path,
) -> None:
    rig, objects, statuses = await all_ready(tmp_path)
    calls = len(rig.log)
    held = {p: dict(cards) for p, cards in rig.pods.held.items()}
    reads = dict(rig.pods.reads)

    restarted, api = rig.restarted(status_progress_s=0.0)
    restarted.start()
    try:
        for p in PODS:
            restarted.pod_changed(pod(p))
        for name, body in objects.items():
            restarted.adapter_changed({**body, "status": statuses[name]})
        await read_twice_since(rig, reads)
        await asyncio.sleep(1.0)
        assert rig.log[calls:] == []  # no load, no unload
        assert rig.pods.held == held
        assert api.events == [] and api.counted == []
        # A write that changed nothing would be in `api.status` with the same values.
        assert api.status == {}, {n: merged(p) == statuses[n] for n, p in api.status.items()}
        for name in objects:
            rec = restarted.adapters[(NS, name)]
            assert rec.staging.task is None  # nothing staged again
            assert rec.status.phase == "Ready"
    finally:
        await restarted.stop()


async def test_a_restart_acts_only_once_it_holds_every_listed_adapter(tmp_path: Path) -> None:
    """kopf delivers each adapter's first event in its own time, pods' among them: a restarted
    controller acts once its records hold every adapter the API lists. The control: one whose
    API lists nothing acts at once, and unloads the adapters it has not seen yet."""
    rig, objects, statuses = await all_ready(tmp_path)

    async def restart(listed: bool) -> list[tuple[str, ...]]:
        calls, reads = len(rig.log), dict(rig.pods.reads)
        restarted, api = rig.restarted(status_progress_s=0.0)
        if listed:
            api.listed = [(NS, name) for name in objects]
        restarted.start()
        try:
            for p in PODS:
                restarted.pod_changed(pod(p))
            for name, body in objects.items():
                await asyncio.sleep(0.4)  # longer than a pass (resync 0.3 s)
                restarted.adapter_changed({**body, "status": statuses[name]})
            await read_twice_since(rig, reads)
            await asyncio.sleep(1.0)
            assert restarted.active.is_set()
            return rig.log[calls:]
        finally:
            await restarted.stop()

    assert await restart(listed=True) == []  # no load, no unload
    assert any(call[0] == "unload" for call in await restart(listed=False))


async def test_a_restart_writes_no_status_before_its_namespace_is_placed(tmp_path: Path) -> None:
    """A restarted operator places each namespace again once its pods have reported; until it
    has, a placed adapter is on no pod as far as it knows, and its status waits (on a loaded
    machine the placement can come seconds after the reports)."""
    rig, objects, statuses = await all_ready(tmp_path)

    restarted, api = rig.restarted(status_progress_s=0.0)
    place, late_until = restarted.placer._place, time.monotonic() + 2.0

    def late(namespace: str) -> None:
        if time.monotonic() < late_until:
            asyncio.get_running_loop().call_later(0.2, late, namespace)
            return
        place(namespace)

    restarted.placer._place = late  # type: ignore[method-assign]
    restarted.start()
    try:
        for p in PODS:
            restarted.pod_changed(pod(p))
        for name, body in objects.items():
            restarted.adapter_changed({**body, "status": statuses[name]})
        await until("placed", lambda: restarted.placer.current(NS) is not None, timeout=30)
        await asyncio.sleep(1.0)
        assert api.status == {}, {n: merged(p) for n, p in api.status.items()}
    finally:
        await restarted.stop()
