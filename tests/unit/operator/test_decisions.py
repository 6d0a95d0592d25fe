"""The decisions the controller once made inline, now pure: what a pod should hold
(planning.plan_wants), placement's demands, the autoscale policy, resuming a record from status,
the revisions collection keeps, and the rollout's status (canary)."""

from __future__ import annotations

from typing import Any

import pytest
from lora_operator.rules import autoscale, canary, gc, placement, planning, resume, rollout
from lora_operator.rules.model import AdapterInfo, PodInfo, StagedRef, adapter_info, pod_info
from lora_operator.rules.planning import Candidate, Card, PodReport, Want
from lora_operator.rules.podstate import PodEntry

SHA1, SHA2 = "1" * 64, "2" * 64
STAGED = StagedRef(sha256=SHA1, size=1)


def card(name: str, sha: str, hits: int | None = None, adapter: str | None = None) -> Card:
    return Card(name=name, revision=sha, scale=1.0, pinned=False, hits=hits, adapter=adapter)


def info(name: str = "a", *, deleting: bool = False, **spec: Any) -> AdapterInfo:
    meta: dict[str, Any] = {"namespace": "ns", "name": name, "uid": name, "generation": 1}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return adapter_info({"metadata": meta, "spec": {"baseModel": "sd", **spec}})


def pod(name: str = "p1", **labels: str) -> PodInfo:
    return pod_info(
        {
            "metadata": {"namespace": "ns", "name": name, "uid": name, "labels": labels},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )


def tiers(slots: int = 4, cards: tuple[Card, ...] = ()) -> PodReport:
    return PodReport(
        base_model="sd", cards={c.name: c for c in cards}, max_loras=2, max_cpu_loras=slots
    )


# -- planning.plan_wants ----------------------------------------------------------------------


def test_a_staged_adapter_is_wanted_and_an_unstaged_one_kept() -> None:
    wants, keep = planning.plan_wants(
        pod(), "sd", [Candidate(info("a"), STAGED), Candidate(info("b"), None)], None
    )
    assert wants == {"a": Want(name="a", sha256=SHA1, scale=1.0, pinned=False)}
    assert keep == {"b"}


@pytest.mark.parametrize(
    ("unpublished", "kept"), [(False, {"a"}), (True, set())], ids=["publishing", "unpublished"]
)
def test_a_deleted_adapter_is_kept_until_it_is_unpublished(
    unpublished: bool, kept: set[str]
) -> None:
    c = Candidate(info("a", deleting=True), STAGED, unpublished=unpublished)
    assert planning.plan_wants(pod(), "sd", [c], None) == ({}, kept)


def test_another_base_model_or_selector_is_not_wanted() -> None:
    c = Candidate(info("a", selector={"matchLabels": {"x": "y"}}), STAGED)
    assert planning.plan_wants(pod(), "sd", [c], None) == ({}, set())
    assert planning.plan_wants(pod(x="y"), "other", [c], None) == ({}, set())
    assert set(planning.plan_wants(pod(x="y"), "sd", [c], None)[0]) == {"a"}


def test_a_placed_adapter_waits_for_its_placement_then_goes_only_where_placed() -> None:
    c = Candidate(info("a", replicas=1), STAGED)
    assert planning.plan_wants(pod("p1"), "sd", [c], None) == ({}, {"a"})
    placed = {"a": placement.Placed(pods=("p2",), wanted=1)}
    assert planning.plan_wants(pod("p1"), "sd", [c], placed) == ({}, set())
    assert set(planning.plan_wants(pod("p2"), "sd", [c], placed)[0]) == {"a"}


def test_a_pod_the_placement_did_not_count_keeps_its_placed_adapters() -> None:
    # p1 was away (not Ready) when the placement was made: back, it keeps what it holds until
    # a placement counts it, instead of unloading it and loading it again a moment later.
    c = Candidate(info("a", replicas=1), STAGED)
    placed = {"a": placement.Placed(pods=("p2",), wanted=1)}
    assert planning.plan_wants(pod("p1"), "sd", [c], placed, over={"p2"}) == ({}, {"a"})
    assert planning.plan_wants(pod("p1"), "sd", [c], placed, over={"p1", "p2"}) == ({}, set())
    assert set(planning.plan_wants(pod("p2"), "sd", [c], placed, over={"p2"})[0]) == {"a"}


def test_a_rollout_wants_the_name_at_its_revision_and_the_canary_under_its_alias() -> None:
    r = rollout.Rollout(stable=SHA1, canary=SHA2, state=rollout.State.PROGRESSING)
    wants, _ = planning.plan_wants(
        pod(), "sd", [Candidate(info("a", pinned=True), STAGED, r)], None
    )
    alias = rollout.alias("a", SHA2)
    assert wants == {
        "a": Want(name="a", sha256=SHA1, scale=1.0, pinned=True),
        alias: Want(name=alias, sha256=SHA2, scale=1.0, pinned=False, adapter="a"),
    }
    aborted = rollout.Rollout(stable=SHA1, canary=SHA2, state=rollout.State.ABORTED)
    wants, _ = planning.plan_wants(pod(), "sd", [Candidate(info("a"), STAGED, aborted)], None)
    assert set(wants) == {"a"}


# -- placement.plan_demands -------------------------------------------------------------------


def test_demands_name_their_candidates_and_skip_deleted_adapters() -> None:
    reports = {"p1": (pod("p1"), tiers()), "p2": (pod("p2", x="y"), tiers(slots=0))}
    adapters = [
        info("a", replicas=2),
        info("b", selector={"matchLabels": {"x": "y"}}),
        info("c", deleting=True, replicas=1),
    ]
    capacities, demands = placement.plan_demands(adapters, reports, lambda i: 7)
    assert [c.name for c in capacities] == ["p1", "p2"]
    assert [(d.name, d.replicas, d.candidates) for d in demands] == [
        ("a", 7, ("p1", "p2")),
        ("b", None, ("p2",)),
    ]


def test_placement_reads_the_base_model_and_the_capacity_only() -> None:
    hit = card("a", SHA1, hits=3)
    assert placement.inputs(tiers()) == placement.inputs(tiers())
    assert placement.inputs(tiers(cards=(hit,))) == placement.inputs(tiers())
    assert placement.inputs(tiers(slots=5)) != placement.inputs(tiers())


# -- autoscale --------------------------------------------------------------------------------

AUTO = {"minReplicas": 2, "maxReplicas": 5, "targetRequestsPerSecond": 1.5}


def test_replicas_come_from_the_spec_the_scale_or_the_minimum() -> None:
    assert autoscale.replicas(info(replicas=3), None) == 3
    assert autoscale.replicas(info(autoscale=AUTO), None) == 2
    assert autoscale.replicas(info(autoscale=AUTO), autoscale.Scale(4)) == 4
    with pytest.raises(ValueError):
        autoscale.replicas(info(), None)


def test_the_policy_follows_the_spec_and_a_restored_scale_is_clamped() -> None:
    spec = info(autoscale=AUTO).autoscale
    assert spec is not None
    policy = autoscale.policy_of(spec)
    assert (policy.min_replicas, policy.max_replicas, policy.target_rps) == (2, 5, 1.5)
    assert autoscale.restore(spec, 9) == autoscale.Scale(5)
    assert autoscale.restore(spec, "9") is None
    assert autoscale.restore(None, 3) is None


def test_hit_counts_take_the_name_and_its_alias_on_every_pod() -> None:
    alias = rollout.alias("a", SHA2)
    cards = (
        card("a", SHA1, hits=3, adapter="a"),
        card(alias, SHA2, hits=1, adapter="a"),
        card("b", SHA1, hits=8, adapter="b"),
        card("c", SHA1, adapter="a"),  # no counter (vLLM)
    )
    counts = autoscale.hit_counts("a", [("p1", tiers(cards=cards)), ("p2", tiers())])
    assert counts == {"p1/a": 3, f"p1/{alias}": 1}


# -- resume.plan_resume -----------------------------------------------------------------------


def test_a_new_adapter_resumes_from_nothing() -> None:
    r = resume.plan_resume(info(), None)
    assert (r.written, r.written_headline, r.rollout, r.scale, r.recorded_loads) == (
        None,
        None,
        None,
        None,
        {},
    )
    assert not r.staging.permanent


def test_a_status_resumes_what_it_recorded() -> None:
    status = {
        "phase": "Ready",
        "observedGeneration": 1,
        "replicas": 3,
        "staged": {"path": "/v/x", "stagedAt": "t"},
        "conditions": [{"type": "Staged", "status": "False", "reason": "R", "message": "m"}],
        "pods": [{"name": "p1", "revision": SHA1, "loadedAt": "t1", "loadSeconds": 0.5}, "x"],
        "rollout": {
            "state": "Progressing",
            "stable": {"revision": SHA1},
            "canary": {"revision": SHA2},
        },
    }
    r = resume.plan_resume(info(autoscale=AUTO), status)
    assert (r.staging.permanent, r.staging.error_reason, r.staging.path) == (True, "R", "/v/x")
    assert r.written == status and r.written_headline == ("Ready", None)
    assert r.scale == autoscale.Scale(3)
    assert r.rollout is not None and r.rollout.canary == SHA2
    assert r.recorded_loads == {"p1": (SHA1, "t1", 0.5)}
    # A Staged=False of an older generation is retried, not taken as permanent.
    older = resume.plan_resume(info(), {**status, "observedGeneration": 0})
    assert not older.staging.permanent


# -- gc.revisions_in_use ----------------------------------------------------------------------


def test_collection_keeps_what_pods_hold_and_every_rollouts_stable_revision() -> None:
    in_use = gc.revisions_in_use([("ns", {("a", SHA1)}), ("ns2", [])], [("ns", "b", SHA2)])
    assert in_use == {gc.RevisionRef("ns", "a", SHA1), gc.RevisionRef("ns", "b", SHA2)}


# -- canary -----------------------------------------------------------------------------------


def loaded(sha: str) -> PodEntry:
    return PodEntry(state="Loaded", revision=sha)


def test_the_rollout_status_counts_each_revision_and_names_a_refusal() -> None:
    plan = {"steps": [{"weight": 10}, {"weight": 50}]}
    a = info("a", rollout=plan)
    r = rollout.Rollout(stable=SHA1, canary=SHA2, state=rollout.State.PROGRESSING)
    targeted = [(pod("p1"), loaded(SHA1)), (pod("p2"), loaded(SHA1))]
    refused = PodEntry(state="Failed", last_error="bad", refused=Want("x", SHA2, 1.0, False))
    body = canary.render_status(r, a, targeted, {"p1": loaded(SHA2), "p2": refused})
    assert body is not None
    assert (body["stable"]["readyPods"], body["canary"]["readyPods"]) == (2, 1)
    assert "p2: bad" in body["message"]
    assert canary.render_status(None, a, targeted, {}) is None


def test_readiness_needs_every_targeted_pod() -> None:
    r = rollout.Rollout(stable=SHA1, canary=SHA2)
    targeted = [(pod("p1"), loaded(SHA2)), (pod("p2"), loaded(SHA1))]
    assert canary.readiness(r, targeted, {"p1": loaded(SHA2)}) == (False, False)
    both = {"p1": loaded(SHA2), "p2": loaded(SHA2)}
    assert canary.readiness(r, targeted, both) == (True, False)
    assert canary.readiness(r, targeted[:1], both) == (True, True)
    assert canary.readiness(r, [], both) == (False, False)


def test_needs_staging_unless_the_volume_holds_this_generations_revision() -> None:
    staged = adapter_info(
        {
            "metadata": {"namespace": "ns", "name": "a", "generation": 2},
            "spec": {"baseModel": "sd"},
            "status": {"staged": {"sha256": SHA1}},
        }
    )
    assert not resume.needs_staging(staged, 2, SHA1)
    assert resume.needs_staging(staged, 1, SHA1)
    assert resume.needs_staging(staged, 2, SHA2)
