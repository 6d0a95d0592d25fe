"""Autoscaling one adapter's replicas: widen at once, narrow late, never flap."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_operator.rules.autoscale import Policy, Scale, clamp, plan_scale, request_rate, start

POLICY = Policy(min_replicas=1, max_replicas=6, target_rps=1.0, narrow_after_s=60)


def run(rates: list[float], policy: Policy = POLICY, step_s: float = 10) -> list[int]:
    """The replicas after each reading of a rate, one reading every `step_s`."""
    state, out = start(policy), []
    for i, rate in enumerate(rates):
        state = plan_scale(state, rate, i * step_s, policy)
        out.append(state.replicas)
    return out


def test_a_hot_adapter_widens_at_once_up_to_the_maximum() -> None:
    assert run([0.5, 2.5, 20]) == [1, 3, 6]


def test_a_cooled_adapter_narrows_only_after_the_rate_stayed_low() -> None:
    replicas = run([5.0] + [0.2] * 10)
    assert replicas[:7] == [5] * 7  # low since t=10: not yet 60 s
    assert replicas[7] == 1  # t=70: low for 60 s


def test_a_break_in_the_low_rate_restarts_the_wait() -> None:
    replicas = run([4.0, 0.1, 0.1, 0.1, 0.1, 0.1, 3.0] + [0.1] * 7)
    assert replicas[:13] == [4] * 13  # low again since t=70
    assert replicas[13] == 1  # t=130


def test_narrowing_respects_the_minimum() -> None:
    policy = Policy(min_replicas=2, max_replicas=4, target_rps=1.0, narrow_after_s=0)
    assert run([3.5, 0.0, 0.0], policy) == [4, 4, 2]


@pytest.mark.parametrize(
    ("given_replicas", "expected"),
    [(0, 1), (1, 1), (4, 4), (9, 6)],
    ids=["below-min", "min", "inside", "above-max"],
)
def test_clamp(given_replicas: int, expected: int) -> None:
    assert clamp(given_replicas, POLICY) == expected


def test_a_contradictory_policy_keeps_the_minimum() -> None:
    assert clamp(7, Policy(min_replicas=3, max_replicas=1)) == 3


@settings(max_examples=300, deadline=None)
@given(st.floats(0, 50), st.integers(1, 6))
def test_a_steady_rate_settles_after_one_change(rate: float, first: int) -> None:
    state = Scale(replicas=first)
    seen = []
    for i in range(40):
        state = plan_scale(state, rate, i * 10.0, POLICY)
        seen.append(state.replicas)
    changes = sum(1 for a, b in itertools.pairwise(seen) if a != b)
    assert changes <= 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 50), min_size=1, max_size=60))
def test_replicas_stay_within_bounds_and_never_flap(rates: list[float]) -> None:
    replicas = run(rates)
    assert all(POLICY.min_replicas <= r <= POLICY.max_replicas for r in replicas)
    # Hysteresis: a narrowing never directly follows a widening (it needs 60 s of low rate).
    for i in range(1, len(replicas) - 1):
        if replicas[i] > replicas[i - 1]:
            assert replicas[i + 1] >= replicas[i]


@settings(max_examples=200, deadline=None)
@given(st.floats(0.01, 50), st.integers(1, 6))
def test_after_narrowing_the_same_rate_does_not_widen(rate: float, first: int) -> None:
    state = Scale(replicas=first, low_since=0.0)
    narrowed = plan_scale(state, rate, 1000.0, POLICY)
    assert plan_scale(narrowed, rate, 1001.0, POLICY).replicas == narrowed.replicas


def test_request_rate_from_counters() -> None:
    before = {"a": 10, "b": 5}
    after = {"a": 16, "b": 2, "c": 40}  # b restarted; c is new: no rate until its second reading
    assert request_rate(before, after, 4.0) == pytest.approx((6 + 2) / 4)
    assert request_rate(before, after, 0) == 0.0
