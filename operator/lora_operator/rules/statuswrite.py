"""From an adapter's `Summary` to its `.status` object, and when to write it (pure).

`status.summarise` decides the phase, its reason and the conditions; `render` turns them, with
the staging record and the targeted pods, into the whole `.status` object (a condition keeps its
lastTransitionTime while its status is unchanged), and `write_delay` decides when that object is
worth an API write (`WritePolicy`).

The status stays small at any number of pods: `status.pods` lists at most `MAX_LISTED_PODS`
(the ones not loaded first), `status.unlistedPods` counts the rest by state, and messages name
at most `status.MAX_NAMED_PODS` pods.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_volume import description

from lora_operator.rules.model import AdapterInfo, PodInfo
from lora_operator.rules.placement import Placed, Shortfall
from lora_operator.rules.podstate import PodEntry
from lora_operator.rules.status import (
    Headline,
    StagingState,
    Summary,
    Targeted,
    cut_error,
    same_headline,
)

MAX_LISTED_PODS = 32


def render(
    info: AdapterInfo,
    staging: StagingState,
    targeted: Targeted,
    summary: Summary,
    previous_conditions: Sequence[Mapping[str, Any]],
    now: str,
    placed: Placed | None = None,
) -> dict[str, Any]:
    """The whole `.status` object; a condition keeps its lastTransitionTime while its status
    is unchanged."""
    before = {c.get("type"): c for c in previous_conditions}
    conditions = []
    for c in summary.conditions:
        old = before.get(c.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == c.status else None
        conditions.append(
            {
                "type": c.type,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": since or now,
                "observedGeneration": info.generation,
            }
        )
    listed, unlisted = _list_pods(targeted)
    status: dict[str, Any] = {
        "phase": summary.phase,
        "ready": f"{summary.ready}/{summary.desired}",
        "desiredPods": summary.desired,
        "readyPods": summary.ready,
        "conditions": conditions,
        "pods": [_pod_status(pod, entry) for pod, entry in listed],
        "unlistedPods": unlisted or None,
        "stagingBytes": staging.bytes_so_far if staging.in_progress else None,
        "staged": None,
        "adapter": adapter_status(staging.adapter) if staging.adapter is not None else None,
        "replicas": placed.wanted if placed is not None else None,
        "placedPods": sorted(placed.pods) if placed is not None else None,
    }
    if staging.observed_generation is not None:
        status["observedGeneration"] = staging.observed_generation
    if staging.staged is not None:
        status["staged"] = {
            "sha256": staging.staged.sha256,
            "sizeBytes": staging.staged.size,
            "path": staging.path,
            "stagedAt": staging.staged_at,
            # None (when this staging resolved nothing) removes a value an earlier one wrote.
            "resolvedSource": staging.resolved,
        }
    return status


def adapter_status(adapter: description.Description) -> dict[str, Any]:
    """`status.adapter`: what the staged revision's weights declare (`resume` reads it back)."""
    return {
        "format": adapter.format.key,
        "rank": adapter.rank,
        "targets": list(adapter.targets),
        "triggerWords": list(adapter.trigger_words),
    }


_LISTING_ORDER = {"Failed": 0, "Loading": 1, "Pending": 2, "Loaded": 3}


def _list_pods(
    targeted: Targeted,
) -> tuple[list[tuple[PodInfo, PodEntry]], dict[str, int]]:
    """The pods `status.pods` lists (the not-loaded ones first, at most MAX_LISTED_PODS, by
    name) and the count of the others by state."""
    ranked = sorted(targeted, key=lambda t: (_LISTING_ORDER[t[1].state], t[0].name))
    listed = sorted(ranked[:MAX_LISTED_PODS], key=lambda t: t[0].name)
    return listed, dict(sorted(Counter(e.state for _, e in ranked[MAX_LISTED_PODS:]).items()))


def _pod_status(pod: PodInfo, entry: PodEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"name": pod.name, "state": entry.state}
    for key, value in (
        ("ip", pod.ip),
        ("revision", entry.revision),
        ("lastError", cut_error(entry.last_error) if entry.last_error else None),
        ("loadedAt", entry.loaded_at),
        ("loadSeconds", entry.load_seconds),
    ):
        if value is not None:
            out[key] = value
    return out


# -- when to write ---------------------------------------------------------------------------

# Phases that end a piece of work (or need the user): written as soon as they are known.
SETTLED_PHASES = ("Ready", "Degraded", "Failed")


@dataclass(frozen=True)
class WritePolicy:
    """How often an adapter's status is written (seconds).

    Work in progress (Pending, Staging, Loading) is written once it has lasted `settle_s`, so an
    adapter that becomes Ready quickly costs one write; a change of progress only (the same
    phase and reason: another pod loaded it, more bytes downloaded) at most every `progress_s`.
    A loss of pods only (`pods_lost_only`) is written once the status has differed from the
    object's for `loss_grace_s`: pods that are back by then (a node marked NotReady for a few
    seconds after the API server was away) cost no write and no Event.
    """

    settle_s: float = 3.0
    progress_s: float = 10.0
    loss_grace_s: float = 30.0


def stored(obj: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` as the API server keeps it once written as a merge patch: a key whose value is
    None is no key at all (so a status read back from the object after a restart compares equal
    to the same status rendered again, and is not written for nothing)."""
    return {k: stored(v) if isinstance(v, Mapping) else v for k, v in obj.items() if v is not None}


def write_delay(
    written: Mapping[str, Any] | None,
    written_headline: Headline | None,
    body: Mapping[str, Any],
    summary: Summary,
    *,
    since_headline: float,
    since_write: float,
    since_differs: float = 0.0,
    policy: WritePolicy,
) -> float | None:
    """Seconds to wait before writing `body`, 0 for now, or None when it says nothing new.

    `written`: the status on the object (None: none yet); `written_headline`: its headline;
    `since_headline`: how long the adapter has been in `summary`'s (phase, reason);
    `since_write`: since the status was last written (or first seen); `since_differs`: since
    the status first differed from `written` (0 when it differs only now).
    """
    if written is not None and stored(body) == stored(written):
        return None
    grace = 0.0
    if pods_lost_only(written, body, summary):
        grace = max(0.0, policy.loss_grace_s - since_differs)
    if same_headline(written_headline, summary):
        return max(grace, policy.progress_s - since_write)
    if grace:
        return grace
    if summary.phase in SETTLED_PHASES or summary.warning or summary.reason == "NoPods":
        return 0.0
    return max(0.0, policy.settle_s - since_headline)


# The reasons of a status whose only news may be that pods went away: fewer ready, on fewer
# pods, or none. A failure's reasons are never among them.
LOSS_REASONS = ("Ready", "Loading", "NoPods", Shortfall.FEWER_PODS, Shortfall.CAPACITY)


def pods_lost_only(
    written: Mapping[str, Any] | None, body: Mapping[str, Any], summary: Summary
) -> bool:
    """Whether `body` tells, against the `written` status, only of pods lost: fewer ready pods,
    its placement on no pod it was not on before, the same generation of the spec, and no
    failure. A pod added, a spec changed or anything failing is written as usual."""
    if written is None or summary.reason not in LOSS_REASONS:
        return False
    ready_before = written.get("readyPods")
    if not isinstance(ready_before, int) or summary.ready >= ready_before:
        return False
    if _generation(body) != _generation(written):
        return False
    return set(body.get("placedPods") or ()) <= set(written.get("placedPods") or ())


def _generation(status: Mapping[str, Any]) -> object:
    """The spec generation a status was rendered for (each condition carries it)."""
    conditions = status.get("conditions")
    if isinstance(conditions, list) and conditions and isinstance(conditions[0], Mapping):
        return conditions[0].get("observedGeneration")
    return None


# -- in which order -----------------------------------------------------------------------------


def fair_order(keys: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """(namespace, name) keys in the order their writes are queued: one of each namespace in
    turn (namespaces by name, each one's keys by name), so that every namespace with writes
    waiting gets the same share of the writer's slots. A namespace that applied 5,000 adapters
    delays another's 5 by 5 turns, not by 5,000 writes; no namespace is ever more than one
    write ahead of another that still has writes waiting."""
    by_namespace: dict[str, list[tuple[str, str]]] = {}
    for key in sorted(keys):
        by_namespace.setdefault(key[0], []).append(key)
    queues = list(by_namespace.values())
    out: list[tuple[str, str]] = []
    turn = 0
    while queues:
        queues = [q for q in queues if len(q) > turn]
        out.extend(q[turn] for q in queues)
        turn += 1
    return out
