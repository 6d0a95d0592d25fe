"""From what the operator knows about one adapter to its `.status`, and when to write it (pure).

The controller keeps a `StagingState` per adapter and a `podstate.PodEntry` per (adapter, pod);
`summarise` turns them into the phase, its reason and the conditions (a `Summary`). A pod counts
as ready only when its own `/v1/models` reported the adapter at the staged revision.
`statuswrite` renders a `Summary` into the `.status` object and decides when to write it.

Phases, in the order `summarise` decides them (the first that applies wins; reasons in
parentheses):

    Failed    a permanent error: staging (the error's reason: a bad source, a checksum, not a
              LoRA ...) or a pod refusing the adapter (LoadFailed: incompatible with its base
              model, or a name the pod already serves); retried only when the spec changes
    Degraded  staging failed `retry_bound` times in a row (the error's reason), or some pod's
              loads did (LoadRetrying): retries go on, and the phase stays Degraded through them
              until an attempt succeeds
    Staging   the source is being downloaded and verified (Staging), or retried below the bound
              (the error's reason)
    Pending   nothing staged yet (NotStaged)
    Degraded  placed on fewer pods than `spec.replicas` (or autoscale) asks for, and loaded on
              every pod it is placed on: the other matching pods have no room
              (InsufficientCapacity), or fewer pods match (FewerPodsThanReplicas). While it is
              still loading there the phase is Loading, the Degraded condition already True
    Pending   no Ready pod in the namespace matches the selector and serves the base model
              (NoPods)
    Ready     every targeted pod reports the staged revision (Ready)
    Loading   staged; some targeted pods do not report it yet (Loading)

The Degraded condition says the first of: staging past the bound, a pod's loads past the bound,
a placement shortfall, staging retried below the bound (False, Retrying), nothing (False,
AsExpected).

Messages stay small at any number of pods: they name at most `MAX_NAMED_PODS` pods
(`name_list`) and cut errors to `MAX_ERROR_CHARS` (`cut_error`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from lora_volume import description

from lora_operator.rules.model import AdapterInfo, PodInfo, StagedRef
from lora_operator.rules.placement import Placed, Shortfall
from lora_operator.rules.podstate import PodEntry

Phase = Literal["Pending", "Staging", "Loading", "Ready", "Degraded", "Failed"]
PHASES: tuple[Phase, ...] = get_args(Phase)
WARNING_PHASES = ("Degraded", "Failed")
# Reasons of a phase that are news but no trouble; every other reason is a Warning.
NORMAL_REASONS = ("NotStaged", "Staging", "NoPods", "Loading", "Ready")

MAX_NAMED_PODS = 5
MAX_ERROR_CHARS = 400


@dataclass
class StagingState:
    """The controller's record of staging one adapter (mutable, owned by its adapter record)."""

    in_progress: bool = False
    bytes_so_far: int = 0
    attempts: int = 0  # consecutive transient failures of this generation
    next_attempt_at: str | None = None  # RFC 3339, while waiting to retry
    error_reason: str | None = None
    error_message: str | None = None
    permanent: bool = False
    degraded_at_once: bool = False  # the failure degrades without waiting for the retry bound
    staged: StagedRef | None = None
    path: str | None = None  # the revision directory on the operator's volume
    staged_at: str | None = None
    observed_generation: int | None = None
    adapter: description.Description | None = None  # what the staged revision's weights declare
    # What the source resolved to when the staged revision was fetched (an oci:// reference's
    # manifest by digest, `StagedRevision.resolved`); None when that staging fetched nothing or
    # the source names no resolution.
    resolved: str | None = None

    def failed(
        self,
        *,
        permanent: bool,
        reason: str,
        message: str,
        next_at: str | None,
        degraded_at_once: bool = False,
    ) -> None:
        self.in_progress = False
        self.error_reason, self.error_message = reason, message
        self.permanent, self.degraded_at_once = permanent, degraded_at_once
        if permanent:
            self.next_attempt_at = None
        else:
            self.attempts += 1
            self.next_attempt_at = next_at

    def succeeded(
        self,
        staged: StagedRef,
        path: str,
        at: str,
        generation: int,
        adapter: description.Description,
        resolved: str | None = None,
    ) -> None:
        self.in_progress = False
        self.attempts, self.permanent, self.next_attempt_at = 0, False, None
        self.degraded_at_once = False
        self.error_reason = self.error_message = None
        self.staged, self.path, self.staged_at = staged, path, at
        self.observed_generation = generation
        self.adapter, self.resolved = adapter, resolved


@dataclass(frozen=True)
class Condition:
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str


@dataclass(frozen=True)
class Summary:
    phase: Phase
    reason: str  # why the phase is what it is, a CamelCase word (the phase's Event reason)
    message: str  # the same in words (the phase's Event note)
    desired: int
    ready: int
    conditions: tuple[Condition, ...] = field(default=())

    @property
    def headline(self) -> tuple[str, str]:
        return (self.phase, self.reason)

    @property
    def warning(self) -> bool:
        return self.phase in WARNING_PHASES or self.reason not in NORMAL_REASONS


Targeted = Sequence[tuple[PodInfo, PodEntry]]
# The (phase, reason) a status was written with; the reason is None when another process of the
# operator wrote it (then only the phase is known).
Headline = tuple[str, str | None]


def same_headline(previous: Headline | None, summary: Summary) -> bool:
    return (
        previous is not None
        and previous[0] == summary.phase
        and previous[1] in (None, summary.reason)
    )


def summarise(
    info: AdapterInfo,
    staging: StagingState,
    targeted: Targeted,
    *,
    retry_bound: int = 4,
    placed: Placed | None = None,
    serving: str | None = None,
) -> Summary:
    """`targeted`: the pods the adapter belongs on (with spec.replicas or spec.autoscale, the
    ones it is placed on); `placed`: its placement, for those adapters; `serving`: the revision
    the pods should hold under the adapter's name while a rollout keeps the one before the
    staged one (None: the staged one)."""
    staged = staging.staged
    if staged is not None and serving is not None:
        staged = StagedRef(sha256=serving, size=staged.size)
    n = len(targeted)
    ready = sorted(p.name for p, e in targeted if e.serves(staged.sha256 if staged else None))
    refused = sorted((p.name, e) for p, e in targeted if e.permanent)
    retrying = sorted((p.name, e) for p, e in targeted if e.retrying)
    r = len(ready)

    staged_c = _staged_condition(staging)
    ready_c = _ready_condition(info, staged, targeted, ready, refused)
    staging_degraded = not staging.permanent and (
        staging.attempts >= retry_bound or (staging.attempts > 0 and staging.degraded_at_once)
    )
    if staging_degraded:
        count = (
            ""
            if staging.degraded_at_once
            else f"staging failed {staging.attempts} times in a row: "
        )
        degraded_c = Condition(
            "Degraded",
            "True",
            staging.error_reason or "StagingFailed",
            f"{count}{staging.error_message}; {_next_attempt(staging)}",
        )
    elif retrying:
        pod, entry = retrying[0]
        degraded_c = Condition(
            "Degraded",
            "True",
            "LoadRetrying",
            f"Failed on {len(retrying)}/{n} pods, retrying: {pod}: {cut_error(entry.last_error)}",
        )
    elif staging.attempts:
        degraded_c = Condition(
            "Degraded",
            "False",
            "Retrying",
            f"staging failed {staging.attempts} time(s); it is retried, and the adapter counts "
            f"as Degraded after {retry_bound} failures in a row",
        )
    else:
        degraded_c = Condition(
            "Degraded", "False", "AsExpected", "no staging or load failure is being retried"
        )
    shortfall = _shortfall_condition(placed)
    if shortfall is not None and degraded_c.status == "False":
        degraded_c = shortfall

    phase: Phase
    if staging.permanent:
        phase, reason, message = "Failed", staged_c.reason, staged_c.message
    elif refused:
        phase, reason, message = "Failed", ready_c.reason, ready_c.message
    elif staging_degraded or retrying:
        phase, reason, message = "Degraded", degraded_c.reason, degraded_c.message
    elif staging.in_progress or staging.attempts:
        phase, reason, message = "Staging", staged_c.reason, staged_c.message
    elif staged is None:
        phase, reason, message = "Pending", "NotStaged", staged_c.message
    elif shortfall is not None and r == n:  # serving where it can, on fewer pods than asked
        phase, reason, message = "Degraded", shortfall.reason, shortfall.message
    elif n == 0:
        phase, reason, message = "Pending", ready_c.reason, ready_c.message
    elif r == n:
        phase, reason, message = "Ready", "Ready", ready_c.message
    else:
        phase, reason = "Loading", "Loading"
        message = f"{staged_c.message}; {ready_c.message}"
    return Summary(
        phase=phase,
        reason=reason,
        message=message,
        desired=n,
        ready=r,
        conditions=(staged_c, ready_c, degraded_c),
    )


def _shortfall_condition(placed: Placed | None) -> Condition | None:
    """Degraded=True when the adapter is placed on fewer pods than its replicas, though pods
    match (no matching pod at all is Pending, NoPods)."""
    if placed is None or placed.shortfall in (None, Shortfall.NO_PODS):
        return None
    got, wanted = len(placed.pods), placed.wanted
    if placed.shortfall is Shortfall.FEWER_PODS:
        message = (
            f"placed on all {got} matching pods, fewer than the {wanted} replicas asked for; "
            "add inference pods or lower the replicas"
        )
    else:
        message = (
            f"placed on {got} of {wanted} pods: the other matching pods have no room (a pod "
            "holds as many adapters as its CPU tier, --max-cpu-loras, and as many pinned ones "
            "as its GPU slots less one); add inference pods, raise their tiers or lower the "
            "replicas"
        )
    return Condition("Degraded", "True", str(placed.shortfall), message)


def _staged_condition(staging: StagingState) -> Condition:
    if staging.permanent:
        return Condition(
            "Staged", "False", staging.error_reason or "StagingFailed", staging.error_message or ""
        )
    if staging.attempts:
        # Through retries the reason stays the failure's: an attempt starting is no news.
        return Condition(
            "Staged",
            "False",
            staging.error_reason or "StagingFailed",
            f"{staging.error_message}; {_next_attempt(staging)}",
        )
    if staging.in_progress:
        return Condition(
            "Staged", "False", "Staging", f"downloading: {staging.bytes_so_far} bytes so far"
        )
    if staging.staged is not None:
        return Condition(
            "Staged",
            "True",
            "Staged",
            f"sha256 {staging.staged.sha256} ({staging.staged.size} bytes)",
        )
    return Condition("Staged", "False", "Pending", "waiting to be staged")


def _next_attempt(staging: StagingState) -> str:
    if staging.in_progress:
        return f"attempt {staging.attempts + 1} is running"
    return f"attempt {staging.attempts + 1} at {staging.next_attempt_at}"


def _ready_condition(
    info: AdapterInfo,
    staged: StagedRef | None,
    targeted: Targeted,
    ready: Sequence[str],
    refused: Sequence[tuple[str, PodEntry]],
) -> Condition:
    n, r = len(targeted), len(ready)
    if staged is None:
        return Condition("Ready", "False", "NotStaged", "waiting for the weights to be staged")
    revision = f"revision {staged.sha256[:12]}"
    if refused:
        pod, entry = refused[0]
        return Condition(
            "Ready",
            "False",
            "LoadFailed",
            f"Failed on {len(refused)}/{n} pods: {pod}: {cut_error(entry.last_error)}; "
            f"loaded on {r}/{n}",
        )
    if n == 0:
        return Condition(
            "Ready",
            "False",
            "NoPods",
            f"no Ready inference pod in namespace {info.namespace} matches the selector and "
            f"serves base model {info.base_model!r}",
        )
    if r == n:
        return Condition("Ready", "True", "Loaded", f"Loaded on {r}/{n} pods ({revision})")
    done = set(ready)
    waiting = sorted(p.name for p, _ in targeted if p.name not in done)
    return Condition(
        "Ready",
        "False",
        "Loading",
        f"Loaded on {r}/{n} pods ({revision}); waiting for {name_list(waiting)}",
    )


def name_list(names: Sequence[str], limit: int = MAX_NAMED_PODS) -> str:
    """'a, b, c' or 'a, b, c and 7 more': a message never grows with the number of pods."""
    shown = ", ".join(names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown


def cut_error(text: str | None) -> str:
    """An error message cut to what a status or an Event carries."""
    text = text or "no detail"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
