"""The per-pod load state machine (pure): every transition, the invariants over any sequence of
events, and the path from a retry bound to a Degraded adapter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_operator.rules import model, podstate
from lora_operator.rules.planning import Card, Want
from lora_operator.rules.podstate import (
    Conflicted,
    Failed,
    PodEntry,
    Reported,
    Started,
    Succeeded,
    may_load,
    retry_delay,
    transition,
)
from lora_operator.rules.status import StagingState, summarise
from lora_runtime import backoff

BOUND = 3
A = Want("pixel", "a" * 64, 1.0, False)
B = Want("pixel", "b" * 64, 1.0, False)  # the same adapter at another revision


def card(want: Want) -> Card:
    return Card(want.name, want.sha256, want.scale, want.pinned)


def step(entry: PodEntry, event: podstate.Event) -> PodEntry:
    return transition(entry, event, retry_bound=BOUND)


def run(*events: podstate.Event, entry: PodEntry | None = None) -> PodEntry:
    entry = entry or PodEntry()
    for event in events:
        entry = step(entry, event)
    return entry


PENDING = PodEntry()
LOADING = PodEntry(state="Loading")
LOADED = PodEntry(state="Loaded", revision=A.sha256)
REFUSED = PodEntry(state="Failed", refused=A, last_error="422")
RETRYING = PodEntry(state="Failed", attempts=BOUND, last_error="timeout")
ONE_FAILURE = PodEntry(attempts=1, last_error="timeout")

# (entry, event) -> (state, attempts, refused, revision) after it
TABLE = [
    ("pending-started", PENDING, Started(A), ("Loading", 0, None, None)),
    ("loaded-started-inplace", LOADED, Started(B), ("Loading", 0, None, A.sha256)),
    ("refused-started-same", REFUSED, Started(A), ("Failed", 0, A, None)),
    ("refused-started-other", REFUSED, Started(B), ("Loading", 0, None, None)),
    ("retrying-started", RETRYING, Started(A), ("Loading", BOUND, None, None)),
    ("loading-succeeded", LOADING, Succeeded(A, 0.1, "T"), ("Loading", 0, None, None)),
    ("loading-transient", LOADING, Failed(A, "503", False), ("Pending", 1, None, None)),
    (
        "transient-reaches-bound",
        PodEntry(state="Loading", attempts=BOUND - 1),
        Failed(A, "503", False),
        ("Failed", BOUND, None, None),
    ),
    ("loading-permanent", LOADING, Failed(A, "422", True), ("Failed", 0, A, None)),
    ("pending-conflicted", PENDING, Conflicted(A, "static"), ("Failed", 0, A, None)),
    ("pending-reported", PENDING, Reported(A, card(A)), ("Loaded", 0, None, A.sha256)),
    ("loading-reported-absent", LOADING, Reported(A, None), ("Pending", 0, None, None)),
    ("loaded-reported-absent", LOADED, Reported(A, None), ("Pending", 0, None, None)),
    ("loaded-reported-old", LOADED, Reported(B, card(A)), ("Pending", 0, None, A.sha256)),
    ("refused-reported-same", REFUSED, Reported(A, None), ("Failed", 0, A, None)),
    ("refused-reported-other", REFUSED, Reported(B, None), ("Pending", 0, None, None)),
    ("refused-reported-served", REFUSED, Reported(A, card(A)), ("Loaded", 0, None, A.sha256)),
    ("retrying-reported-absent", RETRYING, Reported(A, None), ("Failed", BOUND, None, None)),
    ("retrying-reported-served", RETRYING, Reported(A, card(A)), ("Loaded", 0, None, A.sha256)),
    ("one-failure-reported", ONE_FAILURE, Reported(A, None), ("Pending", 1, None, None)),
]


@pytest.mark.parametrize(
    ("entry", "event", "after"), [t[1:] for t in TABLE], ids=[t[0] for t in TABLE]
)
def test_each_transition(entry: PodEntry, event: podstate.Event, after: tuple[object, ...]) -> None:
    new = step(entry, event)
    assert (new.state, new.attempts, new.refused, new.revision) == after


def test_a_scale_or_pin_the_pod_does_not_report_yet_is_not_loaded() -> None:
    rescaled = Want("pixel", A.sha256, 2.0, False)
    assert run(Reported(rescaled, card(A)), entry=LOADED).state == "Pending"
    unknown = Card("pixel", A.sha256, None, None)  # a server that reports neither (vLLM)
    assert run(Reported(rescaled, unknown)).state == "Loaded"


def test_a_refusal_is_final_for_its_want_and_only_for_it() -> None:
    refused = run(Started(A), Failed(A, "422: shapes", True))
    assert refused.permanent and not refused.retrying
    assert not may_load(refused, A) and may_load(refused, B)
    assert step(refused, Started(A)) == refused
    assert retry_delay(refused, 60) is None


def test_the_retry_bound_makes_the_adapter_degraded_and_a_success_ends_it() -> None:
    pod = model.pod_info(
        {
            "metadata": {"namespace": "ns", "name": "p", "uid": "p"},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )
    info = model.adapter_info(
        {"metadata": {"namespace": "ns", "name": "pixel", "generation": 1}, "spec": {}}
    )
    staged = StagingState(staged=model.StagedRef(A.sha256, 10))
    entry = PodEntry()
    phases = []
    for _ in range(BOUND):
        entry = run(Started(A), Failed(A, "timeout", False), Reported(A, None), entry=entry)
        phases.append(summarise(info, staged, [(pod, entry)], retry_bound=BOUND).phase)
    assert phases == ["Loading"] * (BOUND - 1) + ["Degraded"]
    assert entry.retrying and retry_delay(entry, 60) == backoff.delay(BOUND + 1, cap=60)
    degraded = summarise(info, staged, [(pod, entry)], retry_bound=BOUND)
    assert degraded.reason == "LoadRetrying" and "p: timeout" in degraded.message
    # Retries go on, and the phase stays Degraded until one succeeds.
    entry = run(Started(A), Failed(A, "timeout", False), Reported(A, None), entry=entry)
    assert summarise(info, staged, [(pod, entry)], retry_bound=BOUND).phase == "Degraded"
    entry = run(Started(A), Succeeded(A, 0.2, "T"), Reported(A, card(A)), entry=entry)
    assert summarise(info, staged, [(pod, entry)], retry_bound=BOUND).phase == "Ready"
    assert (entry.attempts, entry.last_error, entry.loaded_at) == (0, None, "T")


WANTS = st.sampled_from([A, B])
EVENTS = st.one_of(
    st.builds(Started, WANTS),
    st.builds(Succeeded, WANTS, st.floats(0, 5), st.just("T")),
    st.builds(Failed, WANTS, st.just("err"), st.booleans()),
    st.builds(Conflicted, WANTS, st.just("static")),
    st.builds(Reported, WANTS, st.one_of(st.none(), st.builds(card, WANTS))),
)


@settings(max_examples=400)
@given(st.lists(EVENTS, max_size=30))
def test_invariants_hold_after_any_sequence(sequence: list[podstate.Event]) -> None:
    entry = PodEntry()
    for event in sequence:
        before, entry = entry, step(entry, event)
        # A refused want is never attempted again.
        if isinstance(event, Started) and before.permanent and before.refused == event.want:
            assert entry == before
        # Only the pod's report makes an entry Loaded, and only at the revision it reported.
        if entry.state == "Loaded":
            assert isinstance(event, Reported) or before.state == "Loaded"
            assert entry.attempts == 0 and entry.last_error is None
        if isinstance(event, Reported) and entry.state == "Loaded":
            assert event.card is not None and entry.revision == event.card.revision
        # Failed means refused for good, or retrying past the bound; never both, never neither.
        if entry.state == "Failed":
            assert entry.permanent != entry.retrying
            assert entry.refused is not None or entry.attempts >= BOUND
        assert entry.refused is None or entry.state == "Failed"
        assert entry.state != "Pending" or entry.attempts < BOUND
        delay = retry_delay(entry, 60)
        assert (delay is None) == (entry.state == "Loaded" or entry.permanent)


def test_a_pod_that_accepts_loads_but_never_lists_them_backs_off_to_failed() -> None:
    """A 200 is not evidence: each report that then does not list the revision counts as a
    failed load, so the retries back off and end Failed (Degraded) with the reason, never a
    call once a pass for ever."""
    entry = PodEntry()
    delays = []
    for attempt in range(1, BOUND + 1):
        entry = run(Started(A), Succeeded(A, 0.1, "t"), Reported(A, None), entry=entry)
        assert entry.attempts == attempt
        assert "accepted the load (200) but does not list it" in (entry.last_error or "")
        delays.append(retry_delay(entry, cap=60))
    assert entry.state == "Failed" and entry.retrying
    assert delays == [2.0, 4.0, 8.0]
    # Listing the wrong revision is no better; listing the wanted one ends it.
    wrong = run(Started(A), Succeeded(A, 0.1, "t"), Reported(A, card(B)))
    assert wrong.attempts == 1 and "lists revision" in (wrong.last_error or "")
    assert run(Reported(A, card(A)), entry=entry).state == "Loaded"
    assert run(Reported(A, card(A)), entry=entry).attempts == 0
