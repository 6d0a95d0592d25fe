"""From the controller's records to phase, conditions and .status (pure)."""

from __future__ import annotations

from lora_operator import model
from lora_operator.status import PodEntry, StagingState, render, summarise

SHA = "a" * 64


def adapter(namespace: str = "ns") -> model.AdapterInfo:
    return model.adapter_info(
        {
            "metadata": {"namespace": namespace, "name": "pixel", "generation": 2},
            "spec": {"baseModel": "sd"},
        }
    )


def pod(name: str) -> model.PodInfo:
    return model.pod_info(
        {
            "metadata": {"namespace": "ns", "name": name, "uid": name},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )


def staged() -> StagingState:
    return StagingState(staged=model.StagedRef(SHA, 100), path="/v/ns/pixel/revisions/" + SHA)


def loaded() -> PodEntry:
    return PodEntry(state="Loaded", revision=SHA)


def conditions(s: object) -> dict[str, str]:
    return {c.type: c.status for c in s.conditions}  # type: ignore[attr-defined]


def test_ready_only_when_every_targeted_pod_reports_the_staged_revision() -> None:
    s = summarise(adapter(), staged(), [(pod("a"), loaded()), (pod("b"), loaded())])
    assert (s.phase, s.ready, s.desired) == ("Ready", 2, 2)
    assert conditions(s) == {"Staged": "True", "Ready": "True", "Degraded": "False"}
    old = PodEntry(state="Loaded", revision="b" * 64)  # still on the previous revision
    s = summarise(adapter(), staged(), [(pod("a"), loaded()), (pod("b"), old)])
    assert (s.phase, s.ready) == ("Loading", 1)
    assert "waiting for b" in s.message


def test_no_pods_is_pending_and_says_which_pods_would_count() -> None:
    s = summarise(adapter(), staged(), [])
    assert (s.phase, s.ready, s.desired) == ("Pending", 0, 0)
    assert "serves base model 'sd'" in s.message


def test_staging_phases() -> None:
    assert summarise(adapter(), StagingState(), []).phase == "Pending"
    s = summarise(adapter(), StagingState(in_progress=True, bytes_so_far=42), [])
    assert s.phase == "Staging" and "42 bytes" in s.message
    failed = StagingState(permanent=True, error_reason="ChecksumMismatch", error_message="fix it")
    s = summarise(adapter(), failed, [])
    assert (s.phase, s.message) == ("Failed", "fix it")
    assert s.conditions[0].reason == "ChecksumMismatch"
    retrying = StagingState(degraded=True, error_reason="SourceUnavailable", error_message="503")
    s = summarise(adapter(), retrying, [])
    assert s.phase == "Degraded" and conditions(s)["Degraded"] == "True"


def test_a_permanent_pod_refusal_is_failed_and_a_persistent_transient_one_degraded() -> None:
    refused = PodEntry(state="Failed", permanent=True, last_error="422: wrong shapes")
    s = summarise(adapter(), staged(), [(pod("a"), loaded()), (pod("b"), refused)])
    assert s.phase == "Failed" and "b: 422: wrong shapes" in s.message
    flaky = PodEntry(state="Failed", permanent=False, last_error="timeout")
    s = summarise(adapter(), staged(), [(pod("a"), loaded()), (pod("b"), flaky)])
    assert s.phase == "Degraded" and "timeout" in s.message
    assert s.ready == 1


def test_a_restaging_spec_keeps_serving_the_staged_revision() -> None:
    state = staged()
    state.in_progress = True
    s = summarise(adapter(), state, [(pod("a"), loaded())])
    assert (s.phase, s.ready) == ("Staging", 1)
    assert conditions(s)["Ready"] == "True"


def test_render_keeps_transition_times_of_unchanged_conditions() -> None:
    targeted = [(pod("a"), loaded())]
    s = summarise(adapter(), staged(), targeted)
    first = render(adapter(), staged(), targeted, s, [], "T1")
    again = render(adapter(), staged(), targeted, s, first["conditions"], "T2")
    assert [c["lastTransitionTime"] for c in again["conditions"]] == ["T1", "T1", "T1"]
    assert again["ready"] == "1/1" and again["pods"][0] == {
        "name": "a",
        "state": "Loaded",
        "ip": "10.0.0.1",
        "revision": SHA,
    }
    assert again["staged"]["sha256"] == SHA
    s2 = summarise(adapter(), staged(), [(pod("a"), PodEntry())])
    changed = render(adapter(), staged(), [(pod("a"), PodEntry())], s2, first["conditions"], "T3")
    times = {c["type"]: c["lastTransitionTime"] for c in changed["conditions"]}
    assert times == {"Staged": "T1", "Ready": "T3", "Degraded": "T1"}
