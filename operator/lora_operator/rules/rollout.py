"""A weighted rollout of a new revision next to the one that serves (pure).

Without `spec.rollout`, a newly staged revision replaces the old one on every pod at once. With
it, the pods hold both: the revision that served before (**stable**) under the adapter's own name,
and the new one (**canary**) under an alias, `<name>_<first 12 hex of its sha256>`. `_` is not
allowed in Kubernetes object names, so an alias never collides with another LoRAAdapter. The
router sends each step's share of the adapter's requests to the alias and the rest to the name;
clients change nothing, and a client that calls a pod directly gets the stable revision.

    Starting    the canary is loading; no traffic yet (weight 0)
      | the canary is loaded on every pod the adapter targets
    Progressing step i: steps[i].weight percent to the canary; the next step after the step's
      |         pauseSeconds, or on a promote when the step has none
      | past the last step (or a promote of the last, or spec.rollout removed)
    Promoting   all traffic to the canary's alias while the pods swap the name to it in place
      | every targeted pod reports the canary under the name
    (done)      the canary is the adapter; the alias is unloaded, the old revision collected

    Starting / Progressing --abort--> Aborted: no traffic to the canary, its alias unloaded, the
    stable revision kept (and never collected) until a new revision is staged.

A new revision staged during a rollout starts another from the same stable revision (from the
canary, once promoting began); staging the stable revision again ends the rollout. The state is
small and lives in `status.rollout`, so an operator restart continues where it was, pause clocks
included (they count wall-clock time).

Purely computational: no clock (callers pass `now`, seconds since the epoch), no I/O.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

ALIAS_SEPARATOR = "_"
ALIAS_HEX = 12
# The annotation a user sets to act on a rollout; the operator removes it when it has acted.
COMMAND_ANNOTATION = "lora.dev/rollout"
PROMOTE, ABORT = "promote", "abort"


def alias(name: str, sha256: str) -> str:
    """The name a canary revision is served under on the pods, next to `name`."""
    return f"{name}{ALIAS_SEPARATOR}{sha256[:ALIAS_HEX]}"


def adapter_of_alias(served: str, sha256: str) -> str | None:
    """The adapter `served` is the canary alias of, for a card at revision `sha256`; None when
    it is no alias of that revision."""
    suffix = ALIAS_SEPARATOR + sha256[:ALIAS_HEX]
    return served[: -len(suffix)] if served.endswith(suffix) and len(served) > len(suffix) else None


@dataclass(frozen=True)
class Step:
    weight: int  # percent of the adapter's requests sent to the canary, 1..100
    pause_s: float | None = None  # how long the step lasts; None: until a promote


@dataclass(frozen=True)
class Plan:
    """`spec.rollout`."""

    steps: tuple[Step, ...]


class State(StrEnum):
    STARTING = "Starting"
    PROGRESSING = "Progressing"
    PROMOTING = "Promoting"
    ABORTED = "Aborted"


# Once promoting has begun the pods swap the name to the canary: there is nothing to abort to.
ABORTABLE = (State.STARTING, State.PROGRESSING)


@dataclass(frozen=True)
class Rollout:
    stable: str  # sha256 of the revision that served before
    canary: str  # sha256 of the new revision
    state: State = State.STARTING
    step: int = 0  # index into the plan's steps (Progressing)
    step_started: float | None = None  # when the current step began (epoch seconds)

    @property
    def serves_canary_alias(self) -> bool:
        """Whether the pods should hold the canary under its alias."""
        return self.state is not State.ABORTED

    @property
    def name_revision(self) -> str:
        """The revision the pods should hold under the adapter's own name."""
        return self.canary if self.state is State.PROMOTING else self.stable


def begin(
    current: Rollout | None, serving: str | None, staged: str, plan: Plan | None
) -> Rollout | None:
    """The rollout after `staged` became the adapter's newest revision.

    `serving`: the revision staged before it (what the pods serve under the name when no rollout
    is under way). No plan, nothing served before, or the stable revision staged again: no
    rollout, the pods take `staged` at once.
    """
    if plan is None or not plan.steps:
        return None
    if current is not None:
        stable: str | None = current.name_revision
    else:
        stable = serving
    if stable is None or stable == staged:
        return None
    if current is not None and current.canary == staged:
        return current
    return Rollout(stable=stable, canary=staged)


@dataclass(frozen=True)
class Progress:
    rollout: Rollout | None  # None: the rollout is over
    wake_at: float | None = None  # when to look again (a step's pause ends)
    acted: str | None = None  # the command it acted on, for the log and the Event


def advance(
    r: Rollout,
    plan: Plan | None,
    now: float,
    *,
    canary_ready: bool,
    promoted_everywhere: bool,
    command: str | None = None,
) -> Progress:
    """The next state: after a command, the canary's readiness, a pause's end.

    `canary_ready`: every targeted pod reports the canary under its alias (and at least one
    pod is targeted). `promoted_everywhere`: every targeted pod reports the canary under the
    adapter's name. `command`: `promote` or `abort` from the annotation, or None.
    """
    steps = plan.steps if plan is not None else ()
    acted = None
    if command == ABORT and r.state in ABORTABLE:
        return Progress(replace(r, state=State.ABORTED, step_started=None), acted=ABORT)
    if not steps and r.state in ABORTABLE:
        r = replace(r, state=State.PROMOTING, step_started=None)  # spec.rollout removed
    if r.state is State.STARTING and canary_ready:
        r = replace(r, state=State.PROGRESSING, step=0, step_started=now)
    if r.state is State.PROGRESSING:
        step = steps[min(r.step, len(steps) - 1)]
        started = r.step_started if r.step_started is not None else now
        if command == PROMOTE:
            r, acted = _next_step(r, steps, now), PROMOTE
        elif step.pause_s is not None and now >= started + step.pause_s:
            r = _next_step(r, steps, now)
    if r.state is State.PROMOTING and promoted_everywhere:
        return Progress(None, acted=acted)
    wake_at = None
    if r.state is State.PROGRESSING:
        pause = steps[min(r.step, len(steps) - 1)].pause_s
        if pause is not None and r.step_started is not None:
            wake_at = r.step_started + pause
    return Progress(r, wake_at=wake_at, acted=acted)


def _next_step(r: Rollout, steps: tuple[Step, ...], now: float) -> Rollout:
    if r.step + 1 >= len(steps):
        return replace(r, state=State.PROMOTING, step_started=None)
    return replace(r, step=r.step + 1, step_started=now)


def weight(r: Rollout, plan: Plan | None) -> int:
    """Percent of the adapter's requests the router sends to the canary now."""
    if r.state is State.PROMOTING:
        return 100
    if r.state is State.PROGRESSING and plan is not None and plan.steps:
        return plan.steps[min(r.step, len(plan.steps) - 1)].weight
    return 0


def render(
    r: Rollout,
    plan: Plan | None,
    name: str,
    *,
    stable_ready: int,
    canary_ready: int,
    pods: int,
    refused: str | None = None,
) -> dict[str, Any]:
    """`status.rollout`: both revisions with their weights and how many pods serve each.
    `refused`: a pod that refused the canary for good, and why (it then never serves)."""
    w = weight(r, plan)
    steps = len(plan.steps) if plan is not None else 0
    out: dict[str, Any] = {
        "state": r.state.value,
        "step": r.step + 1 if r.state is State.PROGRESSING else None,
        "steps": steps,
        "stepStartedAt": _iso(r.step_started) if r.step_started is not None else None,
        "stable": {"revision": r.stable, "weight": 100 - w, "readyPods": stable_ready},
        "canary": {
            "revision": r.canary,
            "weight": w,
            "readyPods": canary_ready,
            "servedAs": alias(name, r.canary),
        },
        "message": _message(r, plan, pods, refused),
    }
    return {k: v for k, v in out.items() if v is not None}


def _message(r: Rollout, plan: Plan | None, pods: int, refused: str | None) -> str:
    if refused is not None and r.state in ABORTABLE:
        return (
            f"a pod refused the canary {r.canary[:12]} ({refused}); abort, or stage another "
            "revision"
        )
    if r.state is State.STARTING:
        return f"loading the canary {r.canary[:12]} on {pods} pods; no traffic until all hold it"
    if r.state is State.ABORTED:
        return (
            f"aborted: all traffic to {r.stable[:12]}; stage a new revision (or the stable one "
            "again) to go on"
        )
    if r.state is State.PROMOTING:
        return f"promoting {r.canary[:12]}: the pods swap the adapter to it"
    steps = plan.steps if plan is not None else ()
    step = steps[min(r.step, len(steps) - 1)] if steps else Step(0)
    then = (
        f"the next step in {step.pause_s:g} s of pause"
        if step.pause_s is not None
        else f"waiting for `kubectl annotate lora <name> {COMMAND_ANNOTATION}=promote`"
    )
    return f"step {r.step + 1}/{len(steps)}: {step.weight}% to {r.canary[:12]}; {then}"


def routing_changed(before: Any, after: Any) -> bool:
    """Whether a new `status.rollout` changes what the routers do (its state, weights or
    revisions), rather than only counting pods: such a write must not wait."""

    def routing(raw: Any) -> Any:
        if not isinstance(raw, Mapping):
            return None
        return (
            raw.get("state"),
            (raw.get("canary") or {}).get("weight"),
            (raw.get("canary") or {}).get("revision"),
            (raw.get("stable") or {}).get("revision"),
        )

    return bool(routing(before) != routing(after))


def ignored(action: str, r: Rollout | None) -> str:
    """Why a command was not acted on, for the Warning Event."""
    if action not in (PROMOTE, ABORT):
        return (
            f"annotation {COMMAND_ANNOTATION}={action!r} is not a command: use {PROMOTE} or {ABORT}"
        )
    if r is None:
        return f"{action}: no rollout is under way"
    if r.state is State.ABORTED:
        return f"{action}: the rollout of {r.canary[:12]} was aborted; stage a new revision"
    if r.state is State.PROMOTING:
        return f"{action}: {r.canary[:12]} is being promoted already"
    return f"{action}: the canary {r.canary[:12]} is still loading; promote once it serves"


def acted(action: str, before: Rollout | None, after: Rollout | None) -> tuple[str, str]:
    """The (reason, message) of the Event for a command acted on."""
    either = before or after
    canary = either.canary[:12] if either is not None else "?"
    if action == ABORT:
        return "RolloutAborted", f"aborted the rollout of {canary}: all traffic to the stable one"
    if after is None or after.state is State.PROMOTING:
        return "RolloutPromoted", f"promoted {canary}: the pods swap the adapter to it"
    return "RolloutPromoted", f"{canary}: on to step {after.step + 1}"


def restore(raw: Any) -> Rollout | None:
    """The rollout an earlier process wrote in `status.rollout` (None: none, or unreadable)."""
    if not isinstance(raw, Mapping):
        return None
    stable, canary = raw.get("stable") or {}, raw.get("canary") or {}
    try:
        state = State(str(raw.get("state")))
        step = int(raw.get("step") or 1) - 1
        started = raw.get("stepStartedAt")
        return Rollout(
            stable=str(stable["revision"]),
            canary=str(canary["revision"]),
            state=state,
            step=max(0, step),
            step_started=_epoch(started) if isinstance(started, str) else None,
        )
    except (KeyError, TypeError, ValueError):
        return None


def parse_plan(raw: Any) -> Plan | None:
    """`spec.rollout` (validated by the API server; None when absent)."""
    if not isinstance(raw, Mapping):
        return None
    steps = tuple(
        Step(
            weight=int(s.get("weight", 0)),
            pause_s=float(s["pauseSeconds"]) if s.get("pauseSeconds") is not None else None,
        )
        for s in raw.get("steps") or ()
        if isinstance(s, Mapping)
    )
    return Plan(steps=steps)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(s: str) -> float:
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
