"""The routing decision: preferences, the load bound, fallbacks, exclusions (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_router import routing
from lora_router.routing import Backend, Decision, Reason, Residency, load_bound, route


def pod(
    name: str,
    load: int = 0,
    gpu: tuple[str, ...] = (),
    cpu: tuple[str, ...] = (),
    free_slot: bool = False,
    reporting: bool = True,
) -> Backend:
    residency = Residency(frozenset(gpu), frozenset(cpu), free_slot) if reporting else None
    return Backend(name=name, load=load, residency=residency)


ALL = None  # an adapter without replicas: placed on every pod


@pytest.mark.parametrize(
    ("backends", "expected"),
    [
        ([pod("a"), pod("b", gpu=("x",)), pod("c", cpu=("x",))], Decision("b", Reason.GPU)),
        ([pod("a"), pod("c", cpu=("x",)), pod("d", free_slot=True)], Decision("c", Reason.CPU)),
        ([pod("a", load=0), pod("d", load=1, free_slot=True)], Decision("d", Reason.FREE_SLOT)),
        ([pod("a", load=1), pod("b", load=0)], Decision("b", Reason.LEAST_QUEUED)),
        (
            [pod("a", load=1, reporting=False), pod("b", load=0, reporting=False)],
            Decision("b", Reason.NO_RESIDENCY),
        ),
        # A pod that reports nothing is judged by its queue, like one without the adapter.
        ([pod("a", reporting=False), pod("b", load=1)], Decision("a", Reason.NO_RESIDENCY)),
        ([pod("a", 1, reporting=False), pod("b", load=0)], Decision("b", Reason.LEAST_QUEUED)),
        ([pod("a", 0, reporting=False), pod("b", 1, cpu=("x",))], Decision("b", Reason.CPU)),
    ],
    ids=[
        "gpu-first",
        "cpu-next",
        "free-slot",
        "least-queued",
        "no-reports",
        "silent-by-queue",
        "silent-busier",
        "resident-beats-silent",
    ],
)
def test_preferences(backends: list[Backend], expected: Decision) -> None:
    assert route("x", backends, ALL, known=True) == expected


def test_a_new_pod_takes_an_adapter_another_holds_only_as_overflow() -> None:
    """A pod that has never reported is new: the operator is still loading its adapters, so an
    adapter held elsewhere goes to a holder, however idle the new pod; one gone stale may hold it
    and is judged by its queue."""
    new = Backend("new", 0, None, heard=False)
    assert route("x", [new, pod("b", load=1, gpu=("x",))], ALL, known=True) == Decision(
        "b", Reason.GPU
    )
    stale = Backend("stale", 0, None)  # b is at the bound: the stale pod is the only candidate
    assert route("x", [stale, pod("b", load=2, gpu=("x",))], ALL, known=True) == Decision(
        "stale", Reason.NO_RESIDENCY
    )
    # Every holder at the bound: the new pod takes the overflow.
    busy = pod("b", load=5, gpu=("x",))
    assert route("x", [new, busy], ALL, known=True) == Decision("new", Reason.OVERFLOW)
    # Nobody holds it yet: every Ready pod is a candidate, the new one included.
    assert route("x", [new, pod("b", load=1)], ALL, known=True) == Decision(
        "new", Reason.NO_RESIDENCY
    )


def test_inside_a_resident_rank_the_hash_not_the_queue_chooses() -> None:
    """Consistent hashing with bounded loads: while its pod is within the bound, an adapter
    resident on several pods keeps going to one of them, whatever the queues say (short of a
    request waiting there while a candidate is idle, below)."""
    for tier in ("gpu", "cpu"):
        names = [f"p{i}" for i in range(4)]
        chosen = set()
        for loads in ((0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)):
            resident: dict[str, tuple[str, ...]] = {"gpu": (), "cpu": (), tier: ("x",)}
            backends = [
                pod(n, load=load, gpu=resident["gpu"], cpu=resident["cpu"])
                for n, load in zip(names, loads, strict=True)
            ]
            decision = route("x", backends, ALL, known=True, load_factor=1.0)
            assert decision is not None and decision.reason.affinity
            chosen.add(decision.pod)
        assert len(chosen) == 1, chosen
    # Beyond the bound, it goes to another resident pod.
    first = route("x", [pod("p0", gpu=("x",)), pod("p1", gpu=("x",))], ALL, known=True)
    assert first is not None
    busy = [pod(n, load=9 if n == first.pod else 0, gpu=("x",)) for n in ("p0", "p1")]
    other = route("x", busy, ALL, known=True)
    assert other is not None and other.pod != first.pod and other.reason is Reason.GPU


def test_an_idle_candidate_is_never_passed_over_for_a_busy_one() -> None:
    """Where a request already waits, a newcomer would wait a whole generation; an idle pod
    costs at most a miss. Among idle candidates, the preferences as usual; one request running
    (perhaps a report a poll old) does not turn the adapter away from its pod."""
    backends = [pod("a", load=2, gpu=("x",)), pod("b", load=0), pod("c", load=0, cpu=("x",))]
    assert route("x", backends, ALL, known=True, load_factor=2.0) == Decision("c", Reason.CPU)
    placed = frozenset({"a", "b"})
    assert route("x", backends[:2], placed, known=True, load_factor=2.0) == Decision(
        "b", Reason.LEAST_QUEUED
    )
    running = [pod("a", load=1, gpu=("x",)), pod("b", load=0)]
    assert route("x", running, placed, known=True) == Decision("a", Reason.GPU)


def test_a_request_waiting_sends_the_newcomer_to_a_less_loaded_pod_holding_its_adapter() -> None:
    """Where a request already waits, a pod with less load that holds the adapter in memory
    costs a copy into a slot, less than a generation; a busier or an equally busy one does not
    help, nor does a less loaded one that would read the adapter first while busy."""
    placed = frozenset("abcd")
    waiting = pod("a", load=2, gpu=("x",))
    lighter = [waiting, pod("b", load=1, cpu=("x",)), pod("c", load=1)]
    assert route("x", lighter, placed, known=True, load_factor=2.0) == Decision("b", Reason.CPU)
    # The least loaded of those that qualify: an idle pod before a busy one holding it.
    idle = [*lighter, pod("d", load=0)]
    assert route("x", idle, placed, known=True, load_factor=2.0) == Decision(
        "d", Reason.LEAST_QUEUED
    )
    # Nothing lighter holds it, and nothing is idle: the adapter stays where it is resident.
    busy = [waiting, pod("b", load=2, cpu=("x",)), pod("c", load=1)]
    assert route("x", busy, placed, known=True, load_factor=2.0) == Decision("a", Reason.GPU)
    # Among the lighter ones holding it, GPU-resident before CPU-resident, as everywhere.
    both = [pod("a", load=3, gpu=("x",)), pod("b", load=1, cpu=("x",)), pod("c", 1, gpu=("x",))]
    assert route("x", both, placed, known=True, load_factor=2.0) == Decision("c", Reason.GPU)


def test_an_adapter_without_replicas_goes_to_the_pods_that_hold_it() -> None:
    """Its selector may leave pods out: only those that report it (any tier) or report nothing
    are candidates; when no pod reports it, any Ready pod (the server's resolver answers)."""
    backends = [pod("a", free_slot=True), pod("b", load=3), pod("c", load=5, reporting=False)]
    held = Residency(frozenset(), frozenset(), False, disk=frozenset({"x"}))
    backends[1] = Backend("b", 3, held)
    decision = route("x", backends, ALL, known=True, load_factor=2.0)
    assert decision is not None and decision.pod in {"b", "c"}
    nobody = [pod("a", load=1), pod("b", load=0)]
    assert route("x", nobody, ALL, known=True) == Decision("b", Reason.LEAST_QUEUED)


def test_only_placed_pods_are_candidates() -> None:
    backends = [pod("a", gpu=("x",)), pod("b"), pod("c", cpu=("x",))]
    assert route("x", backends, frozenset({"b", "c"}), known=True) == Decision("c", Reason.CPU)


def test_unknown_names_and_unready_placements_go_to_the_least_queued_pod() -> None:
    backends = [pod("a", load=2), pod("b", load=1, gpu=("x",)), pod("c", load=0)]
    assert route("x", backends, ALL, known=False) == Decision("c", Reason.UNPLACED)
    assert route("x", backends, frozenset({"gone"}), known=True) == Decision("c", Reason.UNPLACED)


def test_the_base_model_goes_to_the_least_queued_pod() -> None:
    backends = [pod("a", load=3), pod("b", load=1)]
    assert route(None, backends, ALL, known=False) == Decision("b", Reason.BASE)


def test_no_ready_pod_means_no_decision() -> None:
    assert route("x", [], ALL, known=True) is None
    assert route("x", [pod("a")], ALL, known=True, exclude=frozenset({"a"})) is None


def test_a_retry_skips_the_pod_that_failed() -> None:
    backends = [pod("a", gpu=("x",)), pod("b", cpu=("x",))]
    assert route("x", backends, ALL, known=True, exclude=frozenset({"a"})) == Decision(
        "b", Reason.CPU
    )


def test_a_busy_resident_pod_spills_to_a_placed_one_within_the_bound() -> None:
    # 4 pods, 6 requests queued: the bound is ceil(1.25 x 7 / 4) = 3.
    backends = [pod("a", 3, gpu=("x",)), pod("b", 1), pod("c", 1), pod("d", 1)]
    assert load_bound(backends, 0.25) == 3
    assert route("x", backends, frozenset({"a", "b"}), known=True) == Decision(
        "b", Reason.LEAST_QUEUED
    )


def test_every_placed_pod_at_the_bound_overflows_to_the_least_queued_pod() -> None:
    backends = [pod("a", 4, gpu=("x",)), pod("b", 4), pod("c", 0)]
    assert route("x", backends, frozenset({"a", "b"}), known=True) == Decision("c", Reason.OVERFLOW)


def test_ties_follow_a_stable_hash_per_adapter() -> None:
    backends = [pod(f"p{i}") for i in range(8)]
    first = {name: route(name, backends, ALL, known=True) for name in ("x", "y", "z")}
    again = {name: route(name, list(reversed(backends)), ALL, known=True) for name in first}
    assert first == again
    assert len({d.pod for d in first.values() if d is not None}) > 1  # not all on one pod


@pytest.mark.parametrize(
    ("reason", "affinity"), [(r, r in (Reason.GPU, Reason.CPU)) for r in Reason], ids=str
)
def test_affinity_reasons(reason: Reason, affinity: bool) -> None:
    assert reason.affinity is affinity


backend_lists = st.lists(
    st.builds(
        pod,
        name=st.sampled_from([f"p{i}" for i in range(8)]),
        load=st.integers(0, 10),
        gpu=st.lists(st.sampled_from("xyz"), max_size=2).map(tuple),
        cpu=st.lists(st.sampled_from("xyz"), max_size=3).map(tuple),
        free_slot=st.booleans(),
        reporting=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda b: b.name,
)


@settings(max_examples=500, deadline=None)
@given(
    backend_lists,
    st.sampled_from(["x", "y", None]),
    st.one_of(st.none(), st.frozensets(st.sampled_from([f"p{i}" for i in range(10)]))),
    st.booleans(),
    st.frozensets(st.sampled_from([f"p{i}" for i in range(8)])),
    st.floats(0, 2),
)
def test_properties(
    backends: list[Backend],
    adapter: str | None,
    placed: frozenset[str] | None,
    known: bool,
    exclude: frozenset[str],
    load_factor: float,
) -> None:
    decision = route(
        adapter, backends, placed, known=known, load_factor=load_factor, exclude=exclude
    )
    eligible = [b for b in backends if b.name not in exclude]
    if not eligible:
        assert decision is None
        return
    assert decision is not None
    # Only a given (Ready) pod that is not excluded.
    assert decision.pod in {b.name for b in eligible}
    chosen = next(b for b in eligible if b.name == decision.pod)
    least = min(b.load for b in eligible)
    if decision.reason in (Reason.BASE, Reason.UNPLACED, Reason.OVERFLOW):
        assert chosen.load == least
    else:
        # A placed pod, within the load bound.
        assert placed is None or decision.pod in placed
        assert chosen.load + 1 <= load_bound(eligible, load_factor)
    if decision.reason is Reason.GPU:
        assert chosen.residency is not None and adapter in chosen.residency.gpu
    if decision.reason is Reason.NO_RESIDENCY:
        assert chosen.residency is None


@pytest.mark.parametrize("weight", [0, 1, 10, 25, 33, 50, 99, 100])
def test_a_rollout_split_is_exact_and_even(weight: int) -> None:
    sent = [routing.to_canary(n, weight) for n in range(1000)]
    assert sum(sent) == 10 * weight
    # Evenly spread: any run of requests is within one of its share.
    for start in range(0, 1000, 7):
        for length in (1, 5, 20, 100):
            window = sum(sent[start : start + length])
            assert abs(window - len(sent[start : start + length]) * weight / 100) <= 1


@pytest.mark.parametrize(
    ("working_set", "slots", "pays"),
    [
        (None, 4, True),  # too few requests yet: stay on (a cold fleet)
        (100, None, True),  # no pod reports its slots
        (5, 4, True),  # more adapters than a pod's slots: where they are matters
        (4, 4, False),  # every pod can hold the whole working set
        (1, 4, False),
    ],
    ids=["unknown-working-set", "unknown-slots", "more-than-slots", "fits", "one-adapter"],
)
def test_affinity_pays_only_when_a_pod_cannot_hold_the_working_set(
    working_set: int | None, slots: int | None, pays: bool
) -> None:
    assert routing.affinity_pays(working_set, slots) is pays


def test_without_affinity_the_least_queued_candidate_whatever_is_resident() -> None:
    backends = [pod("a", load=2, gpu=("x",)), pod("b", load=0), pod("c", load=1, cpu=("x",))]
    everywhere = frozenset({"a", "b", "c"})
    assert route("x", backends, everywhere, known=True, affinity=False) == Decision(
        "b", Reason.BALANCED
    )
    # ... among the pods it is placed on, and within the bound like any choice.
    placed = frozenset({"a", "c"})
    assert route("x", backends, placed, known=True, affinity=False) == Decision(
        "c", Reason.BALANCED
    )
    busy = [pod("a", load=9, gpu=("x",)), pod("b", load=0)]
    assert route("x", busy, frozenset({"a"}), known=True, affinity=False) == Decision(
        "b", Reason.OVERFLOW
    )
    # The base model and unknown names are routed as before.
    assert route(None, backends, ALL, known=False, affinity=False) == Decision("b", Reason.BASE)


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 20), min_size=1, max_size=8),
    resident=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_without_affinity_no_candidate_is_less_loaded_than_the_choice(
    loads: list[int], resident: list[bool]
) -> None:
    backends = [
        pod(f"p{i}", load=load, gpu=("x",) if resident[i] else ()) for i, load in enumerate(loads)
    ]
    everywhere = frozenset(b.name for b in backends)
    decision = route("x", backends, everywhere, known=True, affinity=False)
    assert decision is not None
    chosen = next(b for b in backends if b.name == decision.pod)
    assert chosen.load == min(b.load for b in backends)
