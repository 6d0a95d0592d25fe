"""Placement: capacity, replicas, shortfall reasons, and stability under pod and adapter churn."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_operator.rules import placement
from lora_operator.rules.placement import (
    Demand,
    PodCapacity,
    Shortfall,
    place_more,
    plan_placement,
)

ROOMY = 100  # more than any test here places on one pod


def pods(
    n: int, slots: int = ROOMY, pinned_slots: int = ROOMY, prefix: str = "p"
) -> list[PodCapacity]:
    return [PodCapacity(f"{prefix}{i}", slots, pinned_slots) for i in range(n)]


def demand(
    name: str, replicas: int | None, candidates: list[PodCapacity], pinned: bool = False
) -> Demand:
    return Demand(name, replicas, pinned, tuple(p.name for p in candidates))


def demands(k: int, replicas: int | None, candidates: list[PodCapacity]) -> list[Demand]:
    return [demand(f"ns/a{i}", replicas, candidates) for i in range(k)]


# Hypothesis inputs: a few pods with small capacities, adapters with or without replicas, pinned
# or not, each targeting a subset of the pods (selectors).
pod_lists = st.lists(
    st.builds(
        PodCapacity,
        name=st.sampled_from([f"pod-{i}" for i in range(12)]),
        slots=st.integers(0, 8),
        pinned_slots=st.integers(0, 3),
    ),
    min_size=0,
    max_size=8,
    unique_by=lambda p: p.name,
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[PodCapacity], list[Demand]]:
    ps = draw(pod_lists)
    names = [p.name for p in ps] + ["gone-pod"]  # a candidate that advertises nothing
    k = draw(st.integers(0, 25))
    ds = [
        Demand(
            name=f"ns/adapter-{i}",
            replicas=draw(st.one_of(st.none(), st.integers(0, 5))),
            pinned=draw(st.booleans()),
            candidates=tuple(draw(st.lists(st.sampled_from(names), max_size=len(names)))),
        )
        for i in range(k)
    ]
    return ps, ds


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_capacity_is_never_exceeded_by_limited_adapters(
    scenario: tuple[list[PodCapacity], list[Demand]],
) -> None:
    ps, ds = scenario
    plan = plan_placement(ps, ds)
    by_name = {d.name: d for d in ds}
    for p in ps:
        held = [a for a, placed in plan.adapters.items() if p.name in placed.pods]
        every = [a for a in held if by_name[a].replicas is None]
        limited = [a for a in held if by_name[a].replicas is not None]
        # Every-pod adapters are not held to capacity, but use it up first.
        assert len(limited) <= max(0, p.slots - len(every))
        pinned_every = sum(1 for a in every if by_name[a].pinned)
        pinned_limited = sum(1 for a in limited if by_name[a].pinned)
        assert pinned_limited <= max(0, p.pinned_slots - pinned_every)


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_placed_pods_are_distinct_known_candidates_and_shortfalls_say_why(
    scenario: tuple[list[PodCapacity], list[Demand]],
) -> None:
    ps, ds = scenario
    plan = plan_placement(ps, ds)
    known = {p.name for p in ps}
    assert set(plan.adapters) == {d.name for d in ds}
    for d in ds:
        placed = plan.adapters[d.name]
        targets = set(d.candidates) & known
        assert len(set(placed.pods)) == len(placed.pods)
        assert set(placed.pods) <= targets
        if d.replicas is None:
            assert set(placed.pods) == targets
        if not targets:
            assert placed.shortfall is Shortfall.NO_PODS
        elif len(placed.pods) >= placed.wanted:
            assert placed.shortfall is None
        elif len(placed.pods) == len(targets):
            assert placed.shortfall is Shortfall.FEWER_PODS
        else:
            assert placed.shortfall is Shortfall.CAPACITY


@settings(max_examples=400, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False), st.integers(0, 25))
def test_adapters_placed_later_land_where_placing_them_all_puts_them(
    scenario: tuple[list[PodCapacity], list[Demand]], rnd: random.Random, split: int
) -> None:
    """`place_more` gives what `plan_placement` gives for every adapter, or says it cannot tell
    (None); newcomers created after every adapter placed, or on pods with room to spare, it
    always places."""
    ps, ds = scenario
    # Created within a few seconds of each other: ties broken by the hash, as in a burst.
    ds = [dataclasses.replace(d, created=f"2026-12-07T10:00:0{rnd.randint(0, 3)}Z") for d in ds]
    earlier, later = ds[:split], ds[split:]
    more = place_more(plan_placement(ps, earlier), ps, later)
    whole = plan_placement(ps, ds)
    if more is not None:
        assert more.adapters == whole.adapters
        assert (more.free, more.pinned_free, more.last) == (
            whole.free,
            whole.pinned_free,
            whole.last,
        )
    newest = max((d.created for d in earlier), default="")
    # Newer and not pinned (pinned ones place before every unpinned one): after every one.
    after = [dataclasses.replace(d, created="2026-12-07T11:00:00Z", pinned=False) for d in later]
    if newest and all(d.replicas is not None for d in later):
        more = place_more(plan_placement(ps, earlier), ps, after)
        assert more is not None
        assert more.adapters == plan_placement(ps, earlier + after).adapters
    roomy = [dataclasses.replace(p, slots=ROOMY, pinned_slots=ROOMY) for p in ps]
    if all(d.replicas is not None for d in later):
        assert place_more(plan_placement(roomy, earlier), roomy, later) is not None


def test_changed_pods_or_an_every_pod_adapter_place_everything_again() -> None:
    ps = pods(3)
    before = plan_placement(ps, demands(5, 2, ps))
    assert place_more(before, pods(4), [demand("ns/new", 2, ps)]) is None
    assert place_more(before, ps, [demand("ns/new", None, ps)]) is None
    assert place_more(before, ps, [demand("ns/new", 2, ps)]) is not None


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_the_order_of_the_inputs_does_not_matter(
    scenario: tuple[list[PodCapacity], list[Demand]], rnd: random.Random
) -> None:
    ps, ds = scenario
    shuffled_pods, shuffled_demands = list(ps), list(ds)
    rnd.shuffle(shuffled_pods)
    rnd.shuffle(shuffled_demands)
    assert plan_placement(ps, ds) == plan_placement(shuffled_pods, shuffled_demands)


@pytest.mark.parametrize("replicas", [1, 2, 3, 5], ids=lambda r: f"replicas={r}")
def test_every_adapter_gets_its_replicas_when_capacity_allows(replicas: int) -> None:
    ps = pods(8, slots=100, pinned_slots=3)
    ds = demands(150, replicas, ps)  # 150 x replicas <= 8 x 100
    plan = plan_placement(ps, ds)
    assert all(len(plan.pods_of(d.name)) == replicas for d in ds)
    assert all(placed.shortfall is None for placed in plan.adapters.values())


def test_a_full_fleet_degrades_with_insufficient_capacity() -> None:
    ps = pods(4, slots=5)
    plan = plan_placement(ps, demands(12, 2, ps))  # 24 wanted, 20 slots
    placed = sum(len(p.pods) for p in plan.adapters.values())
    assert placed == 20
    short = [p for p in plan.adapters.values() if p.shortfall is not None]
    assert short and all(p.shortfall is Shortfall.CAPACITY for p in short)


def test_fewer_pods_than_replicas_places_on_all_of_them() -> None:
    ps = pods(2)
    placed = plan_placement(ps, [demand("ns/a", 3, ps)]).adapters["ns/a"]
    assert sorted(placed.pods) == ["p0", "p1"]
    assert placed.shortfall is Shortfall.FEWER_PODS


def test_no_pods_and_zero_replicas() -> None:
    plan = plan_placement(pods(3), [demand("ns/none", 2, []), demand("ns/zero", 0, pods(3))])
    assert plan.adapters["ns/none"].shortfall is Shortfall.NO_PODS
    assert plan.adapters["ns/zero"] == placement.Placed(pods=(), wanted=0)


def test_pinned_adapters_count_against_pinned_slots_and_go_first() -> None:
    ps = pods(3, slots=10, pinned_slots=1)
    ds = [demand(f"ns/pin{i}", 1, ps, pinned=True) for i in range(4)]
    plan = plan_placement(ps, ds)
    assert sum(len(plan.pods_of(d.name)) for d in ds) == 3
    assert Counter(p for d in ds for p in plan.pods_of(d.name)) == {"p0": 1, "p1": 1, "p2": 1}
    # A pinned newcomer takes room before an unpinned adapter on a pod with one slot.
    one = [PodCapacity("only", 1, 1)]
    plan = plan_placement(one, [demand("ns/z-plain", 1, one), demand("ns/a-pinned", 1, one, True)])
    assert plan.pods_of("ns/z-plain") == () and plan.pods_of("ns/a-pinned") == ("only",)


def test_every_pod_adapters_use_room_up_first() -> None:
    ps = pods(2, slots=3)
    ds = [demand(f"ns/all{i}", None, ps) for i in range(3)] + [demand("ns/lim", 1, ps)]
    plan = plan_placement(ps, ds)
    assert all(plan.pods_of(f"ns/all{i}") == ("p0", "p1") for i in range(3))
    assert plan.adapters["ns/lim"].shortfall is Shortfall.CAPACITY


def test_capacity_weights_the_share_of_each_pod() -> None:
    ps = [PodCapacity("small", 50, 2), PodCapacity("big", 200, 2), *pods(2, 100, 2, prefix="m")]
    plan = plan_placement(ps, demands(100, 1, ps))  # nobody is full: the ring's shares alone
    load = Counter(p for placed in plan.adapters.values() for p in placed.pods)
    assert load["big"] > load["small"]


# -- stability ------------------------------------------------------------------------------

names = st.lists(st.integers(0, 10_000), min_size=1, max_size=60, unique=True)


@settings(max_examples=100, deadline=None)
@given(names, st.integers(3, 9), st.integers(1, 3))
def test_a_joining_pod_only_takes_placements(ids: list[int], n: int, replicas: int) -> None:
    before_pods = pods(n)
    after_pods = [*before_pods, PodCapacity("newcomer", ROOMY, ROOMY)]
    before = plan_placement(before_pods, [demand(f"a{i}", replicas, before_pods) for i in ids])
    after = plan_placement(after_pods, [demand(f"a{i}", replicas, after_pods) for i in ids])
    for i in ids:
        old, new = set(before.pods_of(f"a{i}")), set(after.pods_of(f"a{i}"))
        # Nothing moves between old pods: an adapter either keeps its pods or gives one up for
        # the newcomer.
        assert new - old <= {"newcomer"}
        assert len(old - new) == len(new - old)


@settings(max_examples=100, deadline=None)
@given(names, st.integers(2, 9), st.integers(1, 3), st.data())
def test_a_leaving_pod_only_moves_what_it_held(
    ids: list[int], n: int, replicas: int, data: st.DataObject
) -> None:
    before_pods = pods(n)
    gone = data.draw(st.sampled_from(before_pods))
    after_pods = [p for p in before_pods if p != gone]
    before = plan_placement(before_pods, [demand(f"a{i}", replicas, before_pods) for i in ids])
    after = plan_placement(after_pods, [demand(f"a{i}", replicas, after_pods) for i in ids])
    for i in ids:
        old, new = before.pods_of(f"a{i}"), after.pods_of(f"a{i}")
        if gone.name not in old:
            assert new == old
        else:
            assert set(old) - {gone.name} <= set(new)


@settings(max_examples=100, deadline=None)
@given(names, st.integers(1, 9), st.integers(1, 3), st.integers(10_001, 20_000))
def test_adding_an_adapter_moves_nothing_else_while_pods_have_room(
    ids: list[int], n: int, replicas: int, extra: int
) -> None:
    ps = pods(n)
    before = plan_placement(ps, [demand(f"a{i}", replicas, ps) for i in ids])
    after = plan_placement(ps, [demand(f"a{i}", replicas, ps) for i in [*ids, extra]])
    assert placement.moves(before, after) == len(after.pods_of(f"a{extra}"))
    assert all(before.pods_of(f"a{i}") == after.pods_of(f"a{i}") for i in ids)


@settings(max_examples=100, deadline=None)
@given(names, st.integers(1, 6), st.integers(1, 3), st.integers(0, 4))
def test_on_full_pods_a_newer_adapter_never_displaces_an_older_one(
    ids: list[int], n: int, replicas: int, slots: int
) -> None:
    ps = pods(n, slots=slots)
    older = [
        Demand(f"a{i}", replicas, False, tuple(p.name for p in ps), f"2026-01-01T00:{j:02d}:00Z")
        for j, i in enumerate(ids[:50])
    ]
    newcomer = Demand("new", replicas, False, tuple(p.name for p in ps), "2026-06-01T00:00:00Z")
    before = plan_placement(ps, older)
    after = plan_placement(ps, [newcomer, *older])
    assert all(after.pods_of(d.name) == before.pods_of(d.name) for d in older)
    assert placement.moves(before, after) == len(after.pods_of("new"))


def test_moves_on_a_join_are_about_k_replicas_over_n() -> None:
    k, n, replicas = 2000, 20, 2
    before_pods = pods(n, slots=1000)
    after_pods = [*before_pods, PodCapacity("newcomer", 1000, 4)]
    before = plan_placement(before_pods, demands(k, replicas, before_pods))
    after = plan_placement(after_pods, demands(k, replicas, after_pods))
    expected = k * replicas / (n + 1)
    assert placement.moves(before, after) <= 1.5 * expected


def test_moves_counts_new_placements_only() -> None:
    a = placement.Placement({"x": placement.Placed(("p", "q"), 2)})
    b = placement.Placement(
        {"x": placement.Placed(("q", "r"), 2), "y": placement.Placed(("p",), 1)}
    )
    assert placement.moves(a, b) == 2


@pytest.mark.parametrize(
    ("adapters", "seconds"),
    [(0, 0.5), (50, 0.5), (200, 2.0), (400, 4.0), (10_000, 4.0)],
)
def test_a_larger_namespace_is_placed_less_often_and_within_4_s(
    adapters: int, seconds: float
) -> None:
    assert placement.recompute_interval(adapters) == seconds
