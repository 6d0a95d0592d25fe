"""One adapter on one pod: the load state machine (pure: no I/O, no clock, no kopf).

A `PodEntry` is the operator's record of one adapter on one pod; `transition` is the only thing
that changes it, one event at a time:

    Pending  --Started-->    Loading     the operator calls POST /v1/load_lora_adapter
    Loading  --Succeeded-->  Loading     the call answered 200 (not yet evidence: see Reported)
    Loading  --Failed-->     Pending     a transient failure below the retry bound (attempts + 1)
    Loading  --Failed-->     Failed      a transient failure reaching the bound: retried, and the
                                         adapter is Degraded while it lasts
    any      --Failed!-->    Failed      a permanent refusal (422, 400 ...): never retried for
                                         this want, at once for another (revision, scale, pin)
    any      --Conflicted--> Failed      the pod serves another adapter by this name (permanent)
    any      --Reported-->   Loaded      the pod's own card for it shows the wanted revision
                                         (in /v1/models, or in its answer to the load call)
    Loaded   --Reported-->   Pending     the pod no longer lists it (its server restarted empty)
    Loading  --Reported-->   Pending     the pod answered 200 but does not list the wanted
                                         revision: a failed load like any other (attempts + 1,
                                         Failed at the bound), retried with the same backoff

Only `Reported` makes an entry Loaded: what the pod says is the only evidence that it serves an
adapter (its list, or the card it answers a load with; a bare 200 is not evidence). The worker of a
pod (controller/workers.py) feeds the events and acts; this module decides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from lora_runtime import backoff

from lora_operator.rules.planning import Card, Want, satisfied

PodState = Literal["Pending", "Loading", "Loaded", "Failed"]


@dataclass(frozen=True)
class PodEntry:
    state: PodState = "Pending"
    revision: str | None = None  # the sha256 the pod last reported for the adapter
    attempts: int = 0  # consecutive transient failures
    last_error: str | None = None
    refused: Want | None = None  # what the pod refused for good: not retried while wanted
    loaded_at: str | None = None
    load_seconds: float | None = None
    accepted: bool = False  # the last load call answered 200; the next report must list it

    @property
    def permanent(self) -> bool:
        """Failed for good (until the want changes)."""
        return self.state == "Failed" and self.refused is not None

    @property
    def retrying(self) -> bool:
        """Failed past the retry bound, and retried: the adapter is Degraded."""
        return self.state == "Failed" and self.refused is None

    def serves(self, sha256: str | None) -> bool:
        return sha256 is not None and self.state == "Loaded" and self.revision == sha256


@dataclass(frozen=True)
class Started:
    want: Want


@dataclass(frozen=True)
class Succeeded:
    want: Want
    seconds: float
    at: str  # RFC 3339


@dataclass(frozen=True)
class Failed:
    want: Want
    message: str
    permanent: bool


@dataclass(frozen=True)
class Conflicted:
    want: Want
    message: str


@dataclass(frozen=True)
class Reported:
    """What the pod's /v1/models said about the adapter (None: not listed)."""

    want: Want
    card: Card | None


Event = Started | Succeeded | Failed | Conflicted | Reported


def may_load(entry: PodEntry, want: Want) -> bool:
    """Whether a load of `want` may be attempted (a refusal is final for the same want)."""
    return not (entry.permanent and entry.refused == want)


def transition(entry: PodEntry, event: Event, *, retry_bound: int) -> PodEntry:
    """The entry after `event` (pure). `retry_bound`: transient failures before Failed."""
    if isinstance(event, Started):
        if not may_load(entry, event.want):
            return entry
        return replace(entry, state="Loading", refused=None, accepted=False)
    if isinstance(event, Succeeded):
        # Not yet evidence: `attempts` stays until the pod lists the revision (Reported).
        return replace(
            entry,
            state="Loading",
            refused=None,
            accepted=True,
            loaded_at=event.at,
            load_seconds=round(event.seconds, 3),
        )
    if isinstance(event, Failed | Conflicted):
        permanent = isinstance(event, Conflicted) or event.permanent
        if permanent:
            return replace(
                entry, state="Failed", refused=event.want, last_error=event.message, accepted=False
            )
        return _failed_once(entry, event.message, retry_bound)
    return _reported(entry, event, retry_bound)


def _reported(entry: PodEntry, event: Reported, retry_bound: int) -> PodEntry:
    card = event.card
    revision = card.revision if card is not None else None
    if card is not None and satisfied(event.want, card):
        return replace(
            entry,
            state="Loaded",
            revision=revision,
            attempts=0,
            last_error=None,
            refused=None,
            accepted=False,
        )
    if entry.accepted:
        # The pod said 200 and then does not list it: counted as a failed load, so that the
        # retries back off and end Degraded instead of calling once a pass for ever.
        listed = "does not list it" if card is None else f"lists revision {revision}"
        return replace(
            _failed_once(
                entry,
                f"the pod accepted the load (200) but {listed} in GET /v1/models",
                retry_bound,
            ),
            revision=revision,
        )
    if entry.refused is not None:
        if entry.refused == event.want:
            return replace(entry, revision=revision)  # refused: stays Failed
        # Refused for another revision, scale or pin: the new want starts afresh.
        return PodEntry(revision=revision)
    retrying = entry.attempts >= retry_bound
    return replace(entry, state="Failed" if retrying else "Pending", revision=revision)


def _failed_once(entry: PodEntry, message: str, retry_bound: int) -> PodEntry:
    attempts = entry.attempts + 1
    return replace(
        entry,
        state="Failed" if attempts >= retry_bound else "Pending",
        attempts=attempts,
        last_error=message,
        refused=None,
        accepted=False,
    )


def retry_delay(entry: PodEntry, cap: float) -> float | None:
    """When the pod's worker should try this entry again (1 s, 2 s, 4 s ... capped at `cap`),
    or None when nothing is to do."""
    if entry.state == "Loaded" or entry.permanent:
        return None
    return backoff.delay(entry.attempts + 1, cap=cap)
