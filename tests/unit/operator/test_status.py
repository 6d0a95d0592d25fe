"""From the controller's records to phase, conditions, .status and when to write it (pure)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_operator.rules import model, resume
from lora_operator.rules.podstate import PodEntry, PodState
from lora_operator.rules.status import StagingState, Summary, summarise
from lora_operator.rules.statuswrite import (
    MAX_LISTED_PODS,
    WritePolicy,
    fair_order,
    pods_lost_only,
    render,
    stored,
    write_delay,
)
from lora_volume import description, formats

SHA = "a" * 64
POLICY = WritePolicy(settle_s=3.0, progress_s=10.0)


def adapter(namespace: str = "ns", status: dict[str, object] | None = None) -> model.AdapterInfo:
    return model.adapter_info(
        {
            "metadata": {"namespace": namespace, "name": "pixel", "generation": 2},
            "spec": {"baseModel": "sd"},
            "status": status or {},
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


def conditions(s: Summary) -> dict[str, str]:
    return {c.type: c.status for c in s.conditions}


def test_ready_only_when_every_targeted_pod_reports_the_staged_revision() -> None:
    s = summarise(adapter(), staged(), [(pod("a"), loaded()), (pod("b"), loaded())])
    assert (s.phase, s.reason, s.ready, s.desired) == ("Ready", "Ready", 2, 2)
    assert s.message == "Loaded on 2/2 pods (revision aaaaaaaaaaaa)"
    assert conditions(s) == {"Staged": "True", "Ready": "True", "Degraded": "False"}
    old = PodEntry(state="Loaded", revision="b" * 64)  # still on the previous revision
    s = summarise(adapter(), staged(), [(pod("a"), loaded()), (pod("b"), old)])
    assert (s.phase, s.ready) == ("Loading", 1)
    assert "Loaded on 1/2 pods" in s.message and "waiting for b" in s.message
    assert f"sha256 {SHA}" in s.message  # the Loading Event says what was staged


def test_a_healthy_degraded_condition_says_why() -> None:
    s = summarise(adapter(), staged(), [(pod("a"), loaded())])
    degraded = next(c for c in s.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("False", "AsExpected")
    assert degraded.message == "no staging or load failure is being retried"


def test_no_pods_is_pending_and_says_which_pods_would_count() -> None:
    s = summarise(adapter(), staged(), [])
    assert (s.phase, s.reason, s.ready, s.desired) == ("Pending", "NoPods", 0, 0)
    assert "serves base model 'sd'" in s.message


def test_staging_phases() -> None:
    assert summarise(adapter(), StagingState(), []).headline == ("Pending", "NotStaged")
    s = summarise(adapter(), StagingState(in_progress=True, bytes_so_far=42), [])
    assert s.headline == ("Staging", "Staging") and "42 bytes" in s.message
    failed = StagingState(permanent=True, error_reason="ChecksumMismatch", error_message="fix it")
    s = summarise(adapter(), failed, [])
    assert (s.phase, s.reason, s.message) == ("Failed", "ChecksumMismatch", "fix it")
    assert s.warning


def test_a_source_in_backoff_never_flips_back_to_staging_or_pending() -> None:
    """Each failure and each retry: the phase only moves forward, and the message says when
    the next attempt is."""
    state = StagingState(in_progress=True)
    seen = []
    for attempt in range(1, 7):
        state.failed(
            permanent=False, reason="SourceUnavailable", message="refused", next_at=f"T{attempt}"
        )
        waiting = summarise(adapter(), state, [], retry_bound=4)
        state.in_progress = True  # the retry runs
        running = summarise(adapter(), state, [], retry_bound=4)
        seen += [waiting.headline, running.headline]
        assert f"attempt {attempt + 1} at T{attempt}" in waiting.message
        assert f"attempt {attempt + 1} is running" in running.message
    assert seen == [("Staging", "SourceUnavailable")] * 6 + [("Degraded", "SourceUnavailable")] * 6
    degraded = next(c for c in running.conditions if c.type == "Degraded")
    assert degraded.status == "True" and "failed 6 times in a row" in degraded.message


def test_a_permanent_pod_refusal_is_failed_and_a_persistent_transient_one_degraded() -> None:
    refused = PodEntry(state="Failed", refused=object(), last_error="422: wrong shapes")  # type: ignore[arg-type]
    s = summarise(adapter(), staged(), [(pod("a"), loaded()), (pod("b"), refused)])
    assert (s.phase, s.reason) == ("Failed", "LoadFailed")
    assert s.message.startswith("Failed on 1/2 pods: b: 422: wrong shapes")
    flaky = PodEntry(state="Failed", attempts=4, last_error="timeout")
    s = summarise(adapter(), staged(), [(pod("a"), loaded()), (pod("b"), flaky)])
    assert (s.phase, s.reason) == ("Degraded", "LoadRetrying") and "timeout" in s.message
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
    assert again["unlistedPods"] is None
    s2 = summarise(adapter(), staged(), [(pod("a"), PodEntry())])
    changed = render(adapter(), staged(), [(pod("a"), PodEntry())], s2, first["conditions"], "T3")
    times = {c["type"]: c["lastTransitionTime"] for c in changed["conditions"]}
    assert times == {"Staged": "T1", "Ready": "T3", "Degraded": "T1"}


STATES: list[PodState] = ["Pending", "Loading", "Loaded", "Failed"]


def test_the_status_of_500_pods_stays_small() -> None:
    long_error = "x" * 5000
    targeted = []
    for i in range(500):
        state = STATES[i % 4] if i < 40 else "Loaded"
        entry = PodEntry(
            state=state,
            revision=SHA,
            attempts=4 if state == "Failed" else 0,
            last_error=long_error if state in ("Failed", "Pending") else None,
            loaded_at="2026-01-01T00:00:00Z",
            load_seconds=0.123,
        )
        targeted.append((pod(f"inference-{i:03d}-abcdefghij"), entry))
    s = summarise(adapter(), staged(), targeted)
    body = render(adapter(), staged(), targeted, s, [], "2026-01-01T00:00:00Z")
    size = len(json.dumps(body))
    assert size < 24 * 1024, size  # the API server's limit is 1.5 MiB per object
    assert len(body["pods"]) == MAX_LISTED_PODS
    # The 30 pods not loaded are all listed (the Loaded ones fill up); every pod is either
    # listed or counted.
    assert sum(p["state"] != "Loaded" for p in body["pods"]) == 30
    assert sum(body["unlistedPods"].values()) + MAX_LISTED_PODS == 500
    assert body["desiredPods"] == 500 and body["readyPods"] == 460 + 10
    assert max(len(c["message"]) for c in body["conditions"]) < 600


@given(st.lists(st.sampled_from(STATES), max_size=200))
def test_listed_and_unlisted_pods_account_for_every_pod(states: list[PodState]) -> None:
    targeted = [(pod(f"p{i:03d}"), PodEntry(state=s)) for i, s in enumerate(states)]
    s = summarise(adapter(), staged(), targeted)
    body = render(adapter(), staged(), targeted, s, [], "T")
    counted = {p["state"]: 0 for p in body["pods"]}
    for p in body["pods"]:
        counted[p["state"]] += 1
    for state, n in (body["unlistedPods"] or {}).items():
        counted[state] = counted.get(state, 0) + n
    assert counted == {state: states.count(state) for state in set(states)}
    assert [p["name"] for p in body["pods"]] == sorted(p["name"] for p in body["pods"])


def summary(phase: str, reason: str) -> Summary:
    return Summary(phase=phase, reason=reason, message="m", desired=1, ready=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("written", "now", "since_headline", "since_write", "expected"),
    [
        pytest.param(None, ("Ready", "Ready"), 0.0, 0.0, 0.0, id="ready-at-once"),
        pytest.param(None, ("Failed", "NotALora"), 0.0, 0.0, 0.0, id="failed-at-once"),
        pytest.param(None, ("Pending", "NoPods"), 0.0, 0.0, 0.0, id="no-pods-at-once"),
        pytest.param(None, ("Staging", "SourceUnavailable"), 0.0, 0.0, 0.0, id="a-failure-at-once"),
        pytest.param(None, ("Loading", "Loading"), 1.0, 1.0, 2.0, id="loading-settles"),
        pytest.param(None, ("Staging", "Staging"), 5.0, 5.0, 0.0, id="long-staging"),
        pytest.param(
            ("Loading", "Loading"), ("Loading", "Loading"), 9.0, 4.0, 6.0, id="progress-paced"
        ),
        pytest.param(("Ready", None), ("Ready", "Ready"), 0.0, 12.0, 0.0, id="taken-over-progress"),
        pytest.param(
            ("Ready", None), ("Loading", "Loading"), 0.0, 0.0, 3.0, id="taken-over-new-phase"
        ),
    ],
)
def test_write_delay(
    written: tuple[str, str | None] | None,
    now: tuple[str, str],
    since_headline: float,
    since_write: float,
    expected: float,
) -> None:
    body = {"phase": now[0], "n": 2}
    previous = None if written is None else {"phase": written[0], "n": 1}
    delay = write_delay(
        previous,
        written,
        body,
        summary(*now),
        since_headline=since_headline,
        since_write=since_write,
        policy=POLICY,
    )
    assert delay == expected


def placed_status(
    phase: str, ready: int, pods: list[str] | None, generation: int = 1
) -> dict[str, object]:
    return {
        "phase": phase,
        "readyPods": ready,
        "placedPods": pods,
        "conditions": [{"type": "Ready", "observedGeneration": generation}],
    }


READY_ON_2 = placed_status("Ready", 2, ["p1", "p2"])


def counted(phase: str, reason: str, ready: int) -> Summary:
    return Summary(phase=phase, reason=reason, message="m", desired=2, ready=ready)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "now", "lost"),
    [
        pytest.param(placed_status("Pending", 0, []), ("Pending", "NoPods", 0), True, id="no-pods"),
        pytest.param(
            placed_status("Degraded", 1, ["p2"]),
            ("Degraded", "FewerPodsThanReplicas", 1),
            True,
            id="fewer-pods",
        ),
        pytest.param(placed_status("Ready", 1, ["p2"]), ("Ready", "Ready", 1), True, id="ready-1"),
        pytest.param(
            placed_status("Loading", 1, ["p2", "p3"]),
            ("Loading", "Loading", 1),
            False,
            id="moved-to-a-new-pod",
        ),
        pytest.param(
            placed_status("Pending", 0, [], generation=2),
            ("Pending", "NoPods", 0),
            False,
            id="spec-changed",
        ),
        pytest.param(
            placed_status("Degraded", 1, ["p1", "p2"]),
            ("Degraded", "LoadRetrying", 1),
            False,
            id="a-failure",
        ),
        pytest.param(
            placed_status("Ready", 2, ["p1", "p2"]), ("Ready", "Ready", 2), False, id="as-many"
        ),
    ],
)
def test_a_loss_of_pods_only_is_told_apart(
    body: dict[str, object], now: tuple[str, str, int], lost: bool
) -> None:
    assert pods_lost_only(READY_ON_2, body, counted(*now)) is lost


@pytest.mark.parametrize(
    "written",
    [
        pytest.param(None, id="nothing-written"),
        pytest.param({"readyPods": "2", "conditions": "x"}, id="not-numbers"),
        pytest.param({"readyPods": 2, "conditions": [None]}, id="no-generation"),
    ],
)
def test_a_written_status_that_does_not_read_as_one_has_lost_no_pods(written: object) -> None:
    """What was written cannot be compared: the new status is written as usual, at once."""
    body = placed_status("Pending", 0, [])
    assert not pods_lost_only(written, body, counted("Pending", "NoPods", 0))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "now", "since_differs", "since_write", "expected"),
    [
        # Pods gone: written once the status has differed for the grace, counted from then.
        pytest.param(
            placed_status("Pending", 0, []), ("Pending", "NoPods"), 0.0, 100.0, 15.0, id="grace"
        ),
        pytest.param(
            placed_status("Pending", 0, []), ("Pending", "NoPods"), 11.0, 100.0, 4.0, id="waited"
        ),
        pytest.param(
            placed_status("Pending", 0, []), ("Pending", "NoPods"), 20.0, 100.0, 0.0, id="lasting"
        ),
        # The same headline: the grace, or the pace of progress if that is longer.
        pytest.param(
            placed_status("Ready", 1, ["p2"]), ("Ready", "Ready"), 0.0, 100.0, 15.0, id="ready-1"
        ),
        pytest.param(
            placed_status("Ready", 1, ["p2"]), ("Ready", "Ready"), 14.0, 2.0, 8.0, id="paced"
        ),
        # Not only a loss: as usual.
        pytest.param(
            placed_status("Pending", 0, [], generation=2),
            ("Pending", "NoPods"),
            0.0,
            100.0,
            0.0,
            id="spec-changed",
        ),
    ],
)
def test_a_loss_of_pods_waits_for_the_grace(
    body: dict[str, object],
    now: tuple[str, str],
    since_differs: float,
    since_write: float,
    expected: float,
) -> None:
    policy = WritePolicy(settle_s=3.0, progress_s=10.0, loss_grace_s=15.0)
    delay = write_delay(
        READY_ON_2,
        ("Ready", "Ready"),
        body,
        counted(now[0], now[1], int(body["readyPods"])),  # type: ignore[call-overload]
        since_headline=0.0,
        since_write=since_write,
        since_differs=since_differs,
        policy=policy,
    )
    assert delay == expected


def test_an_unchanged_status_is_never_written() -> None:
    body = {"phase": "Ready"}
    assert (
        write_delay(
            body,
            ("Ready", "Ready"),
            dict(body),
            summary("Ready", "Ready"),
            since_headline=100,
            since_write=100,
            policy=POLICY,
        )
        is None
    )


def test_a_status_read_back_from_the_object_equals_the_same_status_rendered() -> None:
    # What the API server keeps of a merge patch has no key for a None value: after a restart
    # the status read from the object lacks the keys a render sets to None, and is the same.
    rendered = {"phase": "Ready", "unlistedPods": None, "rollout": {"state": "x", "gone": None}}
    read_back = {"phase": "Ready", "rollout": {"state": "x"}}
    assert (
        write_delay(
            read_back,
            ("Ready", None),
            rendered,
            summary("Ready", "Ready"),
            since_headline=0,
            since_write=0,
            policy=POLICY,
        )
        is None
    )


# -- what the file declares -------------------------------------------------------------------

DECLARED = description.Description(formats.LOHA, 3, ("text_encoder", "unet"), ("pixel", "8bit"))


def test_what_the_staged_file_declares_is_rendered_and_resumed_as_written() -> None:
    state = staged()
    state.adapter = DECLARED
    targeted = [(pod("a"), loaded())]
    body = render(adapter(), state, targeted, summarise(adapter(), state, targeted), [], "T")
    assert body["adapter"] == {
        "format": "loha",
        "rank": 3,
        "targets": ["text_encoder", "unet"],
        "triggerWords": ["pixel", "8bit"],
    }
    assert resume.restore_adapter(body["adapter"]) == DECLARED
    staged_status = {"staged": {"sha256": SHA, "sizeBytes": 100}, "adapter": body["adapter"]}
    assert (
        resume.plan_resume(adapter(status=staged_status), staged_status).staging.adapter == DECLARED
    )
    # Nothing staged (any more): nothing declared, and a merge patch removes the field.
    assert resume.plan_resume(adapter(), {"adapter": body["adapter"]}).staging.adapter is None
    assert (
        render(adapter(), staged(), [], summarise(adapter(), staged(), []), [], "T")["adapter"]
        is None
    )


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(None, id="absent"),
        pytest.param("loha", id="not-an-object"),
        pytest.param({"rank": 3}, id="no-format"),
        pytest.param({"format": "loha", "rank": "3"}, id="rank-not-a-number"),
        pytest.param({"format": "loha", "rank": True}, id="rank-a-boolean"),
        pytest.param({"format": "loha", "rank": 3, "targets": "unet"}, id="targets-not-a-list"),
    ],
)
def test_a_status_that_does_not_say_what_the_file_declares_is_read_again(raw: object) -> None:
    """None: the stager reads the staged revision's headers instead."""
    assert resume.restore_adapter(raw) is None


# -- what the source resolved to --------------------------------------------------------------

RESOLVED = "oci://registry.example/loras/pixel@sha256:" + "b" * 64


def test_what_the_source_resolved_to_is_rendered_once_and_resumed_as_written() -> None:
    """Written with the staging that resolved it; a restarted operator reads it back, renders
    the same and so writes nothing; a staging that resolved nothing removes it."""
    state = staged()
    state.succeeded(model.StagedRef(SHA, 100), "/v/p", "T0", 2, DECLARED, RESOLVED)
    targeted = [(pod("a"), loaded())]
    s = summarise(adapter(), state, targeted)
    body = render(adapter(), state, targeted, s, [], "T")
    assert body["staged"]["resolvedSource"] == RESOLVED

    # The status as the API server keeps it, read by a restarted operator.
    written = stored(body)
    resumed = resume.plan_resume(adapter(status=written), written)
    assert resumed.staging.resolved == RESOLVED
    again = render(adapter(), resumed.staging, targeted, s, written["conditions"], "T2")
    assert again == body
    assert (
        write_delay(
            resumed.written,
            resumed.written_headline,
            again,
            s,
            since_headline=0,
            since_write=0,
            policy=POLICY,
        )
        is None
    )

    # Staged again with nothing fetched (a pin already held): a merge patch removes the value.
    state.succeeded(model.StagedRef(SHA, 100), "/v/p", "T3", 3, DECLARED)
    assert render(adapter(), state, targeted, s, [], "T3")["staged"]["resolvedSource"] is None
    # Nothing staged, or a value that is no string: nothing resumed.
    assert (
        resume.plan_resume(adapter(), {"staged": {"resolvedSource": RESOLVED}}).staging.resolved
        is None
    )
    odd: dict[str, object] = {"staged": {"sha256": SHA, "sizeBytes": 1, "resolvedSource": 7}}
    assert resume.plan_resume(adapter(status=odd), odd).staging.resolved is None


# -- in which order the writes queue ----------------------------------------------------------


def test_writes_queue_one_namespace_at_a_time_in_turn() -> None:
    keys = [("big", f"a{i:04d}") for i in range(5000)] + [("small", f"b{i}") for i in range(5)]
    order = fair_order(keys)
    assert sorted(order) == sorted(keys)
    # The small namespace's five are among the first ten writes, not after 5,000.
    assert [k for k in order[:10] if k[0] == "small"] == [("small", f"b{i}") for i in range(5)]


@given(st.lists(st.tuples(st.sampled_from("abcde"), st.text("xyz", max_size=4)), unique=True))
def test_no_namespace_is_more_than_one_write_ahead_of_one_still_waiting(
    keys: list[tuple[str, str]],
) -> None:
    order = fair_order(keys)
    assert sorted(order) == sorted(keys)
    total = Counter(ns for ns, _ in keys)
    done: Counter[str] = Counter()
    for ns, _ in order:
        done[ns] += 1
        waiting = [other for other in total if done[other] < total[other]]
        assert all(done[ns] <= done[other] + 1 for other in waiting)
