"""What an adapter first seen resumes from: what its status says an earlier process (or another
replica) staged, wrote, loaded and chose (pure).

A restarted operator keeps nothing of its own; the LoRAAdapter's status is its memory. From it
`plan_resume` restores the staging state (so nothing is staged twice, a permanent failure of
this generation is not retried, and what the staged file declares and what its source resolved
to are known without reading or fetching anything),
the rollout under way, the replicas spec.autoscale chose, the status last written (so no status
goes backwards) and the load times recorded per pod. No I/O; the controller's record cache builds
its record from the result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lora_volume import description

from lora_operator.rules import autoscale, rollout
from lora_operator.rules.model import AdapterInfo
from lora_operator.rules.status import Headline, StagingState

# Per pod: (revision, loadedAt, loadSeconds) as status.pods recorded them.
RecordedLoad = tuple[str | None, str | None, float | None]


@dataclass(frozen=True)
class Resumed:
    staging: StagingState
    rollout: rollout.Rollout | None
    scale: autoscale.Scale | None
    written: dict[str, Any] | None
    written_headline: Headline | None
    recorded_loads: dict[str, RecordedLoad]


def plan_resume(info: AdapterInfo, status: Mapping[str, Any] | None) -> Resumed:
    """What the adapter's `status` says, for the record of an adapter first seen."""
    st = dict(status or {})
    staged = st.get("staged") or {}
    state = StagingState(
        staged=info.staged,
        path=staged.get("path"),
        staged_at=staged.get("stagedAt"),
        observed_generation=st.get("observedGeneration"),
        adapter=restore_adapter(st.get("adapter")) if info.staged is not None else None,
        # Kept as recorded: only a staging that fetches the source again can resolve it anew.
        resolved=_text(staged.get("resolvedSource")) if info.staged is not None else None,
    )
    # observedGeneration moves only on success or a permanent failure: a Staged=False
    # condition of this generation is a permanent failure, not to be retried on resume.
    conditions = list(st.get("conditions") or [])
    failed = next((c for c in conditions if c.get("type") == "Staged"), None)
    if (
        failed is not None
        and failed.get("status") == "False"
        and state.observed_generation == info.generation
    ):
        state.permanent = True
        state.error_reason, state.error_message = failed.get("reason"), failed.get("message")
    phase = st.get("phase")
    return Resumed(
        staging=state,
        rollout=rollout.restore(st.get("rollout")),
        scale=autoscale.restore(info.autoscale, st.get("replicas")),
        written=st or None,
        written_headline=(str(phase), None) if phase else None,
        recorded_loads={
            str(p["name"]): (p.get("revision"), p.get("loadedAt"), p.get("loadSeconds"))
            for p in st.get("pods") or []
            if isinstance(p, dict) and "name" in p
        },
    )


def _text(raw: object) -> str | None:
    return raw if isinstance(raw, str) and raw else None


def restore_adapter(raw: object) -> description.Description | None:
    """`status.adapter` as `statuswrite.adapter_status` wrote it; None when it is not one (the
    stager then reads it from the volume again)."""
    if not isinstance(raw, Mapping):
        return None
    key, rank = raw.get("format"), raw.get("rank")
    targets, words = raw.get("targets") or [], raw.get("triggerWords") or []
    if (
        not isinstance(key, str)
        or isinstance(rank, bool)
        or not isinstance(rank, int)
        or not isinstance(targets, list)
        or not isinstance(words, list)
    ):
        return None
    return description.Description(
        format=description.format_by_key(key),
        rank=rank,
        targets=tuple(str(t) for t in targets),
        trigger_words=tuple(str(w) for w in words),
    )


def needs_staging(
    info: AdapterInfo,
    observed_generation: int | None,
    volume_current: str | None,
    composed: str | None = None,
) -> bool:
    """Whether the spec's source must be staged (again), or the volume already holds it.

    A composition (`spec.compose`) must be staged again whenever the revision its members make
    now (`composed`; None: they make none, and the attempt says why) is not the current one.
    """
    staged = (
        info.staged is not None
        and observed_generation == info.generation
        and volume_current == info.staged.sha256
    )
    return not staged or (bool(info.compose) and composed != volume_current)
