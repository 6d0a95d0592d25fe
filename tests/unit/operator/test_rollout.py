"""The rollout's decisions (pure): when it begins, how it moves on, what the router is told,
what a restart reads back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_operator.rules import rollout
from lora_operator.rules.rollout import ABORT, PROMOTE, Plan, Rollout, State, Step

OLD, NEW, NEWER = "a" * 64, "b" * 64, "c" * 64
PLAN = Plan((Step(10, 60), Step(50), Step(100, 30)))


def advance(
    r: Rollout,
    now: float,
    *,
    ready: bool = True,
    promoted: bool = False,
    command: str | None = None,
) -> rollout.Progress:
    return rollout.advance(
        r, PLAN, now, canary_ready=ready, promoted_everywhere=promoted, command=command
    )


def test_an_alias_never_names_a_kubernetes_object_and_reads_back() -> None:
    alias = rollout.alias("pixel-art", NEW)
    assert alias == "pixel-art_" + NEW[:12]
    assert rollout.adapter_of_alias(alias, NEW) == "pixel-art"
    assert rollout.adapter_of_alias(alias, OLD) is None  # another revision's prefix
    assert rollout.adapter_of_alias("pixel-art", NEW) is None


def test_a_rollout_begins_only_with_a_plan_and_a_revision_that_served() -> None:
    assert rollout.begin(None, OLD, NEW, None) is None  # no spec.rollout: at once
    assert rollout.begin(None, None, NEW, PLAN) is None  # the first revision: nothing to roll from
    assert rollout.begin(None, NEW, NEW, PLAN) is None  # the same revision staged again
    assert rollout.begin(None, OLD, NEW, PLAN) == Rollout(stable=OLD, canary=NEW)


def test_a_revision_staged_during_a_rollout_starts_over_from_the_stable_one() -> None:
    under_way = Rollout(OLD, NEW, State.PROGRESSING, step=1, step_started=5.0)
    assert rollout.begin(under_way, NEW, NEWER, PLAN) == Rollout(stable=OLD, canary=NEWER)
    assert rollout.begin(under_way, NEW, NEW, PLAN) == under_way  # the canary staged again
    assert rollout.begin(under_way, NEW, OLD, PLAN) is None  # back to the stable one: over
    aborted = Rollout(OLD, NEW, State.ABORTED)
    assert rollout.begin(aborted, NEW, NEWER, PLAN) == Rollout(stable=OLD, canary=NEWER)
    # Once promoting, the canary is what serves: the next rollout starts from it.
    promoting = Rollout(OLD, NEW, State.PROMOTING)
    assert rollout.begin(promoting, NEW, NEWER, PLAN) == Rollout(stable=NEW, canary=NEWER)


def test_no_traffic_until_the_canary_serves_everywhere_then_the_first_step() -> None:
    r = Rollout(OLD, NEW)
    waiting = advance(r, 100.0, ready=False)
    assert waiting.rollout == r and rollout.weight(r, PLAN) == 0 and waiting.wake_at is None
    started = advance(r, 100.0)
    assert started.rollout == Rollout(OLD, NEW, State.PROGRESSING, 0, 100.0)
    assert rollout.weight(started.rollout, PLAN) == 10
    assert started.wake_at == 160.0  # the step's pause ends


def test_pauses_move_the_steps_on_and_a_step_without_one_waits_for_promote() -> None:
    r = Rollout(OLD, NEW, State.PROGRESSING, 0, 100.0)
    assert advance(r, 159.0).rollout == r
    second = advance(r, 160.0).rollout
    assert second == Rollout(OLD, NEW, State.PROGRESSING, 1, 160.0)
    held = advance(second, 10_000.0)
    assert held.rollout == second and held.wake_at is None  # no pause: a promote moves it
    third = advance(second, 10_000.0, command=PROMOTE)
    assert third.acted == PROMOTE
    assert third.rollout == Rollout(OLD, NEW, State.PROGRESSING, 2, 10_000.0)
    assert rollout.weight(third.rollout, PLAN) == 100
    promoting = advance(third.rollout, 10_030.0).rollout
    assert promoting is not None and promoting.state is State.PROMOTING
    assert rollout.weight(promoting, PLAN) == 100 and promoting.name_revision == NEW


def test_promoting_ends_once_every_pod_serves_the_canary_under_the_name() -> None:
    promoting = Rollout(OLD, NEW, State.PROMOTING)
    assert advance(promoting, 1.0, promoted=False).rollout == promoting
    assert advance(promoting, 1.0, promoted=True).rollout is None


def test_abort_sends_everything_back_and_drops_the_alias() -> None:
    for r in (Rollout(OLD, NEW), Rollout(OLD, NEW, State.PROGRESSING, 1, 1.0)):
        aborted = advance(r, 2.0, command=ABORT).rollout
        assert aborted is not None and aborted.state is State.ABORTED
        assert aborted.step_started is None  # no pause runs
        assert rollout.weight(aborted, PLAN) == 0
        assert aborted.name_revision == OLD and not aborted.serves_canary_alias
        assert advance(aborted, 1e9, command=PROMOTE).rollout == aborted  # stays aborted
    promoting = Rollout(OLD, NEW, State.PROMOTING)
    assert advance(promoting, 2.0, command=ABORT).rollout == promoting  # nothing to abort to


def test_removing_spec_rollout_promotes() -> None:
    r = Rollout(OLD, NEW, State.PROGRESSING, 0, 1.0)
    after = rollout.advance(r, None, 2.0, canary_ready=True, promoted_everywhere=False)
    assert after.rollout is not None and after.rollout.state is State.PROMOTING


@given(
    events=st.lists(
        st.tuples(
            st.floats(0, 100),
            st.booleans(),
            st.booleans(),
            st.sampled_from([None, PROMOTE, ABORT]),
        ),
        max_size=30,
    )
)
def test_any_sequence_keeps_the_weight_in_range_and_abort_final(
    events: list[tuple[float, bool, bool, str | None]],
) -> None:
    r: Rollout | None = Rollout(OLD, NEW)
    now = 0.0
    for dt, ready, promoted, command in events:
        if r is None:
            break
        now += dt
        before = r
        r = advance(r, now, ready=ready, promoted=promoted, command=command).rollout
        if r is None:
            assert promoted and before.state is not State.ABORTED
            continue
        assert 0 <= rollout.weight(r, PLAN) <= 100
        assert (r.stable, r.canary) == (OLD, NEW)
        if before.state is State.ABORTED:
            assert r.state is State.ABORTED
        if r.state is State.STARTING:
            assert rollout.weight(r, PLAN) == 0


def test_the_status_shows_both_revisions_and_reads_back() -> None:
    r = Rollout(OLD, NEW, State.PROGRESSING, 1, 1_800_000_000.0)
    status = rollout.render(r, PLAN, "px", stable_ready=2, canary_ready=3, pods=3)
    assert status["state"] == "Progressing" and status["step"] == 2 and status["steps"] == 3
    assert status["stable"] == {"revision": OLD, "weight": 50, "readyPods": 2}
    assert status["canary"] == {
        "revision": NEW,
        "weight": 50,
        "readyPods": 3,
        "servedAs": "px_" + NEW[:12],
    }
    assert "lora.dev/rollout=promote" in status["message"]
    assert rollout.restore(status) == r
    assert rollout.restore(None) is None and rollout.restore({"state": "Nonsense"}) is None


@pytest.mark.parametrize(
    ("change", "routes"),
    [
        (lambda s: {**s, "canary": {**s["canary"], "readyPods": 1}}, False),
        (lambda s: {**s, "message": "x"}, False),
        (lambda s: {**s, "canary": {**s["canary"], "weight": 100}}, True),
        (lambda s: {**s, "state": "Aborted"}, True),
        (lambda s: None, True),
    ],
)
def test_only_what_the_routers_read_forces_a_write(
    change: Callable[[dict[str, Any]], dict[str, Any] | None], routes: bool
) -> None:
    r = Rollout(OLD, NEW, State.PROGRESSING, 1, 1_800_000_000.0)
    before = rollout.render(r, PLAN, "px", stable_ready=2, canary_ready=3, pods=3)
    assert rollout.routing_changed(before, change(before)) is routes


def test_every_command_that_is_not_acted_on_says_why() -> None:
    assert "not a command" in rollout.ignored("promot", None)
    assert "no rollout" in rollout.ignored(PROMOTE, None)
    assert "aborted" in rollout.ignored(PROMOTE, Rollout(OLD, NEW, State.ABORTED))
    assert "still loading" in rollout.ignored(PROMOTE, Rollout(OLD, NEW))


def test_the_plan_reads_spec_rollout() -> None:
    raw = {"steps": [{"weight": 10, "pauseSeconds": 60}, {"weight": 50}]}
    assert rollout.parse_plan(raw) == Plan((Step(10, 60.0), Step(50, None)))
    assert rollout.parse_plan(None) is None


def test_a_refused_canary_is_what_the_message_says() -> None:
    r = Rollout(OLD, NEW)
    status = rollout.render(r, PLAN, "px", stable_ready=1, canary_ready=0, pods=1, refused="p: 422")
    assert status["message"].startswith(f"a pod refused the canary {NEW[:12]} (p: 422)")
    # Once promoting, the name serves the canary: nothing left to refuse or abort.
    promoting = Rollout(OLD, NEW, State.PROMOTING)
    message = rollout.render(
        promoting, PLAN, "px", stable_ready=0, canary_ready=1, pods=1, refused="p: 422"
    )["message"]
    assert message.startswith("promoting")
