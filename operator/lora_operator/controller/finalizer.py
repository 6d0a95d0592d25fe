"""The finalizer: it holds every live adapter with the operator's finalizer, and on deletion
unpublishes first (no pod resolves the name from then on), waits until no pod holds the adapter
(the pod workers unload it: it is no longer wanted), at most `unload_grace_s`, removes the
finalizer and lets go (finalizing.next_step decides each step). It owns the record's `deletion`
sub-record and the adapters waiting to be unloaded; the stager stops the adapter's staging when
asked (`stop_staging`).

A deletion is a few fields of its record, not a task: ten thousand adapters deleted at once
wait as ten thousand records. One loop takes the adapters due (a new event, a pod's holdings
changed, a grace ran out, a write to retry) and carries out their steps, the API writes and
file operations a few at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from lora_runtime import backoff

from lora_operator.controller.dueset import DueSet
from lora_operator.controller.records import AdapterRecord
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.edges import kube
from lora_operator.rules import events, finalizing
from lora_operator.rules import status as status_mod
from lora_operator.rules.finalizing import Step

log = logging.getLogger("lora_operator")

# A burst of events (`kubectl delete --all`) becomes one pass.
COALESCE_S = 0.1
# API writes and unpublishes in flight at once.
WIDTH = 8
# After the API refused a write as made against an older version of the object (409, 422),
# the next try, with the newer version its event brings.
STALE_RETRY_S = 1.0


class Finalizer(Actor):
    def __init__(self, shared: Shared, forget: Callable[[Key], None]) -> None:
        super().__init__(shared)
        self._forget = forget  # the controller's: every actor lets go of the adapter
        self._due = DueSet()
        # Unpublished, waiting for no pod to hold them, by namespace; and the namespaces whose
        # pods' holdings changed since the last pass (one look at a namespace per pass, not
        # one per unload of a deletion burst).
        self._unloading: dict[str, set[Key]] = {}
        self._holdings_changed: set[str] = set()
        self._failures: dict[Key, int] = {}  # failed writes in a row, for the backoff

    # -- what the others say ------------------------------------------------------------------

    def seen(self, rec: AdapterRecord, meta: Mapping[str, Any]) -> None:
        """The adapter's object as its latest event has it (`meta`: its metadata)."""
        d = rec.deletion
        d.finalizers = tuple(meta.get("finalizers") or ())
        d.resource_version = str(meta.get("resourceVersion") or "")
        if self._step(rec, time.monotonic()) not in (Step.NONE, Step.WAIT):
            self._due.mark(rec.key)

    def activate(self) -> None:
        """This replica acts: every adapter with a step to take is due (the events that said
        so came while it did not act)."""
        now = time.monotonic()
        for rec in self.cache.adapters.values():
            if self._step(rec, now) is not Step.NONE:
                self._due.mark(rec.key)

    def check_unloaded(self, namespace: str) -> None:
        """The namespace's pods hold other adapters now: its deletions may go on."""
        if namespace in self._unloading:
            self._holdings_changed.add(namespace)
            self._due.poke()

    def forget(self, key: Key) -> None:
        waiting = self._unloading.get(key[0])
        if waiting is not None:
            waiting.discard(key)
            if not waiting:
                del self._unloading[key[0]]
        self._due.forget(key)
        self._failures.pop(key, None)

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self._due.wait()
            await asyncio.sleep(COALESCE_S)
            if self.seams.active.is_set():
                await self._pass()

    async def _pass(self) -> None:
        now = time.monotonic()
        keys = self._due.take(now)
        for namespace in self._holdings_changed:
            keys |= self._newly_unloaded(namespace)
        self._holdings_changed = set()
        by_step: dict[Step, list[AdapterRecord]] = {}
        for key in keys:
            self._due.unschedule(key)
            rec = self.cache.adapters.get(key)
            if rec is not None:
                by_step.setdefault(self._step(rec, now), []).append(rec)
        await _each(by_step.get(Step.HOLD, ()), self._hold)
        await _each(by_step.get(Step.UNPUBLISH, ()), self._unpublish)
        for rec in by_step.get(Step.WAIT, ()):
            if rec.deletion.give_up_at is not None:
                self._due.at(rec.key, rec.deletion.give_up_at)
        await _each(by_step.get(Step.RELEASE, ()), self._release)
        for rec in by_step.get(Step.FORGET, ()):
            self._done(rec)

    def _step(self, rec: AdapterRecord, now: float) -> Step:
        d = rec.deletion
        gave_up = d.give_up_at is not None and now >= d.give_up_at
        held = finalizing.FINALIZER in d.finalizers
        return finalizing.next_step(rec.info.deleting, held, d.unpublished, d.unloaded, gave_up)

    def _maybe_held(self, key: Key) -> bool:
        """Whether a pod of the adapter's namespace holds it, or may: a Ready pod not heard
        from yet may hold any adapter (`RecordCache.heard`)."""
        namespace, name = key
        return not self.cache.heard(namespace) or any(
            p.report is not None and p.report.holds(name) for p in self.cache.pods_in(namespace)
        )

    def _newly_unloaded(self, namespace: str) -> set[Key]:
        """The namespace's deletions that no pod holds any more."""
        waiting = self._unloading.get(namespace, set())
        if not self.cache.heard(namespace):
            return set()  # a pod not heard from yet may hold any of them
        held = self.cache.held(namespace)
        found = set()
        for key in waiting:
            rec = self.cache.adapters.get(key)
            if rec is not None and key[1] not in held:
                rec.deletion.unloaded = True
                found.add(key)
        waiting -= found
        if not waiting:
            self._unloading.pop(namespace, None)
        return found

    # -- the steps ----------------------------------------------------------------------------

    async def _hold(self, rec: AdapterRecord) -> None:
        await self._write(rec, hold=True)

    async def _unpublish(self, rec: AdapterRecord) -> None:
        key, d = rec.key, rec.deletion
        await self.signals.stop_staging(key)  # a publish in progress ends first
        await self.seams.volume.unpublish(*key)
        if self.cache.adapters.get(key) is not rec:
            return  # gone meanwhile (its DELETED event)
        d.unpublished = True
        d.give_up_at = time.monotonic() + self.config.unload_grace_s
        log.info("action=unpublish adapter=%s/%s", *key)
        self.signals.wake_adapter(key)
        if self._maybe_held(key):
            self._unloading.setdefault(key[0], set()).add(key)
            self._due.at(key, d.give_up_at)
        else:
            d.unloaded = True
            self._due.mark(key)

    async def _release(self, rec: AdapterRecord) -> None:
        if not rec.deletion.unloaded:
            holders = sorted(
                p.info.name
                for p in self.cache.pods_in(rec.key[0])
                if p.report is not None and p.report.holds(rec.key[1])
            )
            self.signals.post(
                rec.info,
                events.Note(
                    "Warning",
                    "UnloadIncomplete",
                    f"pods still report the adapter after {self.config.unload_grace_s:.0f}s: "
                    f"{status_mod.name_list(holders)}; releasing it anyway",
                ),
            )
            rec.deletion.unloaded = True  # said once; a write retried does not say it again
        if await self._write(rec, hold=False):
            self._done(rec)

    def _done(self, rec: AdapterRecord) -> None:
        log.info("action=delete adapter=%s/%s", *rec.key)
        # Its DELETED event may have come first; a record of that name made since is another
        # adapter's.
        if self.cache.adapters.get(rec.key) is rec:
            self._forget(rec.key)
        self.signals.collect()

    async def _write(self, rec: AdapterRecord, hold: bool) -> bool:
        """Add or remove the finalizer; True once the object is as wanted (or gone). A write
        that failed is tried again: at once with the object's next version when the API says
        it changed, else after a backoff."""
        key, d = rec.key, rec.deletion
        ops = finalizing.patch(d.finalizers, d.resource_version, hold)
        if not ops:
            return True
        try:
            api = await self.seams.api_after_login()
            body = await api.patch_adapter(*key, ops)
        except kube.ApiError as e:
            if e.status == 404:
                return True  # gone: its DELETED event lets go of it
            stale = e.status in (409, 422)
            self._retry(key, "stale" if stale else str(e), STALE_RETRY_S if stale else None)
            return False
        except Exception as e:  # the API away, a timeout: tried again; never stop the loop
            self._retry(key, str(e) or type(e).__name__, None)
            return False
        self._failures.pop(key, None)
        if self.cache.adapters.get(key) is rec:
            meta = body.get("metadata") or {}
            d.finalizers = tuple(meta.get("finalizers") or ())
            d.resource_version = str(meta.get("resourceVersion") or d.resource_version)
        return True

    def _retry(self, key: Key, why: str, delay: float | None) -> None:
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        if delay is None:
            delay = backoff.delay(failures, cap=self.config.max_backoff_s)
        log.info("action=finalizer adapter=%s/%s result=error message=%r", *key, why)
        self._due.after(key, delay)


async def _each(
    records: Iterable[AdapterRecord], step: Callable[[AdapterRecord], Awaitable[Any]]
) -> None:
    """Run `step` for every record, `WIDTH` at a time."""
    pending = list(records)
    pending.reverse()

    async def worker() -> None:
        while pending:
            await step(pending.pop())

    await asyncio.gather(*(worker() for _ in range(min(WIDTH, len(pending)))))
