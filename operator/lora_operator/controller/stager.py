"""The stager: puts each adapter's source (or, for spec.compose, its members' stack) on the
volume, retrying transient failures with backoff, and stages a composition again when the
revision its members make changes. It owns the record's `staging` sub-record (the state status
renders, the task, its generation) and the set of compositions; only it starts and cancels a
staging task (`stop` for the finalizer, `standby` and `halt` for the controller). Which sources
it may fetch, and from where, is `consent`'s and `sources`' to decide; the store (`staging`)
writes the volume. A staging is in progress (`Staging`) from when the store says its download
began, not while it waits for one of the store's download slots (`Pending`, written once
however long the queue).

Every staging task ends in a status: a StagingError as its kind says, and any other exception (a
bug, or a fault no check names) as `StagingCrashed`, permanent for that generation, with its
traceback in the log. So no file, however hostile, leaves an adapter Pending behind a task that
died, or is staged again and again: not by this process, nor by a restarted one (the Failed
status, of this generation, is its memory).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import aiohttp
from lora_runtime import backoff

from lora_operator.controller.records import AdapterRecord
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.edges import kube
from lora_operator.rules import composition, consent, errors
from lora_operator.rules.model import AdapterInfo, StagedRef
from lora_operator.rules.resume import needs_staging
from lora_operator.store import sources

log = logging.getLogger("lora_operator")


class StagingCrashed(errors.PermanentStagingError):
    """Staging stopped on an exception that is no StagingError. Permanent: what failed this way
    once would fail again (the same file, the same bug), and a retry could be the crash a
    restarted operator repeats; a new spec stages it again."""

    reason = "InternalError"

    @classmethod
    def of(cls, e: BaseException) -> StagingCrashed:
        # The type only: an exception's text may hold a signed URL, and messages never do.
        return cls(
            f"staging stopped on an unexpected {type(e).__name__}, a fault of the operator's "
            "(its log has the traceback: report it); change the spec to stage it again"
        )


class Stager(Actor):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        # The adapters with spec.compose: what a member's change looks through, so that an
        # event about one of a thousand plain adapters does not walk all of them.
        self._compositions: set[Key] = set()

    def changed(self, rec: AdapterRecord, generation_changed: bool) -> None:
        """The adapter's spec changed: stage it if its generation did."""
        if rec.info.compose:
            self._compositions.add(rec.key)
        else:
            self._compositions.discard(rec.key)
        if not rec.info.deleting and generation_changed:
            self.consider(rec)

    def forget(self, key: Key) -> None:
        self._compositions.discard(key)
        rec = self.cache.adapters.get(key)
        if rec is not None and rec.staging.task is not None:
            rec.staging.task.cancel()

    async def stop(self, key: Key) -> None:
        """Cancel the adapter's staging, and return once its task has ended (a publish in
        progress ends first)."""
        rec = self.cache.adapters.get(key)
        task = rec.staging.task if rec is not None else None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    def standby(self) -> None:
        self.halt()  # staged again when this replica acts (`consider`)

    def halt(self) -> list[asyncio.Task[None]]:
        tasks = [t for r in self.cache.adapters.values() if (t := r.staging.task) is not None]
        for task in tasks:
            task.cancel()
        return tasks

    def consider(self, rec: AdapterRecord, *, members_changed: bool = False) -> None:
        """Start staging the spec's source unless the volume holds it or it failed for good.

        `members_changed`: a composition's member changed, which supersedes a staging in
        progress (or waiting to retry) as a new spec does.
        """
        info, staging = rec.info, rec.staging
        state = staging.state
        if not self.seams.active.is_set() or info.deleting:
            return
        if staging.task is not None and not staging.task.done():
            if staging.generation == info.generation and not (
                members_changed and self._outdated(rec)
            ):
                return
            staging.task.cancel()  # a new spec supersedes the staging in progress
        if state.permanent and state.observed_generation == info.generation:
            return  # refused for good: retried when the spec changes
        current = self.seams.volume.current_revision(info.namespace, info.name)
        composed = self._composed_revision(info)
        if not needs_staging(info, state.observed_generation, current, composed):
            # Staged already, perhaps by a release that published no target: the pods'
            # resolvers must still learn which of them it is for.
            self._publish_target(info)
            if state.adapter is None:
                self._describe(rec)
            return
        if state.observed_generation != info.generation:
            state.attempts, state.permanent = 0, False
        staging.generation = info.generation
        state.bytes_so_far = 0
        previous = staging.task
        staging.task = asyncio.create_task(
            self._stage(rec, previous), name=f"stage {info.namespace}/{info.name}"
        )
        staging.task.add_done_callback(_log_if_died)
        self.signals.mark(rec.key)

    def restage_compositions_of(self, member: AdapterInfo) -> None:
        """`member` changed (its spec, its staged revision, or it is gone): the compositions
        that name it are staged again if the revision their members make changed."""
        for key in sorted(self._compositions):
            rec = self.cache.adapters.get(key)
            if (
                rec is not None
                and key[0] == member.namespace
                and any(m.name == member.name for m in rec.info.compose)
            ):
                self.consider(rec, members_changed=True)

    async def _stage(self, rec: AdapterRecord, previous: asyncio.Task[None] | None) -> None:
        """Stage until it succeeds or fails for good, retrying with backoff; the phase stays
        what the last attempt made it (Staging, then Degraded) through the retries."""
        if previous is not None:
            await asyncio.wait([previous])  # its publish finishes first
        state = rec.staging.state
        try:
            while True:
                # A download is in progress once the store says it began (`progress(0)`): an
                # adapter waiting for a download slot behind thousands of others is Pending,
                # and its status says so once, not Staging at 0 bytes and again when its turn
                # comes. A composition downloads nothing and waits for no one for long.
                state.in_progress = bool(rec.info.compose)
                self.signals.mark(rec.key)
                try:
                    await self._stage_once(rec)
                    return
                except errors.StagingError as e:
                    delay = self._failed(rec, e)
                    if delay is None:
                        return
                    await asyncio.sleep(delay)
                except Exception as e:
                    log.exception(
                        "action=stage adapter=%s/%s result=crashed error=%s",
                        *rec.key,
                        type(e).__name__,
                    )
                    self._failed(rec, StagingCrashed.of(e))
                    return
        finally:
            state.in_progress = False
            self.signals.mark(rec.key)

    async def _stage_once(self, rec: AdapterRecord) -> None:
        info, state = rec.info, rec.staging.state
        loop = asyncio.get_running_loop()

        task = asyncio.current_task()

        def progress(n: int) -> None:  # the fetcher's worker thread (0: the loop, at start)
            state.bytes_so_far = n
            loop.call_soon_threadsafe(self._downloading, rec, task)

        started = time.monotonic()
        volume = self.seams.volume
        if info.compose:
            entries = composition.plan_composition(info, self._members(info))
            described = "compose:" + ",".join(
                f"{e.name}@{e.sha256[:12]}*{e.scale:g}" for e in entries
            )
            staged = await volume.stage_composition(
                info.namespace, info.name, entries, target=info.target
            )
        else:
            source = sources.parse_source(info.source.uri, info.source.revision)
            described = sources.describe(source)
            credentials = await self._credentials(info)
            staged = await volume.stage(
                info.namespace,
                info.name,
                source,
                credentials=credentials,
                sha256=info.source.sha256,
                progress=progress,
                target=info.target,
            )
        seconds = time.monotonic() - started
        serving = state.staged.sha256 if state.staged is not None else None
        state.succeeded(
            StagedRef(sha256=staged.sha256, size=staged.size),
            str(staged.path),
            kube.now_iso(),
            info.generation,
            staged.adapter,
            staged.resolved,
        )
        self.signals.staged(rec.key, serving, staged.sha256)
        self.metrics.stagings.labels("ok").inc()
        self.metrics.staging_seconds.observe(seconds)
        if not staged.reused:
            self.metrics.staged_bytes.inc(staged.size)
        log.info(
            "action=staged adapter=%s/%s source=%s resolved=%s sha256=%s bytes=%d reused=%s "
            "seconds=%.3f",
            *rec.key,
            described,
            staged.resolved,
            staged.sha256,
            staged.size,
            staged.reused,
            seconds,
        )
        self.signals.wake_adapter(info.key)
        if staged.superseded:
            # The revision it replaced may be in use by nothing now. Not after every staging:
            # a collection scans the whole volume, and blocks stagings while it runs.
            self.signals.collect()
        self.restage_compositions_of(info)

    def _downloading(self, rec: AdapterRecord, task: asyncio.Task[object] | None) -> None:
        """The download of `task` began or went on; nothing once that staging has ended (a
        cancelled download's thread writes until its next chunk)."""
        if task is None or task.done() or task is not rec.staging.task:
            return
        rec.staging.state.in_progress = True
        self.signals.mark(rec.key)

    def _members(self, info: AdapterInfo) -> dict[str, composition.MemberState]:
        """The members of composition `info` that exist, with the revisions they staged. From
        the records, which hold every adapter before the controller acts: a member is not
        taken for missing because its own event came later than the composition's."""
        wanted = {m.name for m in info.compose}
        members = {}
        for member in self.cache.indexed(info.namespace):
            if member.name in wanted:
                rec = self.cache.adapters.get(member.key)
                staged = rec.staging.state.staged if rec is not None else member.staged
                r = rec.rollout if rec is not None else None
                if r is not None and staged is not None:
                    # A member under a rollout takes part with what its name serves: the
                    # stable revision, until it is promoted.
                    staged = StagedRef(sha256=r.name_revision, size=staged.size)
                members[member.name] = composition.MemberState(
                    info=member,
                    staged=staged,
                    adapter=rec.staging.state.adapter if rec is not None else None,
                )
        return members

    def _composed_revision(self, info: AdapterInfo) -> str | None:
        """The revision a composition's members make now (None: not a composition, or its
        members make none: staging it says why)."""
        if not info.compose:
            return None
        try:
            return composition.composed_revision(
                composition.plan_composition(info, self._members(info))
            )
        except errors.StagingError:
            return None

    def _outdated(self, rec: AdapterRecord) -> bool:
        """Whether a composition's staging in progress must start over after a member's change:
        it waits to retry a failure, or its members now make another revision."""
        current = self.seams.volume.current_revision(rec.info.namespace, rec.info.name)
        return rec.staging.state.attempts > 0 or self._composed_revision(rec.info) != current

    def _describe(self, rec: AdapterRecord) -> None:
        """Read what the staged revision declares, for an adapter whose status does not say
        (staged by a release that did not record it): its headers only, a few kilobytes."""
        try:
            rec.staging.state.adapter = self.seams.volume.describe_current(*rec.key)
        except errors.StagingError as e:
            # The status goes without it until the next staging; serving is unaffected.
            log.warning("action=describe adapter=%s/%s error=%s", *rec.key, e)
            return
        except Exception:  # the same, for a fault no check names: this runs in a handler
            log.exception("action=describe adapter=%s/%s result=crashed", *rec.key)
            return
        self.signals.mark(rec.key)

    def _publish_target(self, info: AdapterInfo) -> None:
        try:
            if self.seams.volume.publish_target(info.namespace, info.name, info.target):
                log.info("action=published-target adapter=%s/%s", *info.key)
        except errors.StagingError as e:
            # Pods keep the previous target (or none) until the next try: the next change.
            log.warning("action=published-target adapter=%s/%s error=%s", *info.key, e)

    def _failed(self, rec: AdapterRecord, e: errors.StagingError) -> float | None:
        """Record a failure; the delay before the next attempt (None: permanent)."""
        state = rec.staging.state
        delay = (
            None
            if e.permanent
            else backoff.delay(state.attempts + 1, cap=self.config.max_backoff_s)
        )
        state.failed(
            permanent=e.permanent,
            reason=e.reason,
            message=e.message,
            next_at=None if delay is None else kube.now_iso(delay),
            degraded_at_once=e.degrades_at_once,
        )
        if e.permanent:
            state.observed_generation = rec.info.generation
        self.metrics.stagings.labels("permanent" if e.permanent else "transient").inc()
        log.warning(
            "action=stage adapter=%s/%s result=%s reason=%s attempts=%d message=%r",
            *rec.key,
            "permanent" if e.permanent else "transient",
            e.reason,
            state.attempts,
            e.message,
        )
        return delay

    async def _credentials(self, info: AdapterInfo) -> sources.Credentials:
        ambient = self.config.source_rules.ambient_for(info.namespace)
        ref = info.source.secret
        if not ref:
            return sources.Credentials(ambient=ambient)
        api = await self.seams.api_after_login()
        try:
            secret = await api.read_secret(info.namespace, ref)
        except kube.InvalidName as e:  # the CRD refuses such a name; an older CRD may not
            raise errors.InvalidSource(f"source.secretRef.name: {e}") from e
        except kube.ApiError as e:
            if e.status == 404:
                raise errors.SourceUnavailable(
                    f"Secret {ref!r} (source.secretRef) does not exist in namespace "
                    f"{info.namespace}; create it"
                ) from e
            if e.status == 403:
                raise errors.SourceUnavailable(
                    f"the operator may not read Secrets in namespace {info.namespace}: add it "
                    "to the chart's operator.secretNamespaces (or operator.watchNamespaces)"
                ) from e
            raise errors.SourceUnavailable(f"cannot read Secret {ref!r}: {e}") from e
        except (aiohttp.ClientError, TimeoutError) as e:  # the API server unreachable: retried
            raise errors.SourceUnavailable(f"cannot read Secret {ref!r}: {e!r}") from e
        except ValueError as e:  # a value that is not base64 of UTF-8 text
            raise errors.InvalidSource(
                f"Secret {ref!r} (source.secretRef) holds a value that is not UTF-8 text; "
                "store the credentials as plain text"
            ) from e
        # Before any value is used: a Secret that does not say it is for LoRAAdapters is
        # refused, and its values never leave the operator.
        consent.check_secret(ref, secret.labels, secret.annotations)
        return dataclasses.replace(sources.credentials_from_secret(secret.data), ambient=ambient)


def _log_if_died(task: asyncio.Task[None]) -> None:
    """A staging task ends by returning or by its cancellation (`_stage` turns every failure
    into a status); one that ended otherwise is logged here, not left to the garbage collector."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.error("action=stage task=%r result=died", task.get_name(), exc_info=e)
