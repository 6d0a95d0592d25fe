"""Which pod one request goes to (pure).

For a request that names an adapter, the candidates are the Ready pods the adapter is placed on;
for one without `spec.replicas` (on every pod its selector matches), the Ready pods that report
holding it (any tier) and those whose report went stale, or every Ready pod when none reports it.
A pod that has never reported (new: the operator is still loading its adapters) is not one of
them while another pod holds the adapter; it takes such requests only as overflow.
Among the candidates whose load stays within the bound, the router prefers, in this order:

1. a pod where the adapter is GPU-resident (no load at all),
2. one where it is CPU-resident (a copy into a GPU slot),
3. one with a free GPU slot (a load that evicts nothing),
4. the least queued,

and, inside one of the first three preferences, a stable hash of (adapter, pod), not the queue:
the same adapter keeps going to the same pod while that pod is within the bound, rather than
warming its copies on several pods that then crowd each other out of their slots. Inside the
last, the least queued, then the hash; and when the chosen pod already has a request waiting,
a less loaded candidate that holds the adapter in memory or is idle (the least loaded of them).
The bound is the one of consistent hashing with bounded loads: no pod takes a request that would
put it above `ceil((1 + e) x (total load + 1) / pods)`. When every candidate is at the bound
the request overflows to the least-queued Ready pod; when no candidate is Ready, or the name is
not an adapter the router knows, it goes to the least-queued Ready pod (the server's resolver
answers names that are staged but not registered, and a 404 for the rest); a request for the
base model goes to the least-queued pod. A pod whose residency report is missing or stale ranks
with the pods that hold neither the adapter nor a free slot: it is judged by its queue alone, and
when no candidate reports, the choice is by queue alone.

Affinity is worth something only when a pod cannot keep every adapter it is asked for resident:
when the adapters of the recent requests (the working set) fit in every pod's GPU slots, each
pod holds them all wherever requests go, and keeping an adapter on one pod only costs balance.
Then (`affinity_pays` is false) the request goes to the least-queued candidate (`balanced`), as
a least-request balancer would send it. Under overload the load bound already spreads the hot
adapters; affinity stays on there, because the misses it saves are what a saturated fleet's
throughput is made of.

Purely computational: the app passes the pods, their reports and loads, and what to exclude (a
pod that just failed this request).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    GPU = "gpu-resident"
    CPU = "cpu-resident"
    FREE_SLOT = "free-slot"
    LEAST_QUEUED = "least-queued"  # placed pods report, none has the adapter or a free slot
    NO_RESIDENCY = "no-residency"  # no placed pod reports its residency: by queue alone
    OVERFLOW = "overflow"  # every placed pod at the load bound
    UNPLACED = "unplaced"  # an unknown name, or no placed pod is Ready
    BASE = "base"  # no adapter: the base model
    BALANCED = "balanced"  # affinity cannot help (affinity_pays): the least-queued candidate

    @property
    def affinity(self) -> bool:
        return self in (Reason.GPU, Reason.CPU)


@dataclass(frozen=True)
class Residency:
    """What a pod last reported: its adapters by tier, and whether a GPU slot is free."""

    gpu: frozenset[str]
    cpu: frozenset[str]
    free_slot: bool
    disk: frozenset[str] = frozenset()  # registered, on the volume only

    def holds(self, adapter: str) -> bool:
        return adapter in self.gpu or adapter in self.cpu or adapter in self.disk


@dataclass(frozen=True)
class Backend:
    name: str  # the pod's name
    load: int  # requests queued or running there, as far as the router knows
    residency: Residency | None  # None: no fresh report
    # Whether it has ever reported: a pod that has not is new (Ready a moment ago), and the
    # operator has not loaded its adapters yet.
    heard: bool = True


@dataclass(frozen=True)
class Decision:
    pod: str
    reason: Reason


def _rank(adapter: str, backend: Backend) -> int:
    if backend.residency is None:  # it may hold the adapter or not: judged by its queue
        return 3
    if adapter in backend.residency.gpu:
        return 0
    if adapter in backend.residency.cpu:
        return 1
    return 2 if backend.residency.free_slot else 3


_REASONS = {0: Reason.GPU, 1: Reason.CPU, 2: Reason.FREE_SLOT, 3: Reason.LEAST_QUEUED}


def _affinity(adapter: str, pod: str) -> int:
    digest = hashlib.blake2b(f"{adapter}\0{pod}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _preference(adapter: str, backend: Backend) -> tuple[int, int, int]:
    """Rank first; inside a resident or free-slot rank the stable hash (the load bound keeps it
    fair), inside the last rank the queue."""
    rank = _rank(adapter, backend)
    return (rank, backend.load if rank == 3 else 0, _affinity(adapter, backend.name))


def load_bound(backends: Sequence[Backend], load_factor: float) -> int:
    """The most requests one pod may hold once this one is added."""
    total = sum(b.load for b in backends) + 1
    return max(1, math.ceil((1 + load_factor) * total / max(1, len(backends))))


def _least_queued(backends: Iterable[Backend], key: str) -> Backend:
    return min(backends, key=lambda b: (b.load, _affinity(key, b.name)))


def affinity_pays(working_set: int | None, slots: int | None) -> bool:
    """Whether sending an adapter where it is resident can save anything (pure).

    `working_set`: the distinct adapters of the recent requests (None: too few requests yet to
    say); `slots`: the fewest GPU slots a reporting pod has (None: no pod reports). False when
    the working set fits in every pod's slots: each pod keeps all of it resident wherever
    requests go. Until the working set is known, affinity stays on: a fleet that starts cold
    should not copy its first adapters onto every pod.
    """
    return working_set is None or slots is None or working_set > slots


def route(
    adapter: str | None,
    backends: Sequence[Backend],
    placed: frozenset[str] | None,
    *,
    known: bool,
    load_factor: float = 0.25,
    exclude: frozenset[str] = frozenset(),
    affinity: bool = True,
) -> Decision | None:
    """The pod for a request naming `adapter` (None: the base model); None when no pod is Ready.

    `backends` are the Ready pods; `placed` the pods the adapter is placed on (None: every pod);
    `known` whether the adapter is a LoRAAdapter the router has seen; `affinity` whether it can
    help (`affinity_pays`): without it, the least-queued candidate.
    """
    ready = [b for b in backends if b.name not in exclude]
    if not ready:
        return None
    if adapter is None:
        return Decision(_least_queued(ready, "").name, Reason.BASE)
    if placed is not None:
        candidates = [b for b in ready if b.name in placed]
    else:  # on every pod its selector matches: those that hold it, and the silent ones
        # (a report gone stale: it may hold it), not a new pod, whose adapters the operator is
        # still loading: while another pod holds the adapter, a new one takes its requests only
        # when every holder is at the bound.
        holders = [b for b in ready if b.residency is not None and b.residency.holds(adapter)]
        silent = [b for b in ready if b.residency is None and b.heard]
        candidates = holders + silent if holders else ready
    if not known or not candidates:
        return Decision(_least_queued(ready, adapter).name, Reason.UNPLACED)
    bound = load_bound(ready, load_factor)
    within = [b for b in candidates if b.load + 1 <= bound]
    if not within:
        return Decision(_least_queued(ready, adapter).name, Reason.OVERFLOW)
    if not affinity:
        return Decision(_least_queued(within, adapter).name, Reason.BALANCED)
    best = min(within, key=lambda b: _preference(adapter, b))
    if best.load >= 2:
        # A request already waits there: the newcomer would wait behind at least one whole
        # generation. A less loaded candidate goes first where that costs less: one that holds
        # the adapter in memory (a copy into a slot is tens of milliseconds, a generation
        # hundreds), or an idle one (at most a first use, and an idle pod is throughput lost).
        # The least loaded of them, then the preferences as usual. One request running does not
        # count: it may be a report up to a poll old, or finishing.
        lighter = [
            b for b in within if b.load < best.load and (b.load == 0 or _rank(adapter, b) <= 1)
        ]
        if lighter:
            best = min(lighter, key=lambda b: (b.load, *_preference(adapter, b)))
    if best.residency is None:
        return Decision(best.name, Reason.NO_RESIDENCY)
    return Decision(best.name, _REASONS[_rank(adapter, best)])


def to_canary(count: int, weight: int) -> bool:
    """Whether request number `count` (from 0) of an adapter under a rollout goes to its canary.

    Each run of 100 requests sends exactly `weight` of them to the canary, spread evenly (the
    n-th goes when the canary's share of the first n + 1 crosses a whole request): the split a
    user set, with no sampling noise, on each router replica.
    """
    weight = max(0, min(100, weight))
    return (count + 1) * weight // 100 > count * weight // 100
