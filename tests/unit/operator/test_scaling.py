"""The operator's pure planners grow linearly: the work of one full round of planning at
K = 10,000 adapters on N = 50 pods against K = 1,000 on N = 10, counted, not timed (speed
figures belong in bench/: bench_placement.py, bench_operator.py).

The work is the number of lines of the project's own code executed (a tracer counts them; the
work done in C, sorting included, is not counted, and where it matters it is n log n), so the
figure is the same on any machine and under any load. A round is what the controller does for
every adapter in one namespace (the worst case: every per-namespace pass sees all K): placement
(`plan_demands`, `plan_placement`, `by_pod`), one pod's pass (`plan_wants`, `plan_pod`), each
placed entry's load state machine (`podstate.transition`: started, succeeded, reported), each
adapter's status (`summarise`, `render`, `write_delay`, `plan_event`), and the Events' series
(`Series.record` for each adapter's Event, then `Series.forget` as each is deleted). Each is held
to 2x its linear growth, a K x K pass would be 10x.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from lora_operator.rules import events, placement, planning, podstate, statuswrite
from lora_operator.rules import status as status_mod
from lora_operator.rules.model import AdapterInfo, PodInfo, adapter_info, pod_info

from tests.support.linecount import project_lines

NS = "team"
SMALL, LARGE = (1_000, 10), (10_000, 50)
MARGIN = 2.0  # the growth allowed over linear (a quadratic pass would be 10x)
POLICY = statuswrite.WritePolicy()


def lines_run(work: Callable[[], object]) -> int:
    """How many lines of the checkout's own Python code `work` executes."""
    counted = 0

    def one() -> None:
        nonlocal counted
        counted += 1

    with project_lines(one):
        work()
    return counted


@dataclass
class Fleet:
    """One namespace: K adapters (a Zipf share of them autoscaled, the rest spec.replicas 2)
    on N pods that advertise room for all of them."""

    k: int
    n: int

    def __post_init__(self) -> None:
        self.pods = [_pod(f"inference-{i}") for i in range(self.n)]
        self.adapters = [_adapter(i) for i in range(self.k)]
        room = 4 * self.k * 2 // self.n + 8
        self.reports = {
            p.name: (p, planning.PodReport("sd", {}, max_loras=8, max_cpu_loras=room))
            for p in self.pods
        }


def _pod(name: str) -> PodInfo:
    return pod_info(
        {
            "metadata": {"namespace": NS, "name": name, "uid": name, "labels": {"app": "x"}},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )


def _adapter(i: int) -> AdapterInfo:
    # Zipf: the first adapters are the hot ones, and those autoscale.
    spec: dict[str, Any] = {"baseModel": "sd", "source": {"uri": f"/v/a-{i}"}}
    if i % 10 == 0:
        spec["autoscale"] = {"minReplicas": 2, "maxReplicas": 4}
    else:
        spec["replicas"] = 2
    return adapter_info(
        {
            "metadata": {
                "namespace": NS,
                "name": f"a-{i:05d}",
                "uid": f"uid-{i}",
                "generation": 1,
                "creationTimestamp": f"2026-01-01T00:00:{i % 60:02d}Z",
            },
            "spec": spec,
            "status": {"staged": {"sha256": f"{i:064x}", "sizeBytes": 1}},
        }
    )


def _replicas(info: AdapterInfo) -> int:
    return info.replicas if info.replicas is not None else 2


def _placement(fleet: Fleet) -> placement.Placement:
    capacities, demands = placement.plan_demands(fleet.adapters, fleet.reports, _replicas)
    chosen = placement.plan_placement(capacities, demands)
    chosen.by_pod()
    return chosen


def _pod_pass(fleet: Fleet, chosen: placement.Placement) -> None:
    pod = fleet.pods[0]
    candidates = [planning.Candidate(a, a.staged) for a in fleet.adapters]
    wants, keep = planning.plan_wants(pod, "sd", candidates, chosen.adapters)
    # The pod holds half of what it should, the other half at another revision.
    cards = {
        name: planning.Card(name, w.sha256 if i % 2 else "f" * 64, w.scale, w.pinned, 0, name)
        for i, (name, w) in enumerate(wants.items())
    }
    planning.plan_pod(wants, planning.PodReport("sd", cards), keep)


def _entries(fleet: Fleet, chosen: placement.Placement) -> dict[str, list[podstate.PodEntry]]:
    out = {}
    for a in fleet.adapters:
        assert a.staged is not None
        want = planning.Want(a.name, a.staged.sha256, a.scale, a.pinned)
        card = planning.Card(a.name, a.staged.sha256, a.scale, a.pinned, 0, a.name)
        entries = []
        for _ in chosen.pods_of(a.name):
            entry = podstate.PodEntry()
            for event in (
                podstate.Started(want),
                podstate.Succeeded(want, 0.1, "2026-01-01T00:00:00Z"),
                podstate.Reported(want, card),
            ):
                entry = podstate.transition(entry, event, retry_bound=4)
            entries.append(entry)
        out[a.name] = entries
    return out


def _statuses(
    fleet: Fleet, chosen: placement.Placement, entries: dict[str, list[podstate.PodEntry]]
) -> None:
    by_name = {p.name: p for p in fleet.pods}
    for a in fleet.adapters:
        staging = status_mod.StagingState(staged=a.staged, path="/v", observed_generation=1)
        placed = chosen.adapters[a.name]
        targeted = [(by_name[p], e) for p, e in zip(placed.pods, entries[a.name], strict=True)]
        summary = status_mod.summarise(a, staging, targeted, placed=placed)
        body = statuswrite.render(a, staging, targeted, summary, [], "2026-01-01T00:00:00Z", placed)
        statuswrite.write_delay(
            None, None, body, summary, since_headline=0, since_write=0, policy=POLICY
        )
        events.plan_event(None, summary)


def _series(fleet: Fleet) -> None:
    series = events.Series()
    for i, a in enumerate(fleet.adapters):
        series.record((a.uid, "Normal", "Ready", "Loaded"), i / 1000, f"e-{i}")
    for a in fleet.adapters:
        series.forget(a.uid)


def rounds(fleet: Fleet) -> Iterator[tuple[str, Callable[[], object]]]:
    chosen = _placement(fleet)
    entries = _entries(fleet, chosen)
    yield "placement", lambda: _placement(fleet)
    yield "one pod's pass", lambda: _pod_pass(fleet, chosen)
    yield "load state machine", lambda: _entries(fleet, chosen)
    yield "status and Events", lambda: _statuses(fleet, chosen, entries)
    yield "Event series", lambda: _series(fleet)


@pytest.fixture(scope="module")
def counts() -> dict[str, tuple[int, int]]:
    small, large = Fleet(*SMALL), Fleet(*LARGE)
    return {
        name: (lines_run(work), lines_run(dict(rounds(large))[name]))
        for name, work in rounds(small)
    }


@pytest.mark.parametrize(
    "name",
    ["placement", "one pod's pass", "load state machine", "status and Events", "Event series"],
)
def test_a_round_of_planning_grows_linearly(counts: dict[str, tuple[int, int]], name: str) -> None:
    small, large = counts[name]
    linear = LARGE[0] / SMALL[0]  # every planner's work is per adapter (placed on 2 pods each)
    ratio = large / small
    assert ratio <= MARGIN * linear, (
        f"{name}: {large} lines at K={LARGE[0]} N={LARGE[1]} against {small} at K={SMALL[0]} "
        f"N={SMALL[1]}: {ratio:.1f}x for {linear:.0f}x more adapters"
    )
