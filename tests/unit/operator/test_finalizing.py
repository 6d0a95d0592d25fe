"""The operator's finalizer as a JSON patch, and a deletion's next step (finalizing, pure)."""

from __future__ import annotations

import itertools

import pytest
from lora_operator.rules import finalizing
from lora_operator.rules.finalizing import FINALIZER, Step

TEST = {"op": "test", "path": "/metadata/resourceVersion", "value": "41"}


def test_holding_adds_it_after_the_others_on_that_version_only() -> None:
    assert finalizing.patch([], "41", hold=True) == [
        TEST,
        {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
    ]
    assert finalizing.patch(["team.io/backup"], "41", hold=True) == [
        TEST,
        {"op": "add", "path": "/metadata/finalizers", "value": ["team.io/backup", FINALIZER]},
    ]


def test_releasing_keeps_the_others_and_drops_an_empty_list() -> None:
    assert finalizing.patch(["a.io/x", FINALIZER, "b.io/y"], "41", hold=False) == [
        TEST,
        {"op": "add", "path": "/metadata/finalizers", "value": ["a.io/x", "b.io/y"]},
    ]
    assert finalizing.patch([FINALIZER], "41", hold=False) == [
        TEST,
        {"op": "remove", "path": "/metadata/finalizers"},
    ]


@pytest.mark.parametrize(
    ("finalizers", "hold"), [([FINALIZER], True), (["a.io/x", FINALIZER], True), ([], False)]
)
def test_nothing_to_write_when_the_object_is_as_wanted(finalizers: list[str], hold: bool) -> None:
    assert finalizing.patch(finalizers, "41", hold) == []


def test_the_steps_of_a_live_adapter_and_of_a_deletion() -> None:
    assert finalizing.next_step(False, False, False, False, False) is Step.HOLD
    assert finalizing.next_step(False, True, False, False, False) is Step.NONE
    # Deleting: unpublish first, whatever else holds.
    for held, unloaded, gave_up in itertools.product((False, True), repeat=3):
        assert finalizing.next_step(True, held, False, unloaded, gave_up) is Step.UNPUBLISH
    assert finalizing.next_step(True, True, True, False, False) is Step.WAIT
    assert finalizing.next_step(True, True, True, True, False) is Step.RELEASE
    assert finalizing.next_step(True, True, True, False, True) is Step.RELEASE  # the grace ran out
    # Never held (deleted before the operator added it): nothing to release.
    assert finalizing.next_step(True, False, True, True, False) is Step.FORGET
    assert finalizing.next_step(True, False, True, False, False) is Step.WAIT
