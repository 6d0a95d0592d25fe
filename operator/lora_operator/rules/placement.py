"""Which pods hold which adapters: a capacity-weighted consistent hash with bounded loads (pure).

An adapter with `spec.replicas` is placed on that many of the pods it targets; one without is
placed on every pod it targets (what every adapter had before placement existed) and is not held
to capacity, but it uses capacity up first. Each pod advertises how many adapters it can hold
(`slots`: its CPU-tier slots less what it holds that the operator does not manage) and how many
of them may be pinned (`pinned_slots`); a pod is never given more limited adapters than that.

The choice for one adapter: every pod owns points on a 64-bit ring, as many as its capacity asks
(`vnodes`), placed by hashing its name; the adapter hashes to a point and takes the first
`replicas` distinct pods clockwise that have room. So

- adding a pod moves only the placements the new pod takes (its points' arcs), about
  K x replicas / N of them, and removing one moves only the placements it held;
- adding or removing an adapter moves nothing else, unless pods are full;
- nothing depends on the order of the inputs or on any earlier placement: after an operator
  restart the same inputs give the same placement.

Limited adapters are placed pinned ones first (pinned slots are the scarcer resource), then the
oldest first (by creation time, then by hash): on full pods a new adapter waits for room rather
than displacing one that serves already, and which adapter gets the last room is stable. A pod
that runs out of room is skipped by every later walk (a union-find over each ring's points), so a
full placement of K = 10,000 adapters on N = 200 pods takes well under a second (see
bench/bench_placement.py). Adapters that arrive later are placed on the room the others left
(`place_more`), at the cost of the newcomers alone, where that gives what placing them all would.

Purely computational: no I/O, no clock, no randomness beyond the hash. The controller reads the
pods' capacities and the adapters, calls `plan_placement`, and acts on the difference.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from lora_operator.rules.model import AdapterInfo, PodInfo
from lora_operator.rules.planning import PodReport

VNODES_PER_SLOT = 2
MIN_VNODES = 16
MAX_VNODES = 512


@dataclass(frozen=True)
class PodCapacity:
    """What one pod can hold, as it advertises it (net of what it holds on its own)."""

    name: str
    slots: int  # adapters in all (its CPU tier's slots)
    pinned_slots: int  # of which pinned ones (its GPU slots, one kept free for the rest)


@dataclass(frozen=True)
class Demand:
    """One adapter to place."""

    name: str  # unique among the adapters placed together, e.g. "namespace/name"
    replicas: int | None  # None: every candidate pod, not held to capacity
    pinned: bool
    candidates: tuple[str, ...]  # the pods it targets (Ready, its selector, its base model)
    created: str = ""  # its creationTimestamp (RFC 3339 sorts as time): older ones place first


class Shortfall(StrEnum):
    """Why an adapter got fewer pods than `replicas`."""

    NO_PODS = "NoPods"  # no pod matches at all
    FEWER_PODS = "FewerPodsThanReplicas"  # placed on every matching pod, fewer than replicas
    CAPACITY = "InsufficientCapacity"  # enough pods match, but not enough of them have room


@dataclass(frozen=True)
class Placed:
    pods: tuple[str, ...]  # in the order of preference (ring order); every pod for `None`
    wanted: int  # replicas, or the number of candidates when every pod is wanted
    shortfall: Shortfall | None = None


@dataclass(frozen=True)
class Placement:
    adapters: Mapping[str, Placed]
    # The pods whose reports it was made from (None: not said): a pod outside it keeps its
    # placed adapters until a placement counts it (`planning.plan_wants`).
    over: frozenset[str] | None = None
    # What `place_more` continues from: the capacities it was made with, the room it left on
    # each pod (slots, pinned slots), and the order of the last limited adapter it placed.
    pods: tuple[PodCapacity, ...] = ()
    free: Mapping[str, int] = field(default_factory=dict)
    pinned_free: Mapping[str, int] = field(default_factory=dict)
    last: tuple[bool, str, int, str] | None = None

    def pods_of(self, adapter: str) -> tuple[str, ...]:
        placed = self.adapters.get(adapter)
        return placed.pods if placed is not None else ()

    def by_pod(self) -> dict[str, set[str]]:
        """Pod name -> the adapters placed on it."""
        held: dict[str, set[str]] = {}
        for adapter, placed in self.adapters.items():
            for pod in placed.pods:
                held.setdefault(pod, set()).add(adapter)
        return held


def capacity(pod: str, report: PodReport) -> PodCapacity | None:
    """What a pod can take from placement, from its `/v1/models`: its CPU tier less the adapters
    it holds that the operator did not load (`--lora` flags, hand loads), and, for pinned ones,
    its GPU slots less one (kept for unpinned adapters) less its own pinned ones. None when the
    server does not advertise its tiers (vLLM): such a pod gets no placed adapter."""
    if report.max_loras is None or report.max_cpu_loras is None:
        return None
    foreign, foreign_pinned = report.foreign()
    return PodCapacity(
        name=pod,
        slots=max(0, report.max_cpu_loras - foreign),
        pinned_slots=max(0, report.max_loras - 1 - foreign_pinned),
    )


def vnodes(slots: int) -> int:
    """A pod's points on the ring: proportional to its capacity, within bounds (a pod with no
    room still gets a few, so its share does not jump when it reports room again)."""
    return max(MIN_VNODES, min(MAX_VNODES, slots * VNODES_PER_SLOT))


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=65536)
def _points(pod: str, count: int) -> tuple[int, ...]:
    return tuple(_hash(f"{pod}#{i}") for i in range(count))


@functools.lru_cache(maxsize=1 << 17)
def adapter_point(name: str) -> int:
    return _hash(name)


@functools.lru_cache(maxsize=256)
def _sorted_points(
    pods: tuple[tuple[str, int], ...],
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The points of pods (name, point count), sorted, and the pod owning each: kept for the
    pod sets in use, as every batch of arriving adapters walks the same few rings again."""
    pairs = sorted((p, pod) for pod, count in pods for p in _points(pod, count))
    return tuple(p for p, _ in pairs), tuple(pod for _, pod in pairs)


class _Ring:
    """The points of a set of pods, sorted, with a union-find that skips the points of pods
    found full (each point is skipped by a link to its successor, so later walks jump it)."""

    def __init__(self, pods: Iterable[str], counts: Mapping[str, int]) -> None:
        points = tuple((pod, counts[pod]) for pod in pods)
        self.keys, self.owners = _sorted_points(points)
        self.pods = len({pod for pod, count in points if count > 0})
        self._next = list(range(len(self.keys)))  # itself while alive, else a later point
        self._alive = len(self.keys)

    def _find(self, i: int) -> int:
        root = i
        while self._next[root] != root:
            root = self._next[root]
        while self._next[i] != root:  # path compression
            self._next[i], i = root, self._next[i]
        return root

    def walk(self, point: int, want: int, room: _Room) -> list[str]:
        """The first `want` distinct pods clockwise from `point` that have room."""
        n = len(self.keys)
        chosen: list[str] = []
        seen: set[str] = set()
        i = bisect.bisect_left(self.keys, point) % n if n else 0
        while len(chosen) < want and len(seen) < self.pods and self._alive > 0:
            i = self._find(i)
            pod = self.owners[i]
            if pod not in seen:
                seen.add(pod)
                if room.fits(pod):
                    chosen.append(pod)
            if room.full(pod):  # full for every later adapter too: no walk needs this point
                self._next[i] = (i + 1) % n
                self._alive -= 1
            i = (i + 1) % n
        return chosen


@dataclass
class _Room:
    free: dict[str, int]
    pinned_free: dict[str, int]
    pinned: bool = False

    def fits(self, pod: str) -> bool:
        return self.free[pod] > 0 and (not self.pinned or self.pinned_free[pod] > 0)

    def full(self, pod: str) -> bool:
        return self.free[pod] <= 0

    def never_short(self) -> bool:
        """Whether every pod still has room of both kinds: no walk so far found a pod without
        room (room only shrinks), so the order the adapters were placed in made no
        difference."""
        return all(n > 0 for n in self.free.values()) and all(
            n > 0 for n in self.pinned_free.values()
        )

    def take(self, pod: str, pinned: bool) -> None:
        self.free[pod] -= 1
        if pinned:
            self.pinned_free[pod] -= 1


class _Targets:
    """A demand's candidates that advertise capacity, sorted; computed once per distinct list
    (thousands of adapters usually share a handful of candidate lists)."""

    def __init__(self, known: Mapping[str, PodCapacity]) -> None:
        self.known = known
        self.cache: dict[tuple[str, ...], tuple[str, ...]] = {}

    def __call__(self, demand: Demand) -> tuple[str, ...]:
        targets = self.cache.get(demand.candidates)
        if targets is None:
            targets = tuple(sorted({c for c in demand.candidates if c in self.known}))
            self.cache[demand.candidates] = targets
        return targets


def _order(d: Demand) -> tuple[bool, str, int, str]:
    """The order limited adapters are placed in: pinned ones first, then the oldest, then by
    hash (and name, for a tie of hashes)."""
    return (not d.pinned, d.created, adapter_point(d.name), d.name)


def plan_placement(pods: Sequence[PodCapacity], demands: Sequence[Demand]) -> Placement:
    """Place every adapter (pure; the same inputs in any order give the same placement)."""
    targets_of = _Targets({p.name: p for p in pods})
    room = _Room(
        free={p.name: max(0, p.slots) for p in pods},
        pinned_free={p.name: max(0, p.pinned_slots) for p in pods},
    )
    result: dict[str, Placed] = {}

    # Every-pod adapters first: they go everywhere regardless, and use room up.
    limited: list[tuple[Demand, int]] = []
    for d in demands:
        if d.replicas is not None:
            limited.append((d, d.replicas))
            continue
        targets = targets_of(d)
        for pod in targets:
            room.take(pod, d.pinned)
        result[d.name] = Placed(
            pods=targets, wanted=len(targets), shortfall=None if targets else Shortfall.NO_PODS
        )

    limited.sort(key=lambda dw: _order(dw[0]))
    ordered = [d for d, _ in limited]
    result.update(_place_limited(pods, ordered, targets_of, room))
    return Placement(
        adapters=result,
        pods=_by_name(pods),
        free=room.free,
        pinned_free=room.pinned_free,
        last=_order(ordered[-1]) if ordered else None,
    )


def place_more(
    previous: Placement, pods: Sequence[PodCapacity], demands: Sequence[Demand]
) -> Placement | None:
    """`previous` with `demands`, adapters it does not place, placed as well: what
    `plan_placement` gives for all of them, at the cost of the new ones alone; None when that
    cannot be told without placing every adapter again (the pods or their capacities changed,
    a new adapter goes on every pod, or one sorts before an adapter already placed and some pod
    ran out of room, where the order decides who gets it).

    Placed after every earlier adapter, the new ones take what room the earlier ones left, as
    in a placement of all; and while no pod runs out of room, the order decides nothing."""
    if previous.pods != _by_name(pods) or any(d.replicas is None for d in demands):
        return None
    ordered = sorted(demands, key=_order)
    room = _Room(free=dict(previous.free), pinned_free=dict(previous.pinned_free))
    added = _place_limited(pods, ordered, _Targets({p.name: p for p in pods}), room)
    last = previous.last
    if ordered and last is not None and _order(ordered[0]) <= last and not room.never_short():
        return None
    if ordered:
        last = max(last, _order(ordered[-1])) if last is not None else _order(ordered[-1])
    return Placement(
        adapters={**previous.adapters, **added},
        over=previous.over,
        pods=previous.pods,
        free=room.free,
        pinned_free=room.pinned_free,
        last=last,
    )


def _by_name(pods: Iterable[PodCapacity]) -> tuple[PodCapacity, ...]:
    return tuple(sorted(pods, key=lambda p: p.name))


def _place_limited(
    pods: Sequence[PodCapacity], ordered: Sequence[Demand], targets_of: _Targets, room: _Room
) -> dict[str, Placed]:
    """Place adapters with `replicas`, in the order given, on the room left."""
    counts = {p.name: vnodes(p.slots) for p in pods}
    rings: dict[tuple[str, ...], _Ring] = {}
    result: dict[str, Placed] = {}
    for d in ordered:
        wanted = d.replicas or 0  # every one ordered is limited
        targets = targets_of(d)
        ring = rings.get(targets)
        if ring is None:
            ring = rings[targets] = _Ring(targets, counts)
        room.pinned = d.pinned
        chosen = ring.walk(adapter_point(d.name), wanted, room)
        for pod in chosen:
            room.take(pod, d.pinned)
        result[d.name] = Placed(
            pods=tuple(chosen), wanted=wanted, shortfall=_shortfall(wanted, chosen, targets)
        )
    return result


def _shortfall(wanted: int, chosen: Sequence[str], targets: Sequence[str]) -> Shortfall | None:
    if not targets:
        return Shortfall.NO_PODS
    if len(chosen) >= wanted:
        return None
    return Shortfall.FEWER_PODS if len(chosen) == len(targets) else Shortfall.CAPACITY


def moves(before: Placement, after: Placement) -> int:
    """Placements `after` has that `before` did not: the loads a change of inputs costs."""
    total = 0
    for name, placed in after.adapters.items():
        old = set(before.pods_of(name))
        total += sum(1 for pod in placed.pods if pod not in old)
    return total


def plan_demands(
    adapters: Iterable[AdapterInfo],
    reports: Mapping[str, tuple[PodInfo, PodReport]],
    replicas: Callable[[AdapterInfo], int],
) -> tuple[list[PodCapacity], list[Demand]]:
    """What `plan_placement` places, from a namespace's adapters and its Ready pods' reports
    (pod name -> (pod, report)): the pods' capacities and one demand per adapter not being
    deleted. `replicas` says how many pods a placed adapter should be on."""
    ordered = sorted(reports.items())
    capacities = [c for name, (_, report) in ordered if (c := capacity(name, report)) is not None]
    demands = []
    # Adapters share a few (base model, selector) pairs: their candidates are worked out once.
    candidates_of: dict[tuple[str, object], tuple[str, ...]] = {}
    for info in adapters:
        if info.deleting:
            continue
        key = (info.base_model, info.selector)
        candidates = candidates_of.get(key)
        if candidates is None:
            candidates = candidates_of[key] = tuple(
                name for name, (pod, report) in ordered if info.targets(pod, report.base_model)
            )
        wanted = replicas(info) if info.placed else None
        demands.append(Demand(info.name, wanted, info.pinned, candidates, info.created))
    return capacities, demands


# A namespace's placement is recomputed at most every MIN_INTERVAL_S, or once per
# ADAPTERS_PER_SECOND of its adapters, up to MAX_INTERVAL_S.
MIN_INTERVAL_S = 0.5
ADAPTERS_PER_SECOND = 100
MAX_INTERVAL_S = 4.0


def recompute_interval(adapters: int) -> float:
    """The least time between two recomputes of a namespace's placement, from its number of
    adapters: a recompute costs in proportion to them, and the adapters arriving meanwhile are
    placed together. 0.5 s up to 50 adapters, 4 s from 400: while adapters keep arriving, the
    placer's CPU per adapter placed stays level as namespaces grow; a change after a quiet
    while is placed at once."""
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, adapters / ADAPTERS_PER_SECOND))


def inputs(report: PodReport) -> tuple[object, ...]:
    """What of a pod's report placement reads: its base model and its capacity."""
    return (report.base_model, capacity("", report))
