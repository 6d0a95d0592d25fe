"""Which Events an adapter's status writes raise, and when a repeat joins a series (pure)."""

from __future__ import annotations

from lora_operator.rules.events import Note, Series, plan_event
from lora_operator.rules.status import Summary


def summary(phase: str, reason: str, message: str = "m") -> Summary:
    return Summary(phase=phase, reason=reason, message=message, desired=2, ready=0)  # type: ignore[arg-type]


def notes(*headlines: tuple[str, str]) -> list[Note | None]:
    """The Events of a series of status writes, each after the one before."""
    out, previous = [], None
    for phase, reason in headlines:
        s = summary(phase, reason)
        out.append(plan_event(previous, s))
        previous = s.headline
    return out


def test_apply_to_ready_is_at_most_two_normal_events() -> None:
    assert notes(("Staging", "Staging"), ("Loading", "Loading"), ("Ready", "Ready")) == [
        None,
        Note("Normal", "Loading", "m"),
        Note("Normal", "Ready", "m"),
    ]
    assert notes(("Ready", "Ready")) == [Note("Normal", "Ready", "m")]


def test_a_flapping_source_raises_one_event_per_distinct_condition_change() -> None:
    got = notes(
        ("Staging", "Staging"),
        ("Staging", "SourceUnavailable"),
        ("Staging", "SourceUnavailable"),
        ("Degraded", "SourceUnavailable"),
        ("Degraded", "SourceUnavailable"),
        ("Ready", "Ready"),
    )
    assert got == [
        None,
        Note("Warning", "SourceUnavailable", "m"),
        None,
        Note("Warning", "SourceUnavailable", "m"),
        None,
        Note("Normal", "Ready", "m"),
    ]


def test_a_permanent_failure_is_one_warning_with_its_own_reason() -> None:
    assert notes(("Staging", "Staging"), ("Failed", "ChecksumMismatch")) == [
        None,
        Note("Warning", "ChecksumMismatch", "m"),
    ]
    assert notes(("Loading", "Loading"), ("Failed", "LoadFailed"))[1] == Note(
        "Warning", "LoadFailed", "m"
    )


def test_after_a_takeover_only_a_new_phase_is_news() -> None:
    assert plan_event(("Ready", None), summary("Ready", "Ready")) is None
    assert plan_event(("Loading", None), summary("Ready", "Ready")) == Note("Normal", "Ready", "m")


def test_notes_are_cut_to_what_the_api_server_takes() -> None:
    note = plan_event(None, summary("Failed", "NotALora", "x" * 5000))
    assert note is not None and len(note.note) == 1024


def test_a_repeat_within_the_window_counts_into_the_first_events_series() -> None:
    series = Series(window_s=600)
    key = ("uid-1", "Normal", "Ready", "Loaded on 2/2 pods")
    assert series.record(key, 0.0, "e1") == ("e1", 1)
    assert series.record(key, 10.0, "e2") == ("e1", 2)
    assert series.record(key, 20.0, "e3") == ("e1", 3)
    other = ("uid-1", "Normal", "Loading", "Loaded on 1/2 pods")
    assert series.record(other, 21.0, "e4") == ("e4", 1)
    assert series.record(key, 700.0, "e5") == ("e5", 1)  # the window passed: a new Event
    series.forget("uid-1")
    assert len(series) == 0
