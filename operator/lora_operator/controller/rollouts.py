"""Rollouts (spec.rollout): a newly staged revision rolled out in weighted steps. It owns the
record's `rolling` sub-record (the rollout under way, the command taken last), which adapters
are due to be looked at (marked, or a step's pause ending) and the loop that looks at them; it
says `canary_changed` when the canary changes (the pod workers start its entries afresh);
`rollout` decides every step and `canary` what the pods' entries say of it. The status writer
renders what it decided.

A command (the rollout annotation: promote, abort) is removed from the version it was read on
before it is acted on, so it acts once; one lost to a crash in between is given again by the user.
"""

from __future__ import annotations

import logging
import time

from lora_operator.controller.dueset import DueSet
from lora_operator.controller.placer import Placer
from lora_operator.controller.records import AdapterRecord
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.edges import kube
from lora_operator.rules import canary, events, rollout, status
from lora_operator.rules.model import Command

log = logging.getLogger("lora_operator")

UNHEARD_RETRY_S = 0.5  # while a namespace's Ready pods have not all reported (as the writer)
COMMAND_RETRY_S = 1.0  # after the annotation's removal failed
PAUSE_SLACK_S = 0.05  # a pause's end is looked at this much after it, not a hair before


class Rollouts(Actor):
    def __init__(self, shared: Shared, placer: Placer) -> None:
        super().__init__(shared)
        self.placer = placer
        self._due = DueSet()  # marked, or when to look again (a pause's end, a retry)

    def mark(self, key: Key) -> None:
        """The adapter may have changed: look at it, if it has a rollout or a command."""
        rec = self.cache.adapters.get(key)
        if rec is None:
            return
        rolling, command = rec.rolling, rec.info.command
        if rolling.rollout is not None or (command is not None and command != rolling.taken):
            self._due.mark(key)

    def mark_namespace(self, namespace: str) -> None:
        for rec in self.cache.adapters_in(namespace):
            self.mark(rec.key)

    def forget(self, key: Key) -> None:
        self._due.forget(key)

    def _retry(self, key: Key, delay: float) -> None:
        self._due.after(key, delay)

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

    async def run(self) -> None:
        while True:
            await self._due.wait()
            if not self.seams.active.is_set():
                continue
            self._pass()

    def _pass(self) -> None:
        """Take each due adapter's command from its annotation, and move its rollout on."""
        now = time.monotonic()
        keys = self._due.take(now)
        heard: dict[str, bool] = {}
        for key in keys:
            self._due.unschedule(key)
            rec = self.cache.adapters.get(key)
            if rec is None or rec.info.deleting:
                continue
            ns = key[0]
            if not heard.setdefault(ns, self.cache.heard(ns)):
                # Until every Ready pod has reported, a canary's readiness says too little.
                self._due.at(key, now + UNHEARD_RETRY_S)
                continue
            command, rolling = rec.info.command, rec.rolling
            if command is not None and command != rolling.taken and not rolling.taking:
                rolling.taking = True
                self.signals.spawn(self._take(rec, command), f"rollout {rec.info.name}")
            self._step(rec, self.placer.targeted(rec), None)

    def _step(
        self, rec: AdapterRecord, targeted: status.Targeted, command: str | None
    ) -> str | None:
        """Move the rollout on (rollout.advance decides), and look again at the end of the
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
        self._due.unschedule(rec.key)
        if progress.wake_at is not None:
            self._retry(rec.key, max(0.0, progress.wake_at - time.time()) + PAUSE_SLACK_S)
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
            self._retry(rec.key, COMMAND_RETRY_S)
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
