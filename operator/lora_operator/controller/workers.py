"""The pod workers: one per inference pod, so calls to a pod never race; a semaphore bounds the
calls in flight across pods. A worker runs when something it depends on changes (the pod: new,
Ready, restarted, relabelled; an adapter of its namespace: staged, respecified, deleted), after a
failure's backoff, and every `resync_s` otherwise. It reads the pod's `/v1/models`, plans
(planning.plan_wants, planning.plan_pod), acts, and reads again (every `verify_every_s` of a long
series of calls, and at its end) unless every call was answered with what the pod now lists for the
adapter (a load's card, an unload's 200: `_answered`): what the pod reports is the only evidence
that it serves an adapter, and nothing is kept that a restart would need. A pass woken for some
adapters (`wake_adapter`) plans those and the ones whose cards changed since the pod's last report;
one woken for the pod or the namespace (`wake_namespace`: a placement moved, a rollout stepped), a
resync or a retry plans every adapter of the namespace. So a namespace whose adapters are staged one
at a time costs each pod a pass per adapter, not a pass over all of them; and such a pass plans from
the pod's last report when nothing but the operator's answered calls changed the pod since
(`_held`): a pod that answers its loads with cards is read once per `resync_s`, not once or twice
per adapter.

It owns the pod records (their tasks, reports, backoff; the cache adds them and takes in their
`info`) and every adapter's `entries` sub-record (its entry on each pod; podstate.transition
decides each change). It plans with the placer's placement as it is (the placer recomputes it,
told by `replace`, and wakes the pods when it moves them), and starts a rollout's canary entries
afresh when rollouts say the canary changed (`canary_changed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import NamedTuple

from lora_runtime import backoff

from lora_operator.controller.placer import Placer
from lora_operator.controller.records import Found, PodRecord, Recorded
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.edges import kube
from lora_operator.edges.podclient import PodError
from lora_operator.rules import placement, planning, podstate
from lora_operator.rules.model import PodInfo
from lora_operator.rules.podstate import PodEntry

log = logging.getLogger("lora_operator")

# A burst of changes (`kubectl apply` of many adapters, each changed again when it is staged)
# becomes one pass per pod.
COALESCE_S = 0.1
UNHEARD_FAILURES = 3  # a pod that failed this many reads in a row no longer holds status back


class Reading(NamedTuple):
    """A pod's report, and what it should hold and may keep, computed from it at once, of the
    adapters `among` (None: every adapter of the namespace)."""

    report: planning.PodReport
    wants: dict[str, planning.Want]
    keep: set[str]
    among: set[str] | None


class Workers(Actor):
    def __init__(self, shared: Shared, placer: Placer) -> None:
        super().__init__(shared)
        self.placer = placer
        self._calls = asyncio.Semaphore(self.config.max_concurrent_loads)

    # -- the pods -----------------------------------------------------------------------------

    def changed(self, info: PodInfo) -> None:
        """A pod came or changed (new IP, readiness, restart, labels, annotations...)."""
        prec, before = self.cache.pod_seen(info)
        if before is None:
            self._start(prec)
            return
        if before != info:
            if before.uid != info.uid or before.restarts != info.restarts:
                prec.report = None  # a new process: what it held is gone
            if before.reachable != info.reachable:
                # Which pods an adapter targets changed, and its status with them, even when
                # the pod is back before its worker or the placement saw it away.
                self.signals.mark_namespace(info.namespace)
            prec.due = None
            prec.wake.set()

    def forget_pod(self, key: Key) -> None:
        """The pod is gone (or no longer trusted): its worker ends, its entries go."""
        prec = self.cache.forget_pod(key)
        if prec is not None:
            _cancel(prec.task)
            self._drop_entries(prec)
            # Gone for good: the loads kept for its return (`_forget`) go too, or every pod a
            # rollout replaces would stay in each of its adapters' records.
            for rec in self.cache.adapters_in(prec.info.namespace):
                rec.entries.recorded_loads.pop(prec.info.name, None)

    def canary_changed(self, key: Key) -> None:
        """The adapter's rollout has another canary, or none: its canary entries start afresh,
        in a fresh dict (a load in flight for the old canary records into the old one)."""
        rec = self.cache.adapters.get(key)
        if rec is not None:
            rec.entries.canary = {}

    def activate(self) -> None:
        for prec in self.cache.pods.values():
            self._start(prec)

    def standby(self) -> None:
        for prec in self.cache.pods.values():
            _cancel(prec.task)
            prec.task, prec.report, prec.heard, prec.failures = None, None, False, 0
            prec.due = None

    def halt(self) -> list[asyncio.Task[None]]:
        tasks = [p.task for p in self.cache.pods.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        return tasks

    def wake_namespace(self, namespace: str) -> None:
        for prec in self.cache.pods_in(namespace):
            prec.due = None
            prec.wake.set()

    def wake_adapter(self, key: Key) -> None:
        """Only this adapter changed (staged, respecified, unpublished): the next pass of each
        of the namespace's pods plans it alone, not all the namespace's adapters again."""
        for prec in self.cache.pods_in(key[0]):
            if prec.due is not None:
                prec.due.add(key[1])
            prec.wake.set()

    def refresh(self, namespace: str) -> None:
        """Read the namespace's pods again (the autoscaler's hit counts): the next pass of each
        reads it, and plans what it was woken for and the adapters whose cards changed, not
        every adapter of the namespace (an unchanged answer changes nothing)."""
        for prec in self.cache.pods_in(namespace):
            prec.read_due = True
            prec.wake.set()

    def _start(self, prec: PodRecord) -> None:
        if self.seams.active.is_set() and prec.task is None:
            prec.task = asyncio.create_task(self._loop(prec), name=f"pod {prec.info.name}")
            prec.wake.set()

    async def _loop(self, prec: PodRecord) -> None:
        while True:
            timeout = prec.retry_in if prec.retry_in is not None else self.config.resync_s
            woken = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(prec.wake.wait(), timeout)
                woken = True
                await asyncio.sleep(COALESCE_S)  # a pass reads the pod's every adapter
            prec.wake.clear()
            # Woken for some adapters, a pass plans those; a resync or a retry, every one.
            due, prec.due = (prec.due if woken else None), set()
            try:
                await self._reconcile(prec, due)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the pod's reconciliation for good
                log.exception("reconciling pod %s/%s failed", *prec.info.key)
                prec.retry_in = self.config.max_backoff_s

    # -- one pass -----------------------------------------------------------------------------

    async def _reconcile(self, prec: PodRecord, due: set[str] | None) -> None:
        """One pass: read, plan the adapters `due` (None: every one), act, read again."""
        pod = prec.info
        started = time.monotonic()
        if not pod.reachable:
            prec.retry_in = None
            if prec.report is not None or not prec.heard:
                prec.report, prec.heard = None, True  # not targeted while it is not Ready
                self._drop_entries(prec)
            return
        reading = self._held(prec, due)
        if reading is None and (reading := await self._read(prec, due)) is None:
            return
        actions = planning.plan_pod(reading.wants, reading.report, reading.keep, reading.among)
        verify_at = time.monotonic() + self.config.verify_every_s
        acted = False
        for action in actions:
            if (
                prec.info.uid != pod.uid
                or not prec.info.reachable
                or not self.seams.active.is_set()
            ):
                break  # the pod changed under us: the next pass starts over
            if await self._act(prec, pod, action):
                acted, prec.read_at = True, None
            if acted and time.monotonic() >= verify_at:
                if await self._read(prec, due) is None:
                    return
                acted, verify_at = False, time.monotonic() + self.config.verify_every_s
        # What the pod now holds is read before the pass ends; when the next pass is already
        # due (adapters arrived meanwhile), its first read is that evidence: one read a pass,
        # not two, while a thousand adapters arrive one by one.
        if acted and not prec.wake.is_set() and await self._read(prec, due) is None:
            return
        prec.retry_in = self._retry_in(prec)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    def _retry_in(self, prec: PodRecord) -> float | None:
        """The least retry delay of the pod's entries (podstate.retry_delay), None when none
        is to be tried again; the entries that settled leave `unsettled`."""
        delays = []
        for name in list(prec.unsettled):
            found = self.cache.served(prec.info.namespace, name)
            entry = found[1].get(prec.info.name) if found is not None else None
            d = podstate.retry_delay(entry, self.config.max_backoff_s) if entry else None
            if d is None:
                prec.unsettled.discard(name)
            else:
                delays.append(d)
        return min(delays, default=None)

    def _held(self, prec: PodRecord, due: set[str] | None) -> Reading | None:
        """The pod's last report, recorded again for the adapters `due`, when a pass may plan
        from it instead of reading the pod: woken for some adapters (not for the pod, a resync
        or a retry), read within `resync_s`, and no call made since whose outcome it lacks
        (`read_at` is None after one; an answered call is in the report already). The pod's
        adapters change by the operator's calls (a process restart is a pod change), and
        otherwise only when its server drops one its pipeline refused at first use, which the
        next read within `resync_s` shows; so that report is what the pod holds."""
        if due is None or prec.report is None or prec.read_at is None or prec.read_due:
            return None
        if time.monotonic() - prec.read_at >= self.config.resync_s:
            return None
        return Reading(prec.report, *self._record(prec, prec.report, due))

    async def _read(self, prec: PodRecord, due: set[str] | None) -> Reading | None:
        """Read the pod's /v1/models and record it (`_record`); None (and a backoff) when it
        fails."""
        try:
            async with self._calls:
                read_at = time.monotonic()
                report = await self.seams.pods.models(prec.info)
        except PodError as e:
            prec.failures += 1
            prec.retry_in = backoff.delay(prec.failures, cap=self.config.max_backoff_s)
            if prec.failures >= UNHEARD_FAILURES and not prec.heard:
                prec.heard = True
                self.signals.replace(prec.info.namespace)  # it may wait for this pod no more
                self.signals.mark_namespace(prec.info.namespace)
                self.signals.holdings_changed(prec.info.namespace)
            log.info(
                "action=read-models pod=%s/%s result=error message=%r", *prec.info.key, e.message
            )
            return None
        prec.failures, prec.read_at, prec.read_due = 0, read_at, False
        return Reading(report, *self._record(prec, report, due))

    def _wants(
        self, pod: PodInfo, base_model: str | None, among: set[str] | None
    ) -> tuple[dict[str, planning.Want], set[str]]:
        """What the pod should hold of the adapters `among` (None: every adapter of the
        namespace), and what it may keep as it is (planning.plan_wants)."""
        # A full pass runs this for every adapter of the namespace: plain lookups, one tuple
        # each.
        adapters, candidates = self.cache.adapters, []
        if among is None:
            infos = self.cache.indexed(pod.namespace)
        else:
            infos = [r.info for a in among if (r := adapters.get((pod.namespace, a))) is not None]
        for i in infos:
            rec = adapters.get(i.key)
            if rec is None:
                c = planning.Candidate(i, i.staged)
            else:
                staged = rec.staging.state.staged
                c = planning.Candidate(
                    rec.info, staged, rec.rolling.rollout, rec.deletion.unpublished
                )
            candidates.append(c)
        chosen = self.placer.current(pod.namespace)
        placed, over = (chosen.adapters, chosen.over) if chosen is not None else (None, None)
        wants, keep = planning.plan_wants(pod, base_model, candidates, placed, over=over)
        if among is not None:
            # Not in the cache (yet, or no more): left as they are until a pass plans every one.
            keep.update(a for a in among if (pod.namespace, a) not in adapters)
        return wants, keep

    def _record(
        self,
        prec: PodRecord,
        report: planning.PodReport,
        due: set[str] | None,
        changed: set[str] | None = None,
    ) -> tuple[dict[str, planning.Want], set[str], set[str] | None]:
        """Take in what the pod reported: the entry on this pod of every wanted adapter among
        `due` (None: every adapter of the namespace) and of every adapter whose card changed
        since the last report (`changed`, when the caller knows them: an answered call).
        Returns what the pod should hold of those and may keep, and which they are, which a
        pass plans with.

        Taking in only those is exact: every other adapter's entry was taken in from a card
        that has not changed since, and its want changes only by a signal that wakes the pod
        for it (`wake_adapter`) or for every adapter (`wake_namespace`, a resync)."""
        pod = prec.info
        before, prec.report = prec.report, report
        same = before is report  # planned again from the report held (`_held`)
        if before is None or (not same and placement.inputs(before) != placement.inputs(report)):
            self.signals.replace(pod.namespace)
        if not prec.heard:
            prec.heard = True
            self.signals.mark_namespace(pod.namespace)
        among: set[str] | None = None
        if due is not None and before is not None:
            if changed is None:
                changed = set() if same else planning.changed_adapters(before, report)
            among = due | changed
        wants, keep = self._wants(pod, report.base_model, among)
        # A full pass records every entry anew; one for some adapters updates theirs in place.
        full = among is None
        entries: dict[str, Recorded] = {} if full else prec.entries
        aliases: set[str] = set() if full else prec.aliases
        before_entries = prec.entries
        for name, want in wants.items():
            found = self.cache.served(pod.namespace, name)
            if found is None:
                entries.pop(name, None)
                aliases.discard(name)
                continue
            card = report.cards.get(name)
            last = before_entries.get(name)
            # A pod reads the same for most adapters from one report to the next, and the
            # same Reported event on the entry it gave changes nothing (podstate), so only
            # what changed is applied: a pass costs little per adapter at a thousand.
            if last is None or last != (want, card, found[1].get(pod.name)):
                entry = self._apply(found, prec, name, podstate.Reported(want, card))
                last = Recorded(want, card, entry)
            entries[name] = last
            if want.adapter != name:
                aliases.add(name)
        # The entries no longer wanted: of every adapter, or of those `among` (found by their
        # own names and the aliases, not by a walk over every entry of the namespace).
        if among is None:
            gone = [n for n in before_entries if n not in wants]
        else:
            gone = [
                n
                for n in (*among, *aliases)
                if n not in wants and (r := entries.get(n)) is not None and r.want.adapter in among
            ]
        for name in gone:
            entries.pop(name, None)
            aliases.discard(name)
            self._forget(self.cache.served(pod.namespace, name), pod.name)
        prec.entries, prec.aliases = entries, aliases
        if before is None or (not same and before.managed() != report.managed()):
            if before is None or not before.managed().items() <= report.managed().items():
                self.signals.collect()  # a revision left the pod: it may be unused now
            self.signals.holdings_changed(pod.namespace)
        return wants, keep, among

    def _apply(self, found: Found, prec: PodRecord, name: str, event: podstate.Event) -> PodEntry:
        """One event of the adapter's entry on the pod, served as `name` (podstate.transition
        decides)."""
        rec, entries = found
        pod = prec.info.name
        entry = entries.get(pod, PodEntry())
        new = podstate.transition(entry, event, retry_bound=self.config.retry_bound)
        if new.state == "Loaded" and new.loaded_at is None:
            loads = rec.entries.recorded_loads
            revision, at, seconds = loads.get(pod, (None, None, None))
            if revision == new.revision:  # loaded before (an earlier process, a pod away)
                new = dataclasses.replace(new, loaded_at=at, load_seconds=seconds)
        if new == entry:
            return entry
        entries[pod] = new
        if podstate.retry_delay(new, self.config.max_backoff_s) is not None:
            prec.unsettled.add(name)
        self.signals.mark(rec.key)
        return new

    def _forget(self, found: Found | None, pod_name: str) -> None:
        """Take away the adapter's entry on a pod that no longer holds it or is away, keeping
        when it was loaded there: a pod back from a moment away with the same revision shows
        the same loadedAt (`_apply`), so the adapter's status is as it was and not written."""
        if found is None:
            return
        rec, entries = found
        entry = entries.pop(pod_name, None)
        if entry is None:
            return
        if entry.state == "Loaded" and entries is rec.entries.own:
            rec.entries.recorded_loads[pod_name] = (
                entry.revision,
                entry.loaded_at,
                entry.load_seconds,
            )
        self.signals.mark(rec.key)

    def _drop_entries(self, prec: PodRecord) -> None:
        namespace = prec.info.namespace
        self.signals.replace(namespace)
        for name in prec.entries:
            self._forget(self.cache.served(namespace, name), prec.info.name)
        prec.entries, prec.aliases, prec.unsettled = {}, set(), set()
        self.signals.mark_namespace(namespace)
        self.signals.holdings_changed(namespace)

    # -- the calls ----------------------------------------------------------------------------

    async def _act(self, prec: PodRecord, pod: PodInfo, action: planning.Action) -> bool:
        """Carry out one planned call; True when the pod may have changed in a way not yet
        read (a failed call, a load answered without the adapter's card)."""
        if isinstance(action, planning.Unload):
            if await self._unload(pod, action.name):
                return True
            self._answered(prec, pod, action.name, None)
            return False
        found = self.cache.served(pod.namespace, action.name)
        if found is None:
            return False
        if isinstance(action, planning.Conflict):
            self._apply(
                found,
                prec,
                action.name,
                podstate.Conflicted(
                    action.want,
                    f"pod {pod.name} already serves an adapter named {action.name!r} that the "
                    "operator did not load (a --lora flag?); rename the LoRAAdapter or drop "
                    "the flag",
                ),
            )
            return False
        want = action.want
        if not podstate.may_load(found[1].get(pod.name, PodEntry()), want):
            return False  # refused before: retried only when the spec or the revision changes
        self._apply(found, prec, action.name, podstate.Started(want))
        started = time.monotonic()
        try:
            async with self._calls:
                card = await self.seams.pods.load(pod, want, inplace=action.inplace)
        except PodError as e:
            result = "permanent" if e.permanent else "transient"
            self.metrics.loads.labels(result).inc()
            log.warning(
                "action=load pod=%s/%s adapter=%s revision=%s result=%s message=%r",
                *pod.key,
                want.name,
                want.sha256,
                result,
                e.message,
            )
            self._apply(found, prec, action.name, podstate.Failed(want, e.message, e.permanent))
            return True
        seconds = time.monotonic() - started
        self.metrics.loads.labels("ok").inc()
        self.metrics.load_seconds.observe(seconds)
        log.info(
            "action=%s pod=%s/%s adapter=%s revision=%s result=ok seconds=%.3f",
            "load-inplace" if action.inplace else "load",
            *pod.key,
            want.name,
            want.sha256,
            seconds,
        )
        self._apply(found, prec, action.name, podstate.Succeeded(want, seconds, kube.now_iso()))
        if card is None:
            return True
        self._answered(prec, pod, want.name, card)
        return False

    def _answered(
        self, prec: PodRecord, pod: PodInfo, name: str, card: planning.Card | None
    ) -> None:
        """The pod answered a call for `name` with what it lists for it now (a load's card;
        None: an unload). Its adapters change by these calls (`_held` says what else), so its
        report with this answer is what a read would return (but for `hits`, which the next
        read brings), and is recorded as one: the answer is the pod's own evidence, as its
        list is."""
        if prec.report is None or prec.info.uid != pod.uid or prec.info.restarts != pod.restarts:
            return  # a new process since the call began: its first read tells
        cards = (prec.report.cards.get(name), card)
        changed = {c.adapter or name for c in cards if c is not None} | {name}
        self._record(prec, prec.report.answered(name, card), {name}, changed)

    async def _unload(self, pod: PodInfo, name: str) -> bool:
        """Unload `name`; True when it failed (the pod may or may not hold it now)."""
        try:
            async with self._calls:
                await self.seams.pods.unload(pod, name)
        except PodError as e:
            self.metrics.unloads.labels("error").inc()
            log.warning(
                "action=unload pod=%s/%s adapter=%s result=error message=%r",
                *pod.key,
                name,
                e.message,
            )
            return True
        self.metrics.unloads.labels("ok").inc()
        log.info("action=unload pod=%s/%s adapter=%s result=ok", *pod.key, name)
        return False


def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
