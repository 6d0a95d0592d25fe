"""Rollouts (spec.rollout): a newly staged revision rolled out in weighted steps. It owns the
record's `rolling` sub-record (the rollout under way, the timer for the end of a step's pause,
the command taken last) and says `canary_changed` when the canary changes (the pod workers
start its entries afresh);
`rollout` decides every step and `canary` what the pods' entries say of it.

A command (the rollout annotation: promote, abort) is removed from the version it was read on
before it is acted on, so it acts once; one lost to a crash in between is given again by the user.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from lora_operator import canary, events, kube, rollout, status
from lora_operator.controller.placer import Placer
from lora_operator.controller.records import AdapterRecord
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.model import Command

log = logging.getLogger("lora_operator")


class Rollouts(Actor):
    def __init__(self, shared: Shared, placer: Placer) -> None:
        super().__init__(shared)
        self.placer = placer

    def forget(self, key: Key) -> None:
        rec = self.cache.adapters.get(key)
        if rec is not None and rec.rolling.wake is not None:
            rec.rolling.wake.cancel()

    def begin(self, key: Key, serving: str | None, staged: str) -> None:
        """`staged` became the adapter's newest revision: roll it out, or not (rollout.begin)."""
        rec = self.cache.adapters.get(key)
        if rec is None:
            return
        before = rec.rollout
        after = rollout.begin(before, serving, staged, rec.info.rollout)
        rec.rolling.rollout = after
        if after is None or before is None or before.canary != after.canary:
            self.signals.canary_changed(key)
        if after != before:
            self._changed(rec, before)

    def advance(self, rec: AdapterRecord, targeted: status.Targeted) -> None:
        """Take a command from the annotation, and move the rollout on (rollout.advance)."""
        command, rolling = rec.info.command, rec.rolling
        if command is not None and command != rolling.taken and not rolling.taking:
            rolling.taking = True
            self.signals.spawn(self._take(rec, command), f"rollout {rec.info.name}")
        self._step(rec, targeted, None)

    def render(self, rec: AdapterRecord, targeted: status.Targeted) -> dict[str, Any] | None:
        """`status.rollout` (canary.render_status decides)."""
        return canary.render_status(rec.rollout, rec.info, targeted, rec.entries.canary)

    def _step(
        self, rec: AdapterRecord, targeted: status.Targeted, command: str | None
    ) -> str | None:
        """Move the rollout on (rollout.advance decides), and set a timer for the end of the
        step's pause; the command it acted on, if any."""
        r, rolling = rec.rollout, rec.rolling
        if r is None:
            return None
        canary_ready, promoted = canary.readiness(r, targeted, rec.entries.canary)
        progress = rollout.advance(
            r,
            rec.info.rollout,
            time.time(),
            canary_ready=canary_ready,
            promoted_everywhere=promoted,
            command=command,
        )
        if rolling.wake is not None:
            rolling.wake.cancel()
            rolling.wake = None
        if progress.wake_at is not None:
            rolling.wake = asyncio.get_running_loop().call_later(
                max(0.0, progress.wake_at - time.time()) + 0.05, self.signals.mark, rec.key
            )
        if progress.rollout != r:
            rolling.rollout = progress.rollout
            if progress.rollout is None:
                self.signals.canary_changed(rec.key)
            self._changed(rec, r)
        return progress.acted

    def _changed(self, rec: AdapterRecord, before: rollout.Rollout | None) -> None:
        r = rec.rollout
        either = r or before
        log.info(
            "action=rollout adapter=%s/%s state=%s step=%s stable=%s canary=%s",
            *rec.key,
            r.state.value if r is not None else "Done",
            r.step + 1 if r is not None else "-",
            either.stable[:12] if either is not None else "-",
            either.canary[:12] if either is not None else "-",
        )
        if r is None or before is None or r.state != before.state:
            # What the pods should hold changed (the alias, the name's revision).
            self.signals.wake_namespace(rec.info.namespace)
            self.signals.collect()
            self.signals.member_changed(rec.info)  # compositions follow what the name serves
        self.signals.mark(rec.key)

    async def _take(self, rec: AdapterRecord, command: Command) -> None:
        """Remove the annotation from the version it was read on, then act on it."""
        info, rolling = rec.info, rec.rolling
        try:
            api = await self.seams.api_after_login()
            await api.remove_annotation(
                info.namespace, info.name, rollout.COMMAND_ANNOTATION, command.resource_version
            )
        except Exception as e:
            rolling.taking = False
            if isinstance(e, kube.ApiError) and e.status in (404, 409):
                # Deleted, or a newer version of the object is on its way here: that one
                # says whether there is a command.
                rolling.taken = command
                return
            log.warning("action=rollout-command adapter=%s/%s error=%r", *info.key, e)
            # The status pass then tries again.
            asyncio.get_running_loop().call_later(1.0, self.signals.mark, rec.key)
            return
        rolling.taking, rolling.taken = False, command
        action = command.action
        r = rec.rollout
        acted = self._step(rec, self.placer.targeted(rec), action)
        log.info(
            "action=rollout-command adapter=%s/%s command=%s result=%s",
            *info.key,
            action,
            "ok" if acted else "ignored",
        )
        if acted is None:
            message = rollout.ignored(action, r)
            self.signals.post(info, events.Note("Warning", "RolloutCommandIgnored", message))
            return
        reason, message = rollout.acted(action, r, rec.rollout)
        self.signals.post(info, events.Note("Normal", reason, message))
