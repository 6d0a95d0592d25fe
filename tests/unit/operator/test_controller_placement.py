"""The controller placing adapters with spec.replicas and spec.autoscale, with its seams swapped
(the rig of test_controller.py: pods answering from memory, a recording API, the real store).
What is tested: the adapter goes to exactly the placed pods and leaves the others, the status
names them and counts them in READY, a pod that goes away is replaced and one that comes back
keeps what it holds, a new adapter wakes its pods for it alone, a shortfall is Degraded with its
reason, and the request rate the pods count widens and narrows the set."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.support.controller import (
    Rig,
    adapter,
    count_planned,
    holders,
    placed_rig,
    pod,
    start_with_adapters,
)
from tests.support.polling import until


def created(body: dict[str, Any], minute: int) -> dict[str, Any]:
    body["metadata"]["creationTimestamp"] = f"2026-01-01T00:{minute:02d}:00Z"
    return body


def last_status(rig: Rig, name: str) -> dict[str, Any]:
    return rig.api.status[name][-1] if rig.api.status.get(name) else {}


async def test_replicas_place_the_adapter_on_that_many_pods_and_status_names_them(
    tmp_path: Path,
) -> None:
    async with placed_rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        for p in ("p1", "p2", "p3", "p4"):
            c.pod_changed(pod(p))
        body = adapter(rig.volume, "a", replicas=2)
        c.adapter_changed(body)
        await until("Ready", lambda: rig.ready("a"))
        status = last_status(rig, "a")
        assert len(holders(rig, "a")) == 2
        assert sorted(status["placedPods"]) == sorted(holders(rig, "a"))
        assert status["ready"] == "2/2" and status["replicas"] == 2

        # Widening keeps the pods it had (a stable hash) and adds one.
        before = holders(rig, "a")
        body["spec"]["replicas"], body["metadata"]["generation"] = 3, 2
        c.adapter_changed(body)
        await until("on 3 pods", lambda: last_status(rig, "a").get("ready") == "3/3")
        assert before < holders(rig, "a") and len(holders(rig, "a")) == 3

        # Narrowing unloads from the pods it leaves.
        wide = holders(rig, "a")
        body["spec"]["replicas"], body["metadata"]["generation"] = 1, 3
        c.adapter_changed(body)
        await until("on 1 pod", lambda: len(holders(rig, "a")) == 1)
        await until("1/1", lambda: last_status(rig, "a").get("ready") == "1/1")
        assert last_status(rig, "a")["placedPods"] == sorted(holders(rig, "a"))
        unloaded = {e[1] for e in rig.log if e[0] == "unload" and e[2] == "a"}
        assert unloaded == wide - holders(rig, "a")


async def test_a_placed_pod_that_goes_away_is_replaced(tmp_path: Path) -> None:
    async with placed_rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        for p in ("p1", "p2", "p3"):
            c.pod_changed(pod(p))
        c.adapter_changed(adapter(rig.volume, "a", replicas=1))
        await until("Ready", lambda: rig.ready("a"))
        (first,) = holders(rig, "a")
        c.pod_changed(pod(first), deleted=True)
        rig.pods.held.pop(first)
        await until("placed elsewhere", lambda: len(holders(rig, "a")) == 1)
        await until(
            "Ready there",
            lambda: last_status(rig, "a").get("placedPods") == [next(iter(holders(rig, "a")))],
        )
        assert first not in holders(rig, "a")
        assert last_status(rig, "a")["ready"] == "1/1"


async def test_a_pod_back_from_a_blip_keeps_its_adapters(tmp_path: Path) -> None:
    # After an API-server outage the node is marked NotReady for a moment and its pods with it:
    # the placement made meanwhile does not count the pod, and a pod back is not emptied and
    # filled again (400 unloads and 400 loads per pod) before a placement counts it.
    async with placed_rig(tmp_path) as rig:
        rig.pods.max_cpu = 40
        c = rig.controller
        names = start_with_adapters(rig, 20, replicas=2)
        await until("2/2", lambda: all(last_status(rig, n).get("ready") == "2/2" for n in names))
        away = dataclasses.replace(pod("p1"), ready=False)
        c.pod_changed(away)
        await until("1/1", lambda: all(last_status(rig, n).get("ready") == "1/1" for n in names))
        calls = len(rig.log)
        c.pod_changed(pod("p1"))
        await until("2/2", lambda: all(last_status(rig, n).get("ready") == "2/2" for n in names))
        await asyncio.sleep(1.0)  # a placement's recompute, and the passes it wakes
        assert rig.log[calls:] == []
        assert all(holders(rig, n) == {"p1", "p2"} for n in names)


async def test_a_pod_away_and_back_between_passes_leaves_no_stale_status(tmp_path: Path) -> None:
    # A status computed while a pod was away (1/1) is computed again when the pod is back, even
    # when neither its worker nor the placement saw it away: nothing else would mark it.
    async with placed_rig(tmp_path) as rig:
        rig.pods.max_cpu = 40
        c = rig.controller
        names = start_with_adapters(rig, 20, replicas=2)
        await until("all on both", lambda: all(holders(rig, n) == {"p1", "p2"} for n in names))
        c.pod_changed(dataclasses.replace(pod("p1"), ready=False))
        await until("1/1", lambda: all(last_status(rig, n).get("ready") == "1/1" for n in names))
        c.pod_changed(pod("p1"))
        await until("2/2", lambda: all(last_status(rig, n).get("ready") == "2/2" for n in names))
        assert all(holders(rig, n) == {"p1", "p2"} for n in names)


async def test_a_pod_back_within_the_grace_costs_no_write_and_a_longer_loss_one(
    tmp_path: Path,
) -> None:
    # A node marked NotReady for a few seconds (after an API-server outage) takes its pods away
    # and gives them back: nothing worth a write or an Event. A pod away for longer than the
    # grace is a loss of pods, written once.
    async with placed_rig(tmp_path, status_loss_grace_s=2.0) as rig:
        rig.pods.max_cpu = 40
        c = rig.controller
        names = start_with_adapters(rig, 20, replicas=2)
        await until("2/2", lambda: all(last_status(rig, n).get("ready") == "2/2" for n in names))
        await asyncio.sleep(0.5)  # the last writes of progress
        writes = {n: len(rig.api.status[n]) for n in names}
        events = len(rig.api.events)
        away = dataclasses.replace(pod("p1"), ready=False)
        c.pod_changed(away)
        await asyncio.sleep(1.0)
        c.pod_changed(pod("p1"))
        await asyncio.sleep(2.5)  # past the grace
        assert {n: len(rig.api.status[n]) for n in names} == writes
        assert len(rig.api.events) == events

        loop = asyncio.get_running_loop()
        gone_at = loop.time()
        c.pod_changed(away)
        await until("1/1", lambda: all(last_status(rig, n).get("ready") == "1/1" for n in names))
        assert loop.time() - gone_at >= 2.0
        await asyncio.sleep(0.5)
        assert {n: len(rig.api.status[n]) - writes[n] for n in names} == dict.fromkeys(names, 1)
        assert {last_status(rig, n)["phase"] for n in names} == {"Degraded"}
        assert len(rig.api.events) == events + len(names)

        # Away, the pod's loads are kept for its return; deleted, they go.
        recs = [r for r in c.cache.adapters.values() if r.info.name in names]
        assert all("p1" in r.entries.recorded_loads for r in recs)
        c.pod_changed(away, deleted=True)
        await asyncio.sleep(0.1)
        assert not any("p1" in r.entries.recorded_loads for r in recs)


async def test_an_adapter_staged_before_its_placement_is_not_told_it_has_no_pods(
    tmp_path: Path,
) -> None:
    # In a burst, the namespace's placement is recomputed at most every so often and an
    # adapter may be staged before one counts it: until then it is on no pod, which is no
    # news (it was written at once as Pending, NoPods, with an Event, then Ready).
    async with placed_rig(tmp_path) as rig:
        rig.pods.max_cpu = 400
        c = rig.controller
        names = start_with_adapters(rig, 20, replicas=2)
        await until("2/2", lambda: all(last_status(rig, n).get("ready") == "2/2" for n in names))
        late = [f"late{i}" for i in range(60)]
        for i, name in enumerate(late):
            c.adapter_changed(adapter(rig.volume, name, seed=i % 5, replicas=2))
            await asyncio.sleep(0.02)  # arriving one by one, over more than a placement's pace
        await until("2/2", lambda: all(last_status(rig, n).get("ready") == "2/2" for n in late))
        assert {n: rig.api.reasons(n) for n in late} == {n: ["Ready"] for n in late}
        assert all("NoPods" not in str(s) for n in late for s in rig.api.status[n])


async def test_a_new_placed_adapter_wakes_its_pods_for_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each new adapter with replicas moves the placement (it is new to it): its pods plan that
    # adapter, not every adapter of the namespace (400 a namespace at 10,000 adapters).
    async with placed_rig(tmp_path, resync_s=600.0) as rig:  # no full pass but the first
        rig.pods.max_cpu = 400
        c = rig.controller
        names = start_with_adapters(rig, 100, replicas=2)
        await until("2/2", lambda: all(last_status(rig, n).get("ready") == "2/2" for n in names))
        planned = count_planned(monkeypatch)
        for i in range(5):
            late = f"late{i}"
            c.adapter_changed(adapter(rig.volume, late, seed=i, replicas=2))
            await until(f"{late} 2/2", lambda: last_status(rig, late).get("ready") == "2/2")  # noqa: B023
    assert planned, "no pass planned the late adapters"
    assert max(planned) <= 2, planned  # the late adapter, and a card that changed meanwhile


async def test_more_replicas_than_room_is_degraded_with_the_reason(tmp_path: Path) -> None:
    async with placed_rig(tmp_path) as rig:
        rig.pods.max_cpu = 1  # each pod holds one adapter
        c = rig.controller
        c.start()
        for p in ("p1", "p2"):
            c.pod_changed(pod(p))
        c.adapter_changed(created(adapter(rig.volume, "a", replicas=2), 1))
        await until("a Ready", lambda: rig.ready("a"))
        c.adapter_changed(created(adapter(rig.volume, "b", seed=1, replicas=1), 2))
        await until("b Degraded", lambda: "Degraded" in rig.api.phases("b"))
        status = last_status(rig, "b")
        degraded = next(x for x in status["conditions"] if x["type"] == "Degraded")
        assert degraded["reason"] == "InsufficientCapacity"
        assert "placed on 0 of 1 pods" in degraded["message"]
        assert status["placedPods"] == [] and holders(rig, "b") == set()
        assert ("Warning", "InsufficientCapacity") in {(t, r) for _, t, r, _ in rig.api.events}
        # The newer adapter waits: the older one keeps both its pods.
        assert holders(rig, "a") == {"p1", "p2"} and rig.api.phases("a") == ["Ready"]


async def test_fewer_pods_than_replicas_is_degraded_and_serves_on_all(tmp_path: Path) -> None:
    async with placed_rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        for p in ("p1", "p2"):
            c.pod_changed(pod(p))
        c.adapter_changed(adapter(rig.volume, "a", replicas=3))
        await until("Degraded", lambda: "Degraded" in rig.api.phases("a"))
        await until("loaded on both", lambda: holders(rig, "a") == {"p1", "p2"})
        status = last_status(rig, "a")
        assert status["ready"] == "2/2" and status["replicas"] == 3
        assert rig.api.reasons("a")[-1] == "FewerPodsThanReplicas"


async def test_every_pod_adapters_are_untouched_by_placement(tmp_path: Path) -> None:
    async with placed_rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        for p in ("p1", "p2", "p3"):
            c.pod_changed(pod(p))
        c.adapter_changed(adapter(rig.volume, "all"))
        await until("Ready", lambda: rig.ready("all"))
        assert holders(rig, "all") == {"p1", "p2", "p3"}
        status = last_status(rig, "all")
        assert status["ready"] == "3/3"
        assert status.get("placedPods") is None and status.get("replicas") is None


async def test_autoscale_widens_when_hot_and_narrows_when_cool(tmp_path: Path) -> None:
    async with placed_rig(tmp_path, autoscale_interval_s=0.2) as rig:
        c = rig.controller
        c.start()
        for p in ("p1", "p2", "p3", "p4"):
            c.pod_changed(pod(p))
        spec = {"minReplicas": 1, "maxReplicas": 4}
        auto = {"targetRequestsPerSecond": 10, "scaleDownDelaySeconds": 1}
        c.adapter_changed(adapter(rig.volume, "a", autoscale={**spec, **auto}))
        await until("Ready", lambda: rig.ready("a"))
        assert len(holders(rig, "a")) == 1 and last_status(rig, "a")["replicas"] == 1

        async def serve(rps: float, seconds: float) -> None:
            """The placed pods count requests at `rps` in all, spread evenly."""
            for _ in range(int(seconds / 0.05)):
                pods = sorted(holders(rig, "a"))
                for p in pods:
                    key = (p, "a")
                    rig.pods.hits[key] = rig.pods.hits.get(key, 0) + round(rps * 0.05 / len(pods))
                await asyncio.sleep(0.05)

        hot = asyncio.ensure_future(serve(60, 30))
        await until("widened to 4", lambda: len(holders(rig, "a")) == 4, timeout=15)
        await until("status says 4", lambda: last_status(rig, "a").get("replicas") == 4)
        hot.cancel()
        await until("narrowed to 1", lambda: len(holders(rig, "a")) == 1, timeout=15)
        await until("status says 1", lambda: last_status(rig, "a").get("replicas") == 1)
        scaled = [n for o, _, r, n in rig.api.events if o == "a" and r == "Scaled"]
        assert "replicas 1 -> " in scaled[0] and any(n.endswith("-> 4") for n in scaled)
        assert scaled[-1].endswith("-> 1")


async def test_the_autoscaler_reads_the_pods_without_planning_every_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At every interval the autoscaler wants fresh hit counts: each pod of the namespace is
    read again, and a pass plans only what its answer changed, not every adapter there."""
    async with placed_rig(tmp_path, autoscale_interval_s=0.2, resync_s=600.0) as rig:
        c = rig.controller
        rig.pods.max_cpu = 400  # room for every adapter
        c.start()
        for p in ("p1", "p2", "p3"):
            c.pod_changed(pod(p))
        names = [f"a{i}" for i in range(200)]
        for i, name in enumerate(names):
            c.adapter_changed(adapter(rig.volume, name, seed=i % 5, replicas=2))
        hot = {"minReplicas": 1, "maxReplicas": 3}
        c.adapter_changed(adapter(rig.volume, "hot", autoscale=hot))
        await until("every adapter Ready", lambda: all(rig.ready(n) for n in [*names, "hot"]))
        await asyncio.sleep(0.5)  # the passes the arrivals woke are over
        reads = dict(rig.pods.reads)
        planned = count_planned(monkeypatch)
        await asyncio.sleep(1.5)  # about seven intervals
        assert all(rig.pods.reads[p] >= reads[p] + 3 for p in reads), (reads, rig.pods.reads)
        assert max(planned, default=0) <= 1, planned


async def test_adapters_that_arrive_later_are_placed_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the namespace's first placement, adapters arriving one by one are placed on the
    room the others left (placement.place_more: the newcomers' cost alone), where a placement
    of every adapter would put them."""
    from lora_operator.rules import placement

    placed_all: list[int] = []
    plan_placement = placement.plan_placement

    def counting(pods: Any, demands: Any) -> placement.Placement:
        placed_all.append(len(demands))
        return plan_placement(pods, demands)

    monkeypatch.setattr(placement, "plan_placement", counting)
    async with placed_rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        for p in ("p1", "p2", "p3", "p4"):
            c.pod_changed(pod(p))
        c.adapter_changed(created(adapter(rig.volume, "a-00", replicas=2), 0))
        await until("the first Ready", lambda: rig.ready("a-00"))
        names = [f"a-{i:02d}" for i in range(1, 12)]  # 24 of the pods' 32 slots
        for minute, name in enumerate(names, start=1):
            c.adapter_changed(created(adapter(rig.volume, name, replicas=2), minute))
            await asyncio.sleep(0.02)
        await until("every one Ready", lambda: all(rig.ready(n) for n in names), timeout=60)
        assert placed_all == [1], placed_all  # the first placement only
        chosen = c.placer.current("ns")
        assert chosen is not None
        infos = [r.info for r in c.adapters.values()]
        reports = {p.info.name: (p.info, p.report) for p in c.pods.values() if p.report}
        whole = plan_placement(*placement.plan_demands(infos, reports, lambda i: 2))
        assert chosen.adapters == whole.adapters
        assert all(holders(rig, n) == set(whole.adapters[n].pods) for n in ["a-00", *names])
