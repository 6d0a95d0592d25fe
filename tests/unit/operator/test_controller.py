"""The controller with its seams swapped: pods that answer from memory (our own PodClient's
interface), an API client that records what it is asked to write, and the real store on a
temporary volume (or one that fails on cue). No cluster: what is tested here is the controller's
bookkeeping (writes per adapter, Events, deletion order, backoff, standby); the operator against
a real API server and real pods is in test_operator_*.py."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from lora_operator.controller import Controller, needs_staging
from lora_operator.controller.signals import Actor
from lora_operator.edges import kube
from lora_operator.edges.config import OperatorConfig
from lora_operator.edges.podclient import PodError
from lora_operator.rules import consent, errors
from lora_operator.rules.model import adapter_info
from lora_operator.rules.status import summarise
from lora_operator.store import publishing, volumefiles
from lora_volume import layout, targeting

from tests.support.controller import (
    NS,
    SHA,
    FakeApi,
    FakePods,
    RecordingStore,
    Rig,
    adapter,
    count_planned,
    pod,
    start_with_adapters,
)
from tests.support.loras import lora_bytes
from tests.support.polling import until


async def test_apply_loads_every_pod_with_one_status_write_and_one_event(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        for p in ("p1", "p2", "p3"):
            c.pod_changed(pod(p))
        names = [f"a{i}" for i in range(5)]
        for i, name in enumerate(names):
            c.adapter_changed(adapter(rig.volume, name, seed=i))
        await until("every adapter Ready", lambda: all(rig.ready(n) for n in names))
        await asyncio.sleep(0.3)  # anything still queued would be written now
        for name in names:
            assert rig.api.phases(name) == ["Ready"]
            assert rig.api.reasons(name) == ["Ready"]
            (status,) = rig.api.status[name]
            assert status["ready"] == "3/3" and status["readyPods"] == 3
            assert {p["state"] for p in status["pods"]} == {"Loaded"}
        notes = {note for obj, _, _, note in rig.api.events}
        assert all(n.startswith("Loaded on 3/3 pods (revision ") for n in notes)
        assert sorted(rig.log) == sorted(("load", p, n) for p in ("p1", "p2", "p3") for n in names)


async def test_a_collection_follows_a_staging_only_when_it_replaced_a_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A collection scans the whole volume and holds every staging back while it runs: a burst
    # of new adapters asks for none (their stagings replace nothing), a changed one does.
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        await until("p1 reported", lambda: c.cache.all_reported())
        asked: list[str] = []
        monkeypatch.setattr(c.collector, "collect", lambda: asked.append("collect"))
        names = [f"a{i}" for i in range(20)]
        for i, name in enumerate(names):
            c.adapter_changed(adapter(rig.volume, name, seed=i))
        await until("every adapter Ready", lambda: all(rig.ready(n) for n in names))
        assert asked == []
        body = adapter(rig.volume, "a0")
        src = Path(body["spec"]["source"]["uri"])
        src.write_bytes(lora_bytes(99))
        body["metadata"]["generation"] = 2  # a changed spec stages it again
        c.adapter_changed(body)
        await until("a0 staged again", lambda: "collect" in asked)
        assert (
            volumefiles.current_revision(rig.volume, NS, "a0")
            == hashlib.sha256(lora_bytes(99)).hexdigest()
        )


async def test_a_burst_of_adapters_costs_each_pod_few_reads(tmp_path: Path) -> None:
    # Every read lists all of a pod's adapters, so a read per adapter would make applying K
    # adapters cost K x K: a burst is taken in a few passes, each read once.
    async with Rig(tmp_path) as rig:
        c = rig.controller
        rig.pods.delay = 0.005
        c.start()
        for p in ("p1", "p2"):
            c.pod_changed(pod(p))
        names = [f"a{i}" for i in range(100)]
        for i, name in enumerate(names):
            c.adapter_changed(adapter(rig.volume, name, seed=i % 5))
        await until("every adapter Ready", lambda: all(rig.ready(n) for n in names))
        for p in ("p1", "p2"):
            assert len(rig.pods.held[p]) == len(names)
            assert rig.pods.reads[p] <= len(names) // 4, rig.pods.reads


async def test_a_staged_adapter_is_planned_alone_not_with_the_whole_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A namespace whose adapters are staged one at a time (its downloads queued behind other
    # namespaces') has each of its pods woken once per adapter: were each pass to plan every
    # adapter of the namespace, staging K would cost K x K.
    async with Rig(tmp_path, resync_s=600.0) as rig:  # no full pass but the first
        c = rig.controller
        names = start_with_adapters(rig, 200)
        await until("every adapter Ready", lambda: all(rig.ready(n) for n in names))
        planned = count_planned(monkeypatch)
        for i in range(5):
            late = f"late{i}"
            c.adapter_changed(adapter(rig.volume, late, seed=i))
            await until(f"{late} Ready", lambda: rig.ready(late))  # noqa: B023  awaited here
            for p in ("p1", "p2"):
                assert rig.pods.held[p][late].revision is not None
    assert planned, "no pass planned the late adapters"
    assert max(planned) <= 2, planned  # the late adapter, and a card that changed meanwhile


@pytest.mark.parametrize("answers_cards", [True, False], ids=["card-answers", "text-answers"])
async def test_an_adapter_staged_alone_costs_each_pod_a_read_only_without_a_card_answer(
    tmp_path: Path, answers_cards: bool
) -> None:
    # A namespace of 400 adapters staged one by one would read each pod's 400 cards per
    # adapter, twice. A pod that answers a load with the adapter's card (this project's server)
    # is read no more: the card is its evidence. One that answers text (vLLM) is read once per
    # adapter, after the call (the evidence); the pass plans from the report read after the
    # operator's last call.
    async with Rig(tmp_path, resync_s=600.0) as rig:
        c = rig.controller
        rig.pods.answers_cards = answers_cards
        names = start_with_adapters(rig, 50)
        await until("every adapter Ready", lambda: all(rig.ready(n) for n in names))
        await asyncio.sleep(0.3)  # the last passes' reads
        for i in range(5):
            late = f"late{i}"
            reads = dict(rig.pods.reads)
            c.adapter_changed(adapter(rig.volume, late, seed=i))
            await until(f"{late} Ready", lambda: rig.ready(late))  # noqa: B023  awaited here
            await asyncio.sleep(0.3)  # a second read would come within the pass
            for p in ("p1", "p2"):
                assert rig.pods.held[p][late].revision is not None
                assert rig.pods.reads[p] - reads[p] == (0 if answers_cards else 1), (
                    late,
                    p,
                    rig.pods.reads,
                    reads,
                )


async def test_a_pod_restart_reloads_and_a_repeated_ready_counts_into_its_series(
    tmp_path: Path,
) -> None:
    # Loading is written at once, also after a restart (no grace for a loss of pods).
    async with Rig(tmp_path, status_settle_s=0.0, status_loss_grace_s=0.0) as rig:
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        c.adapter_changed(adapter(rig.volume, "a"))
        await until("Ready", lambda: rig.ready("a"))
        rig.pods.delay = 0.5  # long enough for the writer to see Loading
        for restarts in (1, 2):
            rig.pods.held["p1"] = {}  # the server restarted empty
            c.pod_changed(dataclasses.replace(pod("p1"), restarts=restarts))

            def loaded(n: int = 1 + restarts) -> bool:
                return len(rig.log) == n

            await until("loaded again", loaded)
            await until("Ready again", lambda: rig.api.phases("a")[-1] == "Ready")
        # Each Event is created once, and its repeats counted into its series.
        assert rig.api.reasons("a") == ["Ready", "Loading"]
        assert [count for _, count in rig.api.counted] == [2, 2, 3]


async def test_transient_load_failures_reach_degraded_then_ready(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        failures = rig.pods.fail[("p1", "a")] = [PodError("503 busy", permanent=False)] * 1000
        c.start()
        c.pod_changed(pod("p1"))
        c.pod_changed(pod("p2"))
        c.adapter_changed(adapter(rig.volume, "a"))
        await until("Degraded", lambda: "Degraded" in rig.api.phases("a"))
        failures.clear()  # the pod recovers
        await until("Ready", lambda: rig.ready("a"))
        phases = rig.api.phases("a")
        assert phases[-1] == "Ready" and "Degraded" in phases
        degraded = rig.api.status["a"][phases.index("Degraded")]
        assert degraded["readyPods"] == 1
        cond = next(x for x in degraded["conditions"] if x["type"] == "Degraded")
        assert cond["reason"] == "LoadRetrying" and "p1: 503 busy" in cond["message"]
        assert rig.api.reasons("a") == ["LoadRetrying", "Ready"]
        assert ("Warning", "LoadRetrying") in {(t, r) for _, t, r, _ in rig.api.events}


async def test_a_failed_load_among_many_loaded_is_retried_by_its_backoff_alone(
    tmp_path: Path,
) -> None:
    # The pass's retry delay is the least of its unsettled entries' (not the resync's): one
    # transient failure among 100 Ready adapters is tried again within its backoff.
    async with Rig(tmp_path, resync_s=600.0) as rig:
        c = rig.controller
        names = start_with_adapters(rig, 100)
        await until("every adapter Ready", lambda: all(rig.ready(n) for n in names))
        rig.pods.fail[("p1", "late")] = [PodError("503 busy", permanent=False)] * 2
        c.adapter_changed(adapter(rig.volume, "late", seed=7))
        await until("late Ready after two failures", lambda: rig.ready("late"), timeout=10)
        assert [e[1] for e in rig.log if e[0] == "load" and e[2] == "late"].count("p1") == 3
        (prec,) = [p for p in c.cache.pods.values() if p.info.name == "p1"]
        assert prec.unsettled == set()  # the settled entries left when the last pass looked


@pytest.mark.parametrize("answers_cards", [True, False], ids=["card-answers", "text-answers"])
async def test_a_load_answered_200_with_another_revision_is_a_failed_load(
    tmp_path: Path, answers_cards: bool
) -> None:
    # The pod's answer to a load (its card) is evidence as its list is: a 200 whose card shows
    # another revision counts as a failed load, retried with backoff up to Degraded.
    async with Rig(tmp_path) as rig:
        c = rig.controller
        rig.pods.answers_cards = answers_cards
        rig.pods.misloads[("p1", "a")] = "e" * 64
        c.start()
        c.pod_changed(pod("p1"))
        c.adapter_changed(adapter(rig.volume, "a"))
        await until("Degraded", lambda: "Degraded" in rig.api.phases("a"))
        degraded = rig.api.status["a"][rig.api.phases("a").index("Degraded")]
        cond = next(x for x in degraded["conditions"] if x["type"] == "Degraded")
        assert f"accepted the load (200) but lists revision {'e' * 64}" in cond["message"]
        del rig.pods.misloads[("p1", "a")]  # the pod loads the right file again
        await until("Ready", lambda: rig.ready("a"))


async def test_a_refusal_is_not_retried_until_the_spec_changes(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        rig.pods.fail[("p1", "a")] = [PodError("422 wrong shapes", permanent=True)]
        c.start()
        c.pod_changed(pod("p1"))
        body = adapter(rig.volume, "a")
        c.adapter_changed(body)
        await until("Failed", lambda: "Failed" in rig.api.phases("a"))
        await asyncio.sleep(1.0)  # three resyncs
        assert rig.log.count(("load", "p1", "a")) == 1
        assert rig.api.reasons("a") == ["LoadFailed"]
        body["spec"]["scale"] = 0.5
        body["metadata"]["generation"] = 2
        c.adapter_changed(body)
        await until("Ready", lambda: rig.ready("a"))
        assert rig.log.count(("load", "p1", "a")) == 2


async def test_deletion_unpublishes_before_any_pod_unloads(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        for p in ("p1", "p2"):
            c.pod_changed(pod(p))
        body = adapter(rig.volume, "a")
        c.adapter_changed(body)
        await until("Ready", lambda: rig.ready("a"))
        writes = len(rig.api.status["a"])
        current = rig.volume / NS / "a" / "current"
        assert current.is_symlink()
        assert rig.api.finalizers["a"] == ["lora.dev/finalizer"]
        rig.delete(body)
        await until("let go", lambda: ("ns", "a") not in c.adapters)
        steps = [e for e in rig.log if e[0] in ("unpublish", "unload")]
        assert steps[0] == ("unpublish", "a")
        assert sorted(steps[1:]) == [("unload", "p1", "a"), ("unload", "p2", "a")]
        assert not current.exists() and not os.path.lexists(current)
        assert rig.api.finalizers["a"] == []  # released once both pods unloaded it
        assert len(rig.api.status["a"]) == writes  # nothing written about a deleted adapter


async def test_a_deleted_adapter_is_let_go_by_every_actor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every actor registers itself as it is made, and each one, whichever, is told when an
    adapter is gone (the collector too: a revision may be free)."""
    async with Rig(tmp_path) as rig:
        c = rig.controller
        made = [a for a in vars(c).values() if isinstance(a, Actor)]
        assert len(made) >= 10 and {id(a) for a in made} == {id(a) for a in c.actors}
        told: list[Actor] = []
        for actor in c.actors:
            monkeypatch.setattr(actor, "forget", lambda key, a=actor: told.append(a))
        body = adapter(rig.volume, "a")
        c.adapter_changed(body)
        c.adapter_changed(body, deleted=True)
        assert told == c.actors and ("ns", "a") not in c.adapters


async def test_status_waits_until_every_ready_pod_has_reported(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        rig.pods.blocked["p2"] = asyncio.Event()
        c.start()
        c.pod_changed(pod("p1"))
        c.pod_changed(pod("p2"))
        c.adapter_changed(adapter(rig.volume, "a"))
        await until("p1 holds it", lambda: "a" in rig.pods.held.get("p1", {}))
        await asyncio.sleep(0.5)
        assert "a" not in rig.api.status  # 1/1 would be less than an earlier process saw
        rig.pods.blocked.pop("p2").set()
        await until("Ready", lambda: rig.ready("a"))
        assert rig.api.status["a"][-1]["ready"] == "2/2"


class FlakyStore(RecordingStore):
    """Fails staging `failures` times with a transient error, then stages for real."""

    def __init__(self, root: Path, log: list[tuple[str, ...]], failures: int) -> None:
        super().__init__(root, log)
        self.failures = failures

    async def stage(self, *args: Any, **kwargs: Any) -> publishing.StagedRevision:
        if self.failures:
            self.failures -= 1
            raise errors.SourceUnavailable("connection refused")
        return await super().stage(*args, **kwargs)


async def test_a_source_in_backoff_stays_degraded_with_one_event_per_change(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path, max_backoff_s=0.3, status_settle_s=0.0) as rig:
        c = rig.controller
        c.volume = FlakyStore(rig.volume, rig.log, failures=6)
        c.start()
        c.pod_changed(pod("p1"))
        c.adapter_changed(adapter(rig.volume, "a"))
        await until("Ready", lambda: rig.ready("a"))
        phases = rig.api.phases("a")
        first_degraded = phases.index("Degraded")
        # Degraded through every retry, never back to Staging; then Loading (if the writer
        # sees it) and Ready.
        after = phases[first_degraded:]
        order = ["Degraded", "Loading", "Ready"]
        assert set(after) <= set(order) and after == sorted(after, key=order.index)
        assert set(phases[:first_degraded]) <= {"Staging"}
        # One Event per distinct change (Loading's, if the writer saw it, besides).
        events = [(t, r) for _, t, r, _ in rig.api.events if r != "Loading"]
        assert events == [
            ("Warning", "SourceUnavailable"),
            ("Warning", "SourceUnavailable"),
            ("Normal", "Ready"),
        ]
        degraded = rig.api.status["a"][first_degraded]
        message = next(x for x in degraded["conditions"] if x["type"] == "Degraded")["message"]
        assert "connection refused" in message and "attempt" in message


async def test_a_standby_acts_only_once_the_active_replica_stops_renewing(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path, standalone=False, peering="p", peering_priority=0) as rig:
        c = rig.controller
        leftover = rig.volume / ".tmp" / "download-x.part"
        leftover.parent.mkdir()
        leftover.write_bytes(b"the active replica is writing this")
        now = datetime.datetime.now(datetime.UTC)
        alive = {"priority": 5, "lifetime": 60, "lastseen": now.isoformat()}
        rig.api.peering = {"other": alive, "me": {**alive, "priority": 0}}
        c.start()
        c.pod_changed(pod("p1"))
        c.adapter_changed(adapter(rig.volume, "a"))
        await asyncio.sleep(0.5)
        assert not c.active.is_set()
        assert leftover.exists() and rig.log == [] and rig.api.status == {}
        dead = {**alive, "lastseen": (now - datetime.timedelta(seconds=61)).isoformat()}
        await rig.api.peering_changes.put({"other": dead, "me": alive})
        await until("Ready", lambda: rig.ready("a"))
        assert not leftover.exists()
        # The other replica is back and wins: this one stops acting.
        await rig.api.peering_changes.put({"other": alive, "me": {**alive, "priority": 0}})
        await until("standby", lambda: not c.active.is_set())
        assert all(p.task is None for p in c.pods.values())


def seeded_body(
    generation: int, staged_reason: str, staged_status: str, observed: int
) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "a", "generation": generation},
        "spec": {"baseModel": "sd", "source": {"uri": "/v/ns/a"}},
        "status": {
            "phase": "Failed" if staged_status == "False" else "Ready",
            "observedGeneration": observed,
            "staged": {"sha256": SHA, "sizeBytes": 3, "path": "/v/ns/a/revisions/" + SHA},
            "conditions": [
                {"type": "Staged", "status": staged_status, "reason": staged_reason, "message": "m"}
            ],
        },
    }


@pytest.mark.parametrize("active", [False, True], ids=["standby", "active"])
async def test_a_permanent_failure_of_the_current_generation_survives_a_restart(
    tmp_path: Path, active: bool
) -> None:
    c = Controller(OperatorConfig(volume_root=tmp_path), api=FakeApi(), identity="me")
    if active:
        c.set_active(True)
    b = seeded_body(
        generation=2, staged_reason="ChecksumMismatch", staged_status="False", observed=2
    )
    c.adapter_changed(b)
    rec = c.adapters[("ns", "a")]
    assert (rec.staging.state.permanent, rec.staging.state.error_reason) == (
        True,
        "ChecksumMismatch",
    )
    assert rec.staging.task is None  # not staged again
    info = adapter_info(b)
    assert summarise(info, rec.staging.state, []).phase == "Failed"
    # Generation 1's revision is still on the volume: resuming does not download again.
    assert not needs_staging(info, rec.staging.state.observed_generation, volume_current=SHA)
    assert rec.status.headline == ("Failed", None)


async def test_a_staged_generation_is_seeded_as_staged(tmp_path: Path) -> None:
    c = Controller(OperatorConfig(volume_root=tmp_path), api=FakeApi(), identity="me")
    c.adapter_changed(
        seeded_body(generation=3, staged_reason="Staged", staged_status="True", observed=3)
    )
    state = c.adapters[("ns", "a")].staging.state
    assert state.permanent is False
    assert state.path == "/v/ns/a/revisions/" + SHA
    assert state.staged is not None and state.staged.sha256 == SHA


def test_the_fakes_speak_the_real_interfaces() -> None:
    """The fakes above stand in for our own seams: keep them honest about the signatures."""
    import inspect

    from lora_operator.edges import podclient

    for fake, real in ((FakePods, podclient.PodClient), (FakeApi, kube.KubeApi)):
        for name in (
            "models",
            "load",
            "unload",
            "patch_adapter_status",
            "create_event",
            "remove_annotation",
        ):
            if hasattr(real, name):
                assert list(inspect.signature(getattr(fake, name)).parameters) == list(
                    inspect.signature(getattr(real, name)).parameters
                ), name


async def test_the_target_is_published_with_the_adapter_and_after_a_restart(
    tmp_path: Path,
) -> None:
    selector = {"matchLabels": {"tier": "gpu"}}
    target_file = layout.target_file(layout.namespace_root(tmp_path / "volume", NS), "a")
    async with Rig(tmp_path) as rig:
        rig.controller.start()
        body = adapter(rig.volume, "a", selector=selector)
        rig.controller.adapter_changed(body)
        await until("staged", lambda: any(s.get("staged") for s in rig.api.status.get("a", [])))
        assert targeting.parse_target(target_file.read_text()) == targeting.Target(
            "sd", targeting.parse_selector(selector)
        )
        status = next(s for s in reversed(rig.api.status["a"]) if s.get("staged"))
    # Staged by a release that published no target: a restarted operator publishes it without
    # staging again.
    target_file.unlink()
    restarted, _ = rig.restarted()
    restarted.start()
    try:
        restarted.adapter_changed({**body, "status": status})
        await until("target published", target_file.exists)
        assert restarted.adapters[(NS, "a")].staging.task is None
    finally:
        await restarted.stop()


async def test_an_unreachable_api_server_while_reading_the_secret_is_retried(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path) as rig:
        rig.api.secret_errors = [aiohttp.ClientConnectionError("connection refused")]
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        body = adapter(rig.volume, "a")
        body["spec"]["source"]["secretRef"] = {"name": "creds"}
        c.adapter_changed(body)
        await until("Ready after a retry", lambda: rig.ready("a"))
        assert rig.api.secret_errors == []


async def test_a_secret_that_does_not_consent_fails_the_adapter_and_is_never_used(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path) as rig:
        rig.api.secrets["db"] = kube.SecretRead({"AUTHORIZATION": "Bearer s3cret"}, {}, {})
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        body = adapter(rig.volume, "a")
        body["spec"]["source"]["secretRef"] = {"name": "db"}
        c.adapter_changed(body)
        await until("Failed", lambda: "Failed" in rig.api.phases("a"))
        status = rig.api.status["a"][-1]
        staged = next(x for x in status["conditions"] if x["type"] == "Staged")
        assert staged["reason"] == "SecretNotConsented"
        assert consent.CONSENT_KEY in staged["message"]
        assert "s3cret" not in str(rig.api.status) + str(rig.api.events)
        assert rig.log == []  # nothing staged, nothing loaded


async def test_a_labelled_pod_that_is_not_the_releases_gets_no_call_and_an_event(
    tmp_path: Path,
) -> None:
    async with Rig(
        tmp_path, inference_namespaces=(NS,), inference_service_account="inference"
    ) as rig:
        c = rig.controller
        c.start()
        trusted = dataclasses.replace(pod("p1"), service_account="inference")
        c.pod_changed(trusted)
        c.pod_changed(pod("lookalike"))  # the default ServiceAccount
        c.adapter_changed(adapter(rig.volume, "a"))
        await until("Ready", lambda: rig.ready("a"))
        await until("an Event", lambda: "UntrustedInferencePod" in rig.api.reasons("lookalike"))
        c.pod_changed(pod("lookalike"))  # reported once per pod
        await asyncio.sleep(0.5)
        assert rig.api.status["a"][-1]["ready"] == "1/1"
        assert "lookalike" not in rig.pods.reads and ("load", "lookalike", "a") not in rig.log
        (note,) = [n for o, _, _, n in rig.api.events if o == "lookalike"]
        assert "ServiceAccount 'default'" in note and "no token" in note
