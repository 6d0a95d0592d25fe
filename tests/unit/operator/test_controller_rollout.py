"""The controller rolling a new revision out in weighted steps (spec.rollout), with its seams
swapped (the rig of test_controller.py: pods answering from memory, a recording API, the real
store). What is tested: both revisions on the pods (the canary under its alias), the weights in
the status the routers read, promote and abort through the annotation (acted on once), the old
revision kept until promoted and then collected, and a restarted operator that continues."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
from lora_operator.edges.podclient import PodError
from lora_operator.rules import planning, rollout
from lora_operator.rules.model import PodInfo
from lora_volume import layout, stacks

from tests.support.controller import NS, CountingPods, Rig, adapter, holders, placed_rig, pod
from tests.support.loras import lora_bytes
from tests.support.polling import until

STEPS = {"steps": [{"weight": 25}, {"weight": 60, "pauseSeconds": 1}]}


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


def new_source(volume: Path, body: dict[str, Any], seed: int) -> dict[str, Any]:
    src = volume / NS / "src" / f"v{seed}.safetensors"
    src.write_bytes(lora_bytes(seed))
    meta = {**body["metadata"], "generation": body["metadata"]["generation"] + 1}
    return {**body, "metadata": meta, "spec": {**body["spec"], "source": {"uri": str(src)}}}


def annotated(body: dict[str, Any], command: str, version: str) -> dict[str, Any]:
    meta = {
        **body["metadata"],
        "annotations": {rollout.COMMAND_ANNOTATION: command},
        "resourceVersion": version,
    }
    return {**body, "metadata": meta}


def held(rig: Rig, pod_name: str) -> dict[str, str]:
    return {n: c.revision or "" for n, c in rig.pods.held.get(pod_name, {}).items()}


def rollout_status(rig: Rig) -> dict[str, Any] | None:
    return merged(rig.api.status.get("a", [])).get("rollout")


def written_rollout(rig: Rig) -> dict[str, Any]:
    """The rollout status written so far; fails the test when none was."""
    written = rollout_status(rig)
    assert written is not None, "no rollout status was written"
    return written


def revisions_on_volume(volume: Path) -> set[str]:
    root = layout.namespace_root(volume, NS) / "a" / layout.REVISIONS
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


async def first_step(rig: Rig, *pods: str, **spec: Any) -> tuple[dict[str, Any], str, str]:
    """Serve `a` (with `spec` besides its rollout) at a first revision on `pods`, then apply a
    second: (its object, the first revision, the second) once the rollout's first step serves."""
    c = rig.controller
    c.start()
    for p in pods:
        c.pod_changed(pod(p))
    body = adapter(rig.volume, "a", rollout=STEPS, **spec)
    c.adapter_changed(body)
    await until("v1 Ready", lambda: rig.ready("a"))
    v1 = str(merged(rig.api.status["a"])["staged"]["sha256"])
    assert rollout_status(rig) is None  # the first revision has nothing to roll from
    body = new_source(rig.volume, body, seed=1)
    c.adapter_changed(body)
    await until("step 1", lambda: (rollout_status(rig) or {}).get("state") == "Progressing")
    return body, v1, (rollout_status(rig) or {})["canary"]["revision"]


async def test_a_rollout_holds_both_revisions_steps_on_promotes_and_collects(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        pods = ("p1", "p2")
        body, v1, v2 = await first_step(rig, *pods)
        status = rollout_status(rig)
        assert status is not None
        alias = rollout.alias("a", v2)
        assert status["stable"] == {"revision": v1, "weight": 75, "readyPods": 2}
        assert status["canary"] == {"revision": v2, "weight": 25, "readyPods": 2, "servedAs": alias}
        for p in pods:
            assert held(rig, p) == {"a": v1, alias: v2}
        # The adapter stays Ready on the revision its name serves, and the canary is kept.
        assert merged(rig.api.status["a"])["phase"] == "Ready"
        assert {v1, v2} <= revisions_on_volume(rig.volume)

        # A step without a pause waits; a promote moves it on, once however often it is seen,
        # and an API server that fails the annotation's removal only delays it.
        rig.api.remove_errors = [aiohttp.ClientConnectionError("connection refused")]
        c.adapter_changed(annotated(body, "promote", "7"))
        await until("step 2", lambda: (rollout_status(rig) or {}).get("step") == 2)
        c.adapter_changed(annotated(body, "promote", "7"))  # a stale event of that version
        assert rig.api.removed == [("a", rollout.COMMAND_ANNOTATION, "7")]
        assert written_rollout(rig)["canary"]["weight"] == 60
        assert ("a", "Normal", "RolloutPromoted") in {(o, t, r) for o, t, r, _ in rig.api.events}

        # The last step's pause ends: promoting, then the name serves v2 and the alias goes.
        await until("promoted", lambda: rig.ready("a") and rollout_status(rig) is None, timeout=10)
        await until("the alias unloaded", lambda: all(held(rig, p) == {"a": v2} for p in pods))
        states = [s["rollout"]["state"] for s in rig.api.status["a"] if s.get("rollout")]
        assert states[-1] == "Promoting"
        await until("v1 collected", lambda: v1 not in revisions_on_volume(rig.volume))


async def test_an_abort_sends_everything_back_and_keeps_the_stable_revision(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        body, v1, v2 = await first_step(rig, "p1")

        c.adapter_changed(annotated(body, "abort", "9"))
        await until("aborted", lambda: (rollout_status(rig) or {}).get("state") == "Aborted")
        assert written_rollout(rig)["canary"]["weight"] == 0
        assert written_rollout(rig)["stable"]["weight"] == 100
        await until("alias unloaded", lambda: held(rig, "p1") == {"a": v1})
        # The stable revision stays on the volume whatever collects, as does the new one
        # (`current`): staging the stable one again, or a fix, goes on from here.
        c.collector.wake.set()
        await until("a collection", lambda: not c.collector.wake.is_set())
        assert {v1, v2} <= revisions_on_volume(rig.volume)
        # A promote after an abort is refused with the reason.
        c.adapter_changed(annotated(body, "promote", "10"))
        await until(
            "refused",
            lambda: ("a", "RolloutCommandIgnored") in {(o, r) for o, _, r, _ in rig.api.events},
        )
        assert written_rollout(rig)["state"] == "Aborted"


async def test_a_restarted_operator_continues_the_rollout_where_it_was(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        body, _, _ = await first_step(rig, "p1", "p2")
        status = merged(rig.api.status["a"])
    before = {p: held(rig, p) for p in ("p1", "p2")}
    loads = len(rig.log)

    restarted, api = rig.restarted()
    restarted.start()
    try:
        for p in ("p1", "p2"):
            restarted.pod_changed(pod(p))
        restarted.adapter_changed({**body, "status": status})
        rec = restarted.adapters[(NS, "a")]
        assert rec.rollout == rollout.restore(status["rollout"])
        assert rec.staging.task is None  # nothing staged again
        restarted.adapter_changed(annotated({**body, "status": status}, "promote", "3"))
        await until(
            "step 2 after the restart",
            lambda: (merged(api.status.get("a", [])).get("rollout") or {}).get("step") == 2,
        )
        # Nothing was loaded again: the pods kept both revisions through the restart.
        assert {p: held(rig, p) for p in ("p1", "p2")} == before
        assert len(rig.log) == loads
    finally:
        await restarted.stop()


async def test_a_composition_follows_its_member_s_stable_revision_until_promoted(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        body, v1, v2 = await first_step(rig, "p1")
        c.adapter_changed(adapter(rig.volume, "b", seed=3))
        composition = {
            "metadata": {"namespace": NS, "name": "ab", "uid": "uid-ab", "generation": 1},
            "spec": {"baseModel": "sd", "compose": [{"name": "a"}, {"name": "b"}]},
        }
        c.adapter_changed(composition)
        await until("ab Ready", lambda: rig.ready("ab"))

        def member_a() -> str | None:
            """The revision of `a` in ab's staged manifest (None: collected meanwhile)."""
            manifest = Path(merged(rig.api.status["ab"])["staged"]["path"]) / stacks.STACK_FILE
            if not manifest.is_file():
                return None
            entries = stacks.parse_manifest(manifest.read_bytes(), where="test")
            return next(e.sha256 for e in entries if e.name == "a")

        assert member_a() == v1  # what `a` serves under its name, not its canary
        c.adapter_changed(annotated(body, "promote", "5"))
        await until("a promoted", lambda: rollout_status(rig) is None, timeout=10)
        await until("ab staged again with a's new revision", lambda: member_a() == v2)


async def test_a_refused_canary_says_so_and_is_never_pinned(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        body = adapter(rig.volume, "a", rollout=STEPS, pinned=True)
        c.adapter_changed(body)
        await until("v1 Ready", lambda: rig.ready("a"))
        v1 = merged(rig.api.status["a"])["staged"]["sha256"]
        loads = rig.pods.load

        async def load(pod: PodInfo, want: planning.Want, *, inplace: bool) -> None:
            """The pod refuses every canary (a 422: made for another model)."""
            if want.name != want.adapter:
                assert want.pinned is False  # a canary takes no second pinned slot
                raise PodError("422 made for another model", permanent=True)
            await loads(pod, want, inplace=inplace)

        rig.pods.load = load  # type: ignore[method-assign]
        c.adapter_changed(new_source(rig.volume, body, seed=1))
        await until(
            "the refusal in status.rollout",
            lambda: "refused the canary" in ((rollout_status(rig) or {}).get("message") or ""),
        )
        status = rollout_status(rig)
        assert status is not None
        assert status["state"] == "Starting" and status["canary"]["weight"] == 0
        assert "422 made for another model" in status["message"]
        assert held(rig, "p1") == {"a": v1}  # the stable revision serves on


async def test_an_autoscaled_adapter_counts_its_canary_s_requests(tmp_path: Path) -> None:
    async with placed_rig(tmp_path, autoscale_interval_s=0.2) as rig:
        auto = {"minReplicas": 1, "maxReplicas": 3, "targetRequestsPerSecond": 10}
        _, _, v2 = await first_step(rig, "p1", "p2", "p3", autoscale=auto)
        alias = rollout.alias("a", v2)
        assert len(holders(rig, alias)) == 1
        pods = rig.pods
        assert isinstance(pods, CountingPods)
        for _ in range(200):  # 60 requests a second, all to the canary
            for p in holders(rig, alias):
                pods.hits[(p, alias)] = pods.hits.get((p, alias), 0) + 3
            if len(holders(rig, "a")) == 3:
                break
            await asyncio.sleep(0.05)
        assert len(holders(rig, "a")) == 3 and len(holders(rig, alias)) == 3
