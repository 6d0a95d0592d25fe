"""What a rollout's revisions serve across the adapter's targeted pods (pure).

`rollout` decides the rollout's states and weights from two facts, whether the canary is ready
everywhere and whether the name serves it everywhere; `rollout.render` writes `status.rollout`
from counts. This module works both out from the adapter's entries on its targeted pods: its own
name's entries and the canary alias's (`canary_pods`). No I/O, no clock; the controller's
rollout actor feeds it and acts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lora_operator.rules import rollout
from lora_operator.rules.model import AdapterInfo, PodInfo
from lora_operator.rules.podstate import PodEntry
from lora_operator.rules.status import cut_error

Targeted = Sequence[tuple[PodInfo, PodEntry]]
_NONE = PodEntry()


def readiness(
    r: rollout.Rollout, targeted: Targeted, canary_pods: Mapping[str, PodEntry]
) -> tuple[bool, bool]:
    """(the canary alias is served on every targeted pod, the name serves the canary on every
    targeted pod): what `rollout.advance` moves on; both False without a targeted pod."""
    pods = [p.name for p, _ in targeted]
    canary_ready = bool(pods) and all(canary_pods.get(p, _NONE).serves(r.canary) for p in pods)
    promoted = bool(pods) and all(e.serves(r.canary) for _, e in targeted)
    return canary_ready, promoted


def render_status(
    r: rollout.Rollout | None,
    info: AdapterInfo,
    targeted: Targeted,
    canary_pods: Mapping[str, PodEntry],
) -> dict[str, Any] | None:
    """`status.rollout` (None: no rollout under way): how many pods serve each revision, and
    the first pod that refused the canary for good, with why."""
    if r is None:
        return None
    refused = sorted(
        (p.name, e.last_error or "")
        for p, _ in targeted
        if (e := canary_pods.get(p.name)) is not None and e.permanent
    )
    return rollout.render(
        r,
        info.rollout,
        info.name,
        refused=f"{refused[0][0]}: {cut_error(refused[0][1])}" if refused else None,
        stable_ready=sum(1 for _, e in targeted if e.serves(r.stable)),
        canary_ready=sum(
            1
            for p, e in targeted
            if canary_pods.get(p.name, _NONE).serves(r.canary) or e.serves(r.canary)
        ),
        pods=len(targeted),
    )
