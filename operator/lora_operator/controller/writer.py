"""The status writer: writes each changed adapter's status, coalesced and paced
(statuswrite.write_delay), each change of headline announced by at most one Event
(events.plan_event). It owns which adapters are due (`mark`), the record's `status` sub-record
(what the object has, what summarise says now) and the phase gauge. It renders what the
others decided (the placer's placement, the rollout rollouts keep, the pods' entries), as they
are when it passes, and changes nothing else: each of them marks an adapter when what it decided
changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from lora_operator.controller.dueset import DueSet
from lora_operator.controller.placer import Placer
from lora_operator.controller.records import AdapterRecord
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.edges import kube
from lora_operator.rules import canary, events, rollout, statuswrite
from lora_operator.rules import status as status_mod

log = logging.getLogger("lora_operator")

# A burst of changes (`kubectl apply` of many adapters, each changed again when it is staged)
# becomes one status computation per adapter.
COALESCE_S = 0.1


class StatusWriter(Actor):
    def __init__(self, shared: Shared, placer: Placer) -> None:
        super().__init__(shared)
        self.placer = placer
        self.policy = statuswrite.WritePolicy(
            self.config.status_settle_s,
            self.config.status_progress_s,
            self.config.status_loss_grace_s,
        )
        self._due = DueSet()
        self._phases: Counter[str] = Counter()
        # API writes in flight at once (the API server's client-side budget is small: a burst of
        # hundreds must queue here, not time out).
        self._slots = asyncio.Semaphore(8)

    def mark(self, key: Key) -> None:
        self._due.mark(key)

    def mark_namespace(self, namespace: str) -> None:
        for rec in self.cache.adapters_in(namespace):
            self.mark(rec.key)

    def retry(self, key: Key, delay: float = 1.0) -> None:
        """Pass over the adapter again after `delay` even if nothing changes."""
        self._due.after(key, delay)

    def forget(self, key: Key) -> None:
        rec = self.cache.adapters.get(key)
        if rec is not None:
            self._set_phase(rec, None)
        self._due.forget(key)

    async def run(self) -> None:
        while True:
            await self._due.wait()
            await asyncio.sleep(COALESCE_S)
            if not self.seams.active.is_set():
                continue
            await self._pass()

    async def _pass(self) -> None:
        now = time.monotonic()
        keys = self._due.take(now)
        heard: dict[str, bool] = {}
        writes = []
        # Round-robin over namespaces: the writes are queued on the slots in this order, so
        # every namespace gets an equal share of them (statuswrite.fair_order).
        for key in statuswrite.fair_order(keys):
            due = self._due.unschedule(key)
            rec = self.cache.adapters.get(key)
            if rec is None or rec.info.deleting:
                continue  # a deleted adapter's status is no news to anyone
            ns = key[0]
            if not heard.setdefault(ns, self.cache.heard(ns)) or self.placer.awaits(rec):
                # Until every Ready pod has reported, and the adapter is placed (a new one in a
                # burst, or any after a restart), a status would say fewer pods than there are.
                self._due.at(key, now + 0.5)
                continue
            targeted = self.placer.targeted(rec)
            placed = self.placer.placed(rec)
            r = rec.rollout
            summary = status_mod.summarise(
                rec.info,
                rec.staging.state,
                targeted,
                retry_bound=self.config.retry_bound,
                placed=placed,
                serving=r.name_revision if r is not None else None,
            )
            self._set_phase(rec, summary.phase)
            written = rec.status
            rollout_body = canary.render_status(r, rec.info, targeted, rec.entries.canary)
            # The routers read the weights from the status: a change there is written at once.
            reroutes = rollout.routing_changed((written.body or {}).get("rollout"), rollout_body)
            if written.now != summary.headline:
                written.now, written.now_since = summary.headline, now
            elif due is not None and due > now and not reroutes:
                # A write is planned for this phase and reason already: it will take what is
                # new then (rendering every change of a Loading adapter costs CPU).
                self._due.at(key, due)
                continue
            body = statuswrite.render(
                rec.info,
                rec.staging.state,
                targeted,
                summary,
                (written.body or {}).get("conditions") or [],
                kube.now_iso(),
                placed,
            )
            body["rollout"] = rollout_body
            delay = statuswrite.write_delay(
                written.body,
                written.headline,
                body,
                summary,
                since_headline=now - written.now_since,
                since_write=now - written.at,
                since_differs=0.0 if written.differs_since is None else now - written.differs_since,
                policy=self.policy,
            )
            if reroutes:
                delay = 0.0
            if delay is None:
                written.differs_since = None
                continue
            if written.differs_since is None:
                written.differs_since = now
            if delay > 0:
                self._due.at(key, now + delay)
                continue
            writes.append(self._write(rec, body, summary))
        await asyncio.gather(*writes)

    async def _write(
        self, rec: AdapterRecord, body: dict[str, Any], summary: status_mod.Summary
    ) -> None:
        async with self._slots:
            api = await self.seams.api_after_login()
            try:
                await api.patch_adapter_status(rec.info.namespace, rec.info.name, body)
            except kube.ApiError as e:
                if e.status == 404:
                    return  # deleted meanwhile
                self._failed(rec.key, e)
                return
            except Exception as e:  # the next change or the retry writes it; never stop
                self._failed(rec.key, e)
                return
        written = rec.status
        note = events.plan_event(written.headline, summary)
        written.body, written.headline = body, summary.headline
        written.at = time.monotonic()
        written.differs_since = None
        if note is not None:
            log.info(
                "action=phase adapter=%s/%s phase=%s reason=%s ready=%s message=%r",
                *rec.key,
                summary.phase,
                summary.reason,
                body["ready"],
                summary.message,
            )
            self.signals.post(rec.info, note)

    def _failed(self, key: Key, e: Exception) -> None:
        log.warning("writing the status of %s/%s failed: %s", *key, e)
        self.retry(key)

    def _set_phase(self, rec: AdapterRecord, phase: str | None) -> None:
        written = rec.status
        if written.phase == phase:
            return
        if written.phase is not None:
            self._phases[written.phase] -= 1
        if phase is not None:
            self._phases[phase] += 1
        written.phase = phase
        self.metrics.set_phases(dict(self._phases))
