"""From what the operator knows about one adapter to its `.status` (pure).

The controller keeps a `StagingState` per adapter and a `PodEntry` per (adapter, pod); `summarise`
turns them into the phase and conditions, `render` into the status object. A pod counts as ready
only when its own `/v1/models` reported the adapter at the staged revision.

Phases, in the order they are decided:

    Failed    a permanent error: staging (bad source, checksum, not a LoRA) or a pod refusing the
              adapter (incompatible with its base model); retried only when the spec changes
    Staging   the source is being downloaded and verified
    Pending   nothing staged yet, or no Ready pod in the namespace matches the selector and serves
              the base model
    Degraded  a transient error persisted past the retry bound (staging or some pod); retries go on
    Loading   staged; some targeted pods do not report it yet
    Ready     every targeted pod reports the staged revision
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lora_operator.model import AdapterInfo, PodInfo, StagedRef

Phase = Literal["Pending", "Staging", "Loading", "Ready", "Degraded", "Failed"]
PodState = Literal["Pending", "Loading", "Loaded", "Failed"]
WARNING_PHASES = ("Degraded", "Failed")


@dataclass
class StagingState:
    """The controller's record of staging one adapter (mutable, owned by its handler)."""

    in_progress: bool = False
    bytes_so_far: int = 0
    attempts: int = 0  # consecutive transient failures
    degraded: bool = False  # transient failures past the bound
    error_reason: str | None = None
    error_message: str | None = None
    permanent: bool = False
    staged: StagedRef | None = None
    path: str | None = None  # the revision directory on the operator's volume
    staged_at: str | None = None
    observed_generation: int | None = None


@dataclass
class PodEntry:
    """One adapter on one pod."""

    state: PodState = "Pending"
    revision: str | None = None
    last_error: str | None = None
    loaded_at: str | None = None
    load_seconds: float | None = None
    attempts: int = 0  # consecutive transient failures
    permanent: bool = False  # the last failure is permanent for `failed_for`
    failed_for: Any = None  # the Want that failed: retried only when the want changes


@dataclass(frozen=True)
class Condition:
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str


@dataclass(frozen=True)
class Summary:
    phase: Phase
    desired: int
    ready: int
    conditions: tuple[Condition, ...] = field(default=())
    message: str = ""  # why the phase is what it is, for the phase's Event


def summarise(
    info: AdapterInfo,
    staging: StagingState,
    targeted: Sequence[tuple[PodInfo, PodEntry]],
) -> Summary:
    staged = staging.staged
    ready_pods = [p for p, e in targeted if _serves(e, staged)]
    permanent = [(p, e) for p, e in targeted if e.state == "Failed" and e.permanent]
    degraded_pods = [(p, e) for p, e in targeted if e.state == "Failed" and not e.permanent]
    n, r = len(targeted), len(ready_pods)

    staged_c = _staged_condition(staging)
    if staged is None:
        ready_c = Condition("Ready", "False", "NotStaged", "waiting for the weights to be staged")
    elif permanent:
        pod, entry = permanent[0]
        ready_c = Condition(
            "Ready",
            "False",
            "LoadFailed",
            f"{len(permanent)} pod(s) refused the adapter; {pod.name}: {entry.last_error}",
        )
    elif n == 0:
        ready_c = Condition(
            "Ready",
            "False",
            "NoPods",
            f"no Ready inference pod in namespace {info.namespace} matches the selector and "
            f"serves base model {info.base_model!r}",
        )
    elif r == n:
        ready_c = Condition(
            "Ready", "True", "Loaded", f"{r}/{n} pods serve revision {staged.sha256[:12]}"
        )
    else:
        waiting = sorted(p.name for p, e in targeted if not _serves(e, staged))
        ready_c = Condition(
            "Ready",
            "False",
            "Loading",
            f"{r}/{n} pods serve revision {staged.sha256[:12]}; waiting for {', '.join(waiting)}",
        )

    if staging.degraded:
        degraded_c = Condition(
            "Degraded",
            "True",
            staging.error_reason or "StagingRetrying",
            staging.error_message or "",
        )
    elif degraded_pods:
        pod, entry = degraded_pods[0]
        degraded_c = Condition(
            "Degraded",
            "True",
            "LoadRetrying",
            f"{len(degraded_pods)} pod(s) keep failing to load (retrying); "
            f"{pod.name}: {entry.last_error}",
        )
    else:
        degraded_c = Condition("Degraded", "False", "AsExpected", "")

    phase: Phase
    if staging.permanent:
        phase, why = "Failed", staged_c
    elif permanent:
        phase, why = "Failed", ready_c
    elif staging.in_progress:
        phase, why = "Staging", staged_c
    elif staging.degraded or degraded_pods:
        phase, why = "Degraded", degraded_c
    elif staged is None:
        phase, why = "Pending", staged_c
    elif n == 0:
        phase, why = "Pending", ready_c
    else:
        phase, why = ("Ready" if r == n else "Loading"), ready_c
    return Summary(
        phase=phase,
        desired=n,
        ready=r,
        conditions=(staged_c, ready_c, degraded_c),
        message=why.message,
    )


def _serves(entry: PodEntry, staged: StagedRef | None) -> bool:
    return staged is not None and entry.state == "Loaded" and entry.revision == staged.sha256


def _staged_condition(staging: StagingState) -> Condition:
    if staging.permanent or (staging.error_reason and staging.staged is None):
        return Condition(
            "Staged", "False", staging.error_reason or "StagingFailed", staging.error_message or ""
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
    return Condition("Staged", "False", "Pending", "staging has not started")


def render(
    info: AdapterInfo,
    staging: StagingState,
    targeted: Sequence[tuple[PodInfo, PodEntry]],
    summary: Summary,
    previous_conditions: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The whole `.status` object; a condition keeps its lastTransitionTime while unchanged."""
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
    status: dict[str, Any] = {
        "phase": summary.phase,
        "ready": f"{summary.ready}/{summary.desired}",
        "desiredPods": summary.desired,
        "readyPods": summary.ready,
        "conditions": conditions,
        "pods": [
            _pod_status(pod, entry) for pod, entry in sorted(targeted, key=lambda t: t[0].name)
        ],
        "stagingBytes": staging.bytes_so_far if staging.in_progress else None,
        "staged": None,
    }
    if staging.observed_generation is not None:
        status["observedGeneration"] = staging.observed_generation
    if staging.staged is not None:
        status["staged"] = {
            "sha256": staging.staged.sha256,
            "sizeBytes": staging.staged.size,
            "path": staging.path,
            "stagedAt": staging.staged_at,
        }
    return status


def _pod_status(pod: PodInfo, entry: PodEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"name": pod.name, "state": entry.state}
    for key, value in (
        ("ip", pod.ip),
        ("revision", entry.revision),
        ("lastError", entry.last_error),
        ("loadedAt", entry.loaded_at),
        ("loadSeconds", entry.load_seconds),
    ):
        if value is not None:
            out[key] = value
    return out
