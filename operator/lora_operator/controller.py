"""The controller: stages adapters, keeps every inference pod's adapters equal to what it should
hold, and writes each LoRAAdapter's status and Events. kopf's handlers (handlers.py) feed it
events; the decisions are pure functions (planning, podstate, status, events, peering); this
module does the I/O and the waiting.

State: one `AdapterRecord` per LoRAAdapter (its spec, its staging state, its entry on each pod, the
status last written) and one `PodRecord` per inference pod (its worker, its last report). The
pod client, the volume store and the API client are injected, so tests can swap them.

One worker per inference pod reconciles that pod, so calls to a pod never race; a semaphore
bounds the calls in flight across pods. A worker runs when something it depends on changes (the
pod: new, Ready, restarted, relabelled; an adapter of its namespace: staged, respecified,
deleted), after a failure's backoff, and every `resync_s` otherwise. It reads the pod's
`/v1/models`, plans, acts, and reads `/v1/models` again (every `verify_every_s` of a long series
of calls, and at its end): what the pod reports is the only evidence that it serves an adapter,
and nothing is kept that a restart would need.

With several replicas (`--peering`), everything here waits while `peering.Mirror` says another
replica acts; the first thing a replica does when it starts acting is to clean `.tmp/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

import aiohttp
import kopf
from lora_volume import stacks, targeting

from lora_operator import (
    autoscale,
    backoff,
    canary,
    composition,
    consent,
    errors,
    events,
    gc,
    kube,
    peering,
    placement,
    planning,
    podstate,
    resume,
    rollout,
    sinks,
    sources,
    staging,
    trust,
)
from lora_operator import status as status_mod
from lora_operator.config import OperatorConfig
from lora_operator.metrics import Metrics
from lora_operator.model import (
    INFERENCE_LABEL,
    AdapterInfo,
    AutoscaleSpec,
    Command,
    PodInfo,
    StagedRef,
    adapter_info,
    object_ref,
)
from lora_operator.podclient import PodClient, PodError
from lora_operator.podstate import PodEntry
from lora_operator.resume import needs_staging

log = logging.getLogger("lora_operator")

Key = tuple[str, str]  # (namespace, name)
Body = kopf.Body | Mapping[str, Any]

# A burst of changes (`kubectl apply` of many adapters, each changed again when it is staged)
# becomes one pass per pod and one status computation per adapter.
COALESCE_S = 0.1
UNHEARD_FAILURES = 3  # a pod that failed this many reads in a row no longer holds status back
# A burst of changes (a thousand adapters applied) becomes one placement every this often.
PLACEMENT_COALESCE_S = 0.5


# -- what the controller talks to (injected) --------------------------------------------------


class Pods(Protocol):
    async def models(self, pod: PodInfo) -> planning.PodReport: ...

    async def load(self, pod: PodInfo, want: planning.Want, *, inplace: bool) -> None: ...

    async def unload(self, pod: PodInfo, name: str) -> None: ...

    async def close(self) -> None: ...


class Volume(Protocol):
    async def stage(
        self,
        namespace: str,
        name: str,
        source: sources.Source,
        *,
        credentials: sources.Credentials | None = None,
        sha256: str | None = None,
        progress: sinks.ProgressCallback | None = None,
        target: targeting.Target | None = None,
    ) -> staging.StagedRevision: ...

    async def stage_composition(
        self,
        namespace: str,
        name: str,
        entries: Sequence[stacks.StackEntry],
        *,
        target: targeting.Target | None = None,
    ) -> staging.StagedRevision: ...

    def publish_target(self, namespace: str, name: str, target: targeting.Target) -> bool: ...

    async def unpublish(self, namespace: str, name: str) -> bool: ...

    async def collect(self, in_use: Collection[gc.RevisionRef]) -> tuple[gc.GcPlan, int]: ...

    def current_revision(self, namespace: str, name: str) -> str | None: ...

    def clean_tmp(self) -> int: ...


class Api(peering.Watcher, Protocol):
    async def patch_adapter_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None: ...

    async def read_secret(self, namespace: str, name: str) -> kube.SecretRead: ...

    async def create_event(
        self, regarding: Mapping[str, str], name: str, type_: str, reason: str, note: str
    ) -> None: ...

    async def count_event(self, namespace: str, name: str, count: int) -> None: ...

    async def remove_annotation(
        self, namespace: str, name: str, key: str, resource_version: str
    ) -> None: ...

    async def close(self) -> None: ...


# -- the records --------------------------------------------------------------------------------


@dataclass
class AdapterRecord:
    """Everything the controller knows about one LoRAAdapter."""

    info: AdapterInfo
    staging_state: status_mod.StagingState  # named apart from the staging module
    pods: dict[str, PodEntry] = field(default_factory=dict)  # pod name -> entry
    written: dict[str, Any] | None = None  # the status the object has
    written_headline: status_mod.Headline | None = None
    written_at: float = field(default_factory=time.monotonic)  # or when first seen
    headline: tuple[str, str] | None = None  # what summarise says now
    headline_since: float = field(default_factory=time.monotonic)
    phase: str | None = None  # for the phase gauge
    fingerprint: tuple[Any, ...] = ()
    staging_task: asyncio.Task[None] | None = None
    staging_generation: int | None = None
    unpublished: bool = False  # deleting, and its `current` is gone
    unloaded: asyncio.Event = field(default_factory=asyncio.Event)  # deleting: no pod holds it
    # Load times an earlier process recorded in status.pods: (revision, loadedAt, loadSeconds).
    recorded_loads: dict[str, tuple[str | None, str | None, float | None]] = field(
        default_factory=dict
    )
    # spec.autoscale: the replicas chosen now, and the pods' hit counters at the last
    # measurement (pod/served name -> count, and when).
    scale: autoscale.Scale | None = None
    hits_seen: tuple[dict[str, int], float] | None = None
    # spec.rollout: the rollout under way (None: none), and the canary's entry on each pod (the
    # revision it serves under its alias; `pods` holds the adapter's own name).
    rollout: rollout.Rollout | None = None
    canary_pods: dict[str, PodEntry] = field(default_factory=dict)
    rollout_wake: asyncio.TimerHandle | None = None
    taking_command: bool = False  # removing the rollout annotation, to act on it

    @property
    def key(self) -> Key:
        return self.info.key


# An adapter's entries on the pods under one served name: the record and its entries (its own
# `pods`, or `canary_pods` for a rollout's alias).
Entries = tuple[AdapterRecord, dict[str, PodEntry]]


@dataclass
class PodRecord:
    """One inference pod: its worker and what it last reported."""

    info: PodInfo
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    report: planning.PodReport | None = None
    retry_in: float | None = None  # a backoff after a failure, instead of the resync interval
    failures: int = 0  # consecutive failures to read the pod's /v1/models
    heard: bool = False  # reported (or kept failing) since this replica began to act
    # The served names with an entry for this pod, each with the want and card last recorded
    # for it and the entry they gave (`_record` skips what has not changed since).
    entries: dict[str, Recorded] = field(default_factory=dict)


class Recorded(NamedTuple):
    want: planning.Want
    card: planning.Card | None
    entry: PodEntry


class Reading(NamedTuple):
    """A pod's report, and what it should hold and may keep, computed from it at once."""

    report: planning.PodReport
    wants: dict[str, planning.Want]
    keep: set[str]


class Controller:
    def __init__(
        self,
        config: OperatorConfig,
        metrics: Metrics | None = None,
        *,
        pods: Pods | None = None,
        volume: Volume | None = None,
        api: Api | None = None,
        identity: str | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.volume: Volume = volume or staging.Store(
            config.volume_root,
            max_bytes=config.max_adapter_bytes,
            max_concurrent=config.max_concurrent_stagings,
            hf_endpoint=config.hf_endpoint,
        )
        self.pod_client: Pods = pods or PodClient(
            admin_token=config.admin_token,
            token_file=config.admin_token_file,
            timeout_s=config.load_timeout_s,
        )
        self.trust = config.trust_policy
        # Labelled pods that are not the release's (trust.refusal), by key: the uid an Event
        # was posted for, so that each such pod is reported once.
        self._distrusted: dict[Key, str] = {}
        self._api_endpoint: tuple[str, int] | None = None  # the API server's, from the login
        self.api: Api | None = api
        self.identity = identity or peering.own_identity()
        self.priority = (
            config.peering_priority
            if config.peering_priority is not None
            else peering.start_priority()
        )
        self.policy = status_mod.WritePolicy(config.status_settle_s, config.status_progress_s)
        self._logged_in = asyncio.Event()
        if api is not None:
            self._logged_in.set()
        self.active = asyncio.Event()
        self._pods_index: kopf.Index[str, PodInfo] | None = None
        self._adapters_index: kopf.Index[str, AdapterInfo] | None = None
        self.adapters: dict[Key, AdapterRecord] = {}
        self.pods: dict[Key, PodRecord] = {}
        self._unloading: set[Key] = set()  # unpublished, waiting for no pod to hold them
        self._calls = asyncio.Semaphore(config.max_concurrent_loads)
        # API writes in flight at once (the API server's client-side budget is small: a burst of
        # hundreds must queue here, not time out).
        self._write_slots = asyncio.Semaphore(8)
        self._event_slots = asyncio.Semaphore(8)
        # Per namespace: where the adapters with spec.replicas or spec.autoscale are placed,
        # recomputed when an input changed (placement.plan_placement decides).
        self._placements: dict[str, placement.Placement] = {}
        self._stale_placements: set[str] = set()
        # The adapters with spec.compose: what a member's change looks through, so that an
        # event about one of a thousand plain adapters does not walk all of them.
        self._compositions: set[Key] = set()
        self._placed_at: dict[str, float] = {}  # when each namespace's placement was computed
        self._placement_due: set[str] = set()  # a recompute is scheduled
        self._dirty: set[Key] = set()
        self._due: dict[Key, float] = {}
        self._writer_wake = asyncio.Event()
        self._collect_event = asyncio.Event()
        self._series = events.Series()
        self._phases: Counter[str] = Counter()
        self._background: set[asyncio.Task[None]] = set()
        self._on_stop: list[Callable[[], Coroutine[Any, Any, None]]] = []

    # -- lifecycle ----------------------------------------------------------------------------

    def use_credentials(self, info: kopf.ConnectionInfo) -> None:
        server = urlsplit(info.server)
        if server.hostname:
            self._api_endpoint = (server.hostname, server.port or 443)
        old, self.api = self.api, kube.KubeApi(info, instance=self.identity)
        if old is not None:
            self._spawn(old.close())
        self._logged_in.set()

    def start(
        self,
        pods_index: kopf.Index[str, PodInfo] | None = None,
        adapters_index: kopf.Index[str, AdapterInfo] | None = None,
    ) -> None:
        """Begin: at once when standalone, else when the peering says this replica acts.

        kopf's indices are complete before its first event handler runs: the controller reads
        them where a missing object would do harm (a pod's wants, collection)."""
        self._pods_index, self._adapters_index = pods_index, adapters_index
        self._spawn(self._writer(), name="status-writer")
        self._spawn(self._collector(), name="collector")
        self._spawn(self._autoscaler(), name="autoscaler")
        if self.config.standalone:
            self.set_active(True)
        else:
            assert self.config.peering is not None
            mirror = peering.Mirror(
                self._api_now,
                peering.peering_paths(self.config.peering, self.config.namespaces),
                self.identity,
                self.priority,
                self.set_active,
            )
            self._spawn(self._after_login(mirror.run()), name="peering")

    def on_stop(self, callback: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._on_stop.append(callback)

    async def stop(self) -> None:
        for callback in self._on_stop:
            await callback()
        tasks = [p.task for p in self.pods.values() if p.task]
        tasks += [a.staging_task for a in self.adapters.values() if a.staging_task]
        tasks += list(self._background)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pod_client.close()
        if self.api is not None:
            await self.api.close()

    def set_active(self, active: bool) -> None:
        """Start acting (this replica leads, or stands alone), or stop (another one leads)."""
        if active == self.active.is_set():
            return
        if not active:
            self.active.clear()
            log.info("action=standby identity=%s", self.identity)
            for prec in self.pods.values():
                _cancel(prec.task)
                prec.task, prec.report, prec.heard, prec.failures = None, None, False, 0
            for rec in self.adapters.values():
                _cancel(rec.staging_task)
            return
        # Only the replica that acts may clean: another one's downloads live there too.
        removed = self.volume.clean_tmp()
        log.info(
            "action=activate identity=%s priority=%d clean-tmp removed=%d",
            self.identity,
            self.priority,
            removed,
        )
        self.active.set()
        for prec in self.pods.values():
            self._start_worker(prec)
        for rec in self.adapters.values():
            self._consider_staging(rec)
            self._mark(rec.key)

    # -- what kopf tells us -------------------------------------------------------------------

    def adapter_changed(self, body: Body, deleted: bool = False) -> None:
        info = adapter_info(body)
        key = info.key
        if deleted:
            self._forget(key)
            return
        rec = self.adapters.get(key)
        if rec is None:
            rec = self.adapters[key] = _seed(info, body)
            generation_changed = True
        else:
            generation_changed = rec.info.generation != info.generation
            rec.info = info
        if info.compose:
            self._compositions.add(key)
        else:
            self._compositions.discard(key)
        if not info.deleting and generation_changed:
            self._consider_staging(rec)
        self._restage_compositions_of(info)
        if info.autoscale is None:
            rec.scale, rec.hits_seen = None, None
        fingerprint = (
            info.deleting,
            info.scale,
            info.pinned,
            info.selector,
            info.base_model,
            info.replicas,
            info.autoscale,
        )
        if info.command is not None:
            self._mark(key)  # the status pass takes the rollout command (_advance_rollout)
        if rec.fingerprint != fingerprint:
            rec.fingerprint = fingerprint
            self._stale_placements.add(info.namespace)
            if not info.deleting:  # a deletion wakes the pods once it has unpublished
                self._wake_namespace(info.namespace)
            self._mark(key)

    def pod_changed(self, info: PodInfo, deleted: bool = False) -> None:
        key = info.key
        if deleted:
            self._distrusted.pop(key, None)
        elif (reason := trust.refusal(info, self.trust)) is not None:
            # Not one of the release's inference pods: no worker, so no call at all (no admin
            # token, no load), and an Event says why.
            self._distrust(info, reason)
            deleted = True
        prec = self.pods.get(key)
        self._stale_placements.add(info.namespace)
        if deleted:
            if prec is not None:
                _cancel(prec.task)
                del self.pods[key]
                self._drop_entries(prec)
            return
        if prec is None:
            prec = self.pods[key] = PodRecord(info=info)
            self._start_worker(prec)
            return
        before, prec.info = prec.info, info
        if before != info:  # new IP, readiness, restart, labels, annotations...
            if before.uid != info.uid or before.restarts != info.restarts:
                prec.report = None  # a new process: what it held is gone
            prec.wake.set()

    def _distrust(self, info: PodInfo, reason: str) -> None:
        if self._distrusted.get(info.key) == info.uid or not self.active.is_set():
            return
        self._distrusted[info.key] = info.uid
        log.warning("action=distrust pod=%s/%s reason=%r", *info.key, reason)
        regarding = {"apiVersion": "v1", "kind": "Pod", "name": info.name, "uid": info.uid}
        if info.owner is not None and info.owner[0] in ("ReplicaSet", "Deployment", "StatefulSet"):
            kind, name, uid = info.owner
            regarding = {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": uid}
        note = events.Note(
            "Warning",
            "UntrustedInferencePod",
            f"pod {info.name} has the label {INFERENCE_LABEL} but is not one of the release's "
            f"inference pods: {reason}. The operator sends it no admin token and loads nothing "
            "on it.",
        )
        self._spawn(
            self._send_event(
                {**regarding, "namespace": info.namespace},
                f"{info.name}.{uuid.uuid4().hex[:16]}",
                1,
                note,
            )
        )

    # -- staging ------------------------------------------------------------------------------

    def _consider_staging(self, rec: AdapterRecord, *, members_changed: bool = False) -> None:
        """Start staging the spec's source unless the volume holds it or it failed for good.

        `members_changed`: a composition's member changed, which supersedes a staging in
        progress (or waiting to retry) as a new spec does.
        """
        info, state = rec.info, rec.staging_state
        if not self.active.is_set() or info.deleting:
            return
        if rec.staging_task is not None and not rec.staging_task.done():
            if rec.staging_generation == info.generation and not (
                members_changed and self._staging_outdated(rec)
            ):
                return
            rec.staging_task.cancel()  # a new spec supersedes the staging in progress
        if state.permanent and state.observed_generation == info.generation:
            return  # refused for good: retried when the spec changes
        current = self.volume.current_revision(info.namespace, info.name)
        composed = self._composed_revision(info)
        if not needs_staging(info, state.observed_generation, current, composed):
            # Staged already, perhaps by a release that published no target: the pods'
            # resolvers must still learn which of them it is for.
            self._publish_target(info)
            return
        if state.observed_generation != info.generation:
            state.attempts, state.permanent = 0, False
        rec.staging_generation = info.generation
        state.in_progress, state.bytes_so_far = True, 0
        previous = rec.staging_task
        rec.staging_task = asyncio.create_task(
            self._stage(rec, previous), name=f"stage {info.namespace}/{info.name}"
        )
        self._mark(rec.key)

    async def _stage(self, rec: AdapterRecord, previous: asyncio.Task[None] | None) -> None:
        """Stage until it succeeds or fails for good, retrying with backoff; the phase stays
        what the last attempt made it (Staging, then Degraded) through the retries."""
        if previous is not None:
            await asyncio.wait([previous])  # its publish finishes first
        state = rec.staging_state
        try:
            while True:
                state.in_progress = True
                self._mark(rec.key)
                try:
                    await self._stage_once(rec)
                    return
                except errors.StagingError as e:
                    delay = self._staging_failed(rec, e)
                    if delay is None:
                        return
                    await asyncio.sleep(delay)
        finally:
            state.in_progress = False
            self._mark(rec.key)

    async def _stage_once(self, rec: AdapterRecord) -> None:
        info, state = rec.info, rec.staging_state
        loop = asyncio.get_running_loop()

        def progress(n: int) -> None:  # runs on the fetcher's worker thread
            state.bytes_so_far = n
            loop.call_soon_threadsafe(self._mark, rec.key)

        started = time.monotonic()
        if info.compose:
            entries = composition.plan_composition(info, self._members(info))
            described = "compose:" + ",".join(
                f"{e.name}@{e.sha256[:12]}*{e.scale:g}" for e in entries
            )
            staged = await self.volume.stage_composition(
                info.namespace, info.name, entries, target=info.target
            )
        else:
            source = sources.parse_source(info.source.uri, info.source.revision)
            described = sources.describe(source)
            credentials = await self._credentials(info)
            await self._check_source(source, credentials)
            staged = await self.volume.stage(
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
        )
        self._begin_rollout(rec, serving, staged.sha256)
        self.metrics.stagings.labels("ok").inc()
        self.metrics.staging_seconds.observe(seconds)
        if not staged.reused:
            self.metrics.staged_bytes.inc(staged.size)
        log.info(
            "action=staged adapter=%s/%s source=%s sha256=%s bytes=%d reused=%s seconds=%.3f",
            *rec.key,
            described,
            staged.sha256,
            staged.size,
            staged.reused,
            seconds,
        )
        self._wake_namespace(info.namespace)
        self._collect_event.set()
        self._restage_compositions_of(info)

    def _members(self, info: AdapterInfo) -> dict[str, composition.MemberState]:
        """The members of composition `info` that exist, with the revisions they staged. From
        kopf's index, complete from the first event on: a member whose own event has not been
        handled yet is not taken for missing."""
        wanted = {m.name for m in info.compose}
        members = {}
        for member in self._indexed(info.namespace):
            if member.name in wanted:
                rec = self.adapters.get(member.key)
                staged = rec.staging_state.staged if rec is not None else member.staged
                if rec is not None and rec.rollout is not None and staged is not None:
                    # A member under a rollout takes part with what its name serves: the
                    # stable revision, until it is promoted.
                    staged = StagedRef(sha256=rec.rollout.name_revision, size=staged.size)
                members[member.name] = composition.MemberState(info=member, staged=staged)
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

    def _staging_outdated(self, rec: AdapterRecord) -> bool:
        """Whether a composition's staging in progress must start over after a member's change:
        it waits to retry a failure, or its members now make another revision."""
        current = self.volume.current_revision(rec.info.namespace, rec.info.name)
        return rec.staging_state.attempts > 0 or self._composed_revision(rec.info) != current

    def _restage_compositions_of(self, member: AdapterInfo) -> None:
        """`member` changed (its spec, its staged revision, or it is gone): the compositions
        that name it are staged again if the revision their members make changed."""
        for key in sorted(self._compositions):
            rec = self.adapters.get(key)
            if (
                rec is not None
                and key[0] == member.namespace
                and any(m.name == member.name for m in rec.info.compose)
            ):
                self._consider_staging(rec, members_changed=True)

    def _publish_target(self, info: AdapterInfo) -> None:
        try:
            if self.volume.publish_target(info.namespace, info.name, info.target):
                log.info("action=published-target adapter=%s/%s", *info.key)
        except errors.StagingError as e:
            # Pods keep the previous target (or none) until the next try: the next change.
            log.warning("action=published-target adapter=%s/%s error=%s", *info.key, e)

    def _staging_failed(self, rec: AdapterRecord, e: errors.StagingError) -> float | None:
        """Record a failure; the delay before the next attempt (None: permanent)."""
        state = rec.staging_state
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
        api = await self._api()
        try:
            secret = await api.read_secret(info.namespace, ref)
        except kube.ApiError as e:
            if e.status == 404:
                raise errors.SourceUnavailable(
                    f"Secret {ref!r} (source.secretRef) does not exist in namespace "
                    f"{info.namespace}; create it"
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

    async def _check_source(self, source: sources.Source, credentials: sources.Credentials) -> None:
        """Refuse a host outside the allowlist, or one that resolves to a link-local address
        or the API server (consent decides; this resolves the names)."""
        endpoint = consent.source_endpoint(source, credentials, self.config.hf_endpoint)
        if endpoint is None:
            return
        host, port = endpoint
        what = sources.describe(source)
        consent.check_host(host, self.config.source_rules, what)
        addresses = await _resolve(host)
        # The API server's Service address is the API server on every port; the address the
        # operator logs in to may be a shared host (a node), so there only its port.
        service = os.environ.get("KUBERNETES_SERVICE_HOST")
        api_addresses = await _resolve(service) if service else set()
        api_endpoints: set[tuple[str, int]] = set()
        if self._api_endpoint is not None:
            login_host, login_port = self._api_endpoint
            api_endpoints = {(a, login_port) for a in await _resolve(login_host)}
        reason = consent.address_refusal(host, port, addresses, api_addresses, api_endpoints)
        if reason is not None:
            raise consent.HostRefused(f"{what}: {reason}; the operator never fetches from there")

    # -- deletion (the finalizer) -------------------------------------------------------------

    async def delete(self, body: Body) -> None:
        """Unpublish first (no pod resolves the name from then on), then unload from every pod
        (gone pods are fine), collect, and let go."""
        await self.active.wait()
        self.adapter_changed(body)
        info = adapter_info(body)
        rec = self.adapters[info.key]
        if rec.staging_task is not None:
            rec.staging_task.cancel()
            await asyncio.wait([rec.staging_task])  # a publish in progress ends first
        await self.volume.unpublish(info.namespace, info.name)
        rec.unpublished = True
        self._unloading.add(info.key)
        log.info("action=unpublish adapter=%s/%s", *info.key)
        self._wake_namespace(info.namespace)
        self._check_unloaded(info.namespace)
        try:
            await asyncio.wait_for(rec.unloaded.wait(), self.config.unload_grace_s)
        except TimeoutError:
            holders = self._holders(info.namespace, info.name)
            self._post_event(
                info,
                events.Note(
                    "Warning",
                    "UnloadIncomplete",
                    f"pods still report the adapter after {self.config.unload_grace_s:.0f}s: "
                    f"{status_mod.name_list(holders)}; releasing it anyway",
                ),
            )
        log.info("action=delete adapter=%s/%s", *info.key)
        self._forget(info.key)
        self._collect_event.set()

    def _holders(self, namespace: str, name: str) -> list[str]:
        return sorted(
            p.info.name
            for p in self._pods_in(namespace)
            if p.report is not None and p.report.holds(name)
        )

    def _check_unloaded(self, namespace: str) -> None:
        waiting = [self.adapters[k] for k in self._unloading if k[0] == namespace]
        if not waiting:
            return
        held: set[str] = set()
        for p in self._pods_in(namespace):
            if p.report is not None:
                held.update(adapter for adapter, _ in p.report.revisions())
        for rec in waiting:
            if rec.info.name not in held:
                rec.unloaded.set()

    def _forget(self, key: Key) -> None:
        rec = self.adapters.pop(key, None)
        self._unloading.discard(key)
        self._compositions.discard(key)
        self._stale_placements.add(key[0])
        if rec is None:
            return
        self._restage_compositions_of(rec.info)
        _cancel(rec.staging_task)
        if rec.rollout_wake is not None:
            rec.rollout_wake.cancel()
        rec.unloaded.set()
        self._series.forget(rec.info.uid)
        self._set_phase(rec, None)
        self._dirty.discard(key)
        self._due.pop(key, None)

    # -- pods ---------------------------------------------------------------------------------

    def _start_worker(self, prec: PodRecord) -> None:
        if self.active.is_set() and prec.task is None:
            prec.task = asyncio.create_task(self._pod_loop(prec), name=f"pod {prec.info.name}")
            prec.wake.set()

    async def _pod_loop(self, prec: PodRecord) -> None:
        while True:
            timeout = prec.retry_in if prec.retry_in is not None else self.config.resync_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(prec.wake.wait(), timeout)
                await asyncio.sleep(COALESCE_S)  # a pass reads and plans every adapter
            prec.wake.clear()
            try:
                await self._reconcile_pod(prec)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the pod's reconciliation for good
                log.exception("reconciling pod %s/%s failed", *prec.info.key)
                prec.retry_in = self.config.max_backoff_s

    async def _reconcile_pod(self, prec: PodRecord) -> None:
        pod = prec.info
        started = time.monotonic()
        if not pod.reachable:
            prec.retry_in = None
            if prec.report is not None or not prec.heard:
                prec.report, prec.heard = None, True  # not targeted while it is not Ready
                self._drop_entries(prec)
            return
        reading = await self._read(prec)
        if reading is None:
            return
        actions = planning.plan_pod(reading.wants, reading.report, reading.keep)
        verify_at = time.monotonic() + self.config.verify_every_s
        acted = False
        for action in actions:
            if prec.info.uid != pod.uid or not prec.info.reachable or not self.active.is_set():
                break  # the pod changed under us: the next pass starts over
            acted |= await self._act(pod, action)
            if acted and time.monotonic() >= verify_at:
                if await self._read(prec) is None:
                    return
                acted, verify_at = False, time.monotonic() + self.config.verify_every_s
        # What the pod now holds is read before the pass ends; when the next pass is already
        # due (adapters arrived meanwhile), its first read is that evidence: one read a pass,
        # not two, while a thousand adapters arrive one by one.
        if acted and not prec.wake.is_set() and await self._read(prec) is None:
            return
        delays = [
            d
            for name in prec.entries
            if (found := self._served(pod.namespace, name)) is not None
            and (entry := found[1].get(pod.name)) is not None
            and (d := podstate.retry_delay(entry, self.config.max_backoff_s)) is not None
        ]
        prec.retry_in = min(delays, default=None)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    async def _read(self, prec: PodRecord) -> Reading | None:
        """Read the pod's /v1/models and record it; None (and a backoff) when it fails."""
        try:
            async with self._calls:
                report = await self.pod_client.models(prec.info)
        except PodError as e:
            prec.failures += 1
            prec.retry_in = backoff.delay(prec.failures, cap=self.config.max_backoff_s)
            if prec.failures >= UNHEARD_FAILURES and not prec.heard:
                prec.heard = True
                self._mark_namespace(prec.info.namespace)
            log.info(
                "action=read-models pod=%s/%s result=error message=%r", *prec.info.key, e.message
            )
            return None
        prec.failures = 0
        return Reading(report, *self._record(prec, report))

    def _wants_for(
        self, pod: PodInfo, base_model: str | None
    ) -> tuple[dict[str, planning.Want], set[str]]:
        """What the pod should hold, and what it may keep as it is (adapters whose revision is
        not known yet, and deleted ones not unpublished yet)."""
        candidates = [
            planning.Candidate(info, info.staged)
            if (rec := self.adapters.get(info.key)) is None
            else planning.Candidate(
                rec.info, rec.staging_state.staged, rec.rollout, rec.unpublished
            )
            for info in self._indexed(pod.namespace)
        ]
        # Placement is read only where an adapter asks for it (it reads the whole namespace).
        chosen = self._placement(pod.namespace) if any(c.info.placed for c in candidates) else None
        placed = chosen.adapters if chosen is not None else None
        return planning.plan_wants(pod, base_model, candidates, placed)

    def _served(self, namespace: str, served: str) -> Entries | None:
        """The record and entries behind a name a pod serves: an adapter's own name, or the
        alias of its rollout's canary."""
        rec = self.adapters.get((namespace, served))
        if rec is not None:
            return rec, rec.pods
        name = served.rpartition(rollout.ALIAS_SEPARATOR)[0]
        rec = self.adapters.get((namespace, name))
        if rec is None or rec.rollout is None or rollout.alias(name, rec.rollout.canary) != served:
            return None
        return rec, rec.canary_pods

    def _record(
        self, prec: PodRecord, report: planning.PodReport
    ) -> tuple[dict[str, planning.Want], set[str]]:
        """Take in what the pod reported: every wanted adapter's entry on this pod. Returns
        what the pod should hold and may keep (`_wants_for`), which a pass plans with."""
        pod = prec.info
        before, prec.report = prec.report, report
        if before is None or placement.inputs(before) != placement.inputs(report):
            self._stale_placements.add(pod.namespace)
        if not prec.heard:
            prec.heard = True
            self._mark_namespace(pod.namespace)
        wants, keep = self._wants_for(pod, report.base_model)
        entries: dict[str, Recorded] = {}
        for name, want in wants.items():
            found = self._served(pod.namespace, name)
            if found is None:
                continue
            card = report.cards.get(name)
            last = prec.entries.get(name)
            # A pod reads the same for most adapters from one report to the next, and the
            # same Reported event on the entry it gave changes nothing (podstate), so only
            # what changed is applied: a pass costs little per adapter at a thousand.
            if last is None or last != (want, card, found[1].get(pod.name)):
                last = Recorded(want, card, self._apply(found, pod, podstate.Reported(want, card)))
            entries[name] = last
        for name in prec.entries.keys() - wants.keys():
            found = self._served(pod.namespace, name)
            if found is not None and found[1].pop(pod.name, None) is not None:
                self._mark(found[0].key)
        prec.entries = entries
        if before is None or before.managed() != report.managed():
            self._collect_event.set()
            self._check_unloaded(pod.namespace)
        return wants, keep

    def _apply(self, found: Entries, pod: PodInfo, event: podstate.Event) -> PodEntry:
        """One event of the adapter's entry on `pod` (podstate.transition decides)."""
        rec, entries = found
        entry = entries.get(pod.name, PodEntry())
        new = podstate.transition(entry, event, retry_bound=self.config.retry_bound)
        if new.state == "Loaded" and new.loaded_at is None:
            revision, at, seconds = rec.recorded_loads.get(pod.name, (None, None, None))
            if revision == new.revision:  # loaded by an earlier process: keep its record
                new = dataclasses.replace(new, loaded_at=at, load_seconds=seconds)
        if new == entry:
            return entry
        entries[pod.name] = new
        self._mark(rec.key)
        return new

    def _drop_entries(self, prec: PodRecord) -> None:
        self._stale_placements.add(prec.info.namespace)
        for name in prec.entries:
            found = self._served(prec.info.namespace, name)
            if found is not None and found[1].pop(prec.info.name, None) is not None:
                self._mark(found[0].key)
        prec.entries = {}
        self._mark_namespace(prec.info.namespace)
        self._check_unloaded(prec.info.namespace)

    async def _act(self, pod: PodInfo, action: planning.Action) -> bool:
        """Carry out one planned call; True when the pod may have changed."""
        if isinstance(action, planning.Unload):
            return await self._unload(pod, action.name)
        found = self._served(pod.namespace, action.name)
        if found is None:
            return False
        if isinstance(action, planning.Conflict):
            self._apply(
                found,
                pod,
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
        self._apply(found, pod, podstate.Started(want))
        started = time.monotonic()
        try:
            async with self._calls:
                await self.pod_client.load(pod, want, inplace=action.inplace)
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
            self._apply(found, pod, podstate.Failed(want, e.message, e.permanent))
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
        self._apply(found, pod, podstate.Succeeded(want, seconds, kube.now_iso()))
        return True

    async def _unload(self, pod: PodInfo, name: str) -> bool:
        try:
            async with self._calls:
                await self.pod_client.unload(pod, name)
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
        return True

    # -- status -------------------------------------------------------------------------------

    def _mark(self, key: Key) -> None:
        self._dirty.add(key)
        self._writer_wake.set()

    def _mark_namespace(self, namespace: str) -> None:
        for rec in self._adapters_in(namespace):
            self._mark(rec.key)

    def targeted(self, rec: AdapterRecord) -> list[tuple[PodInfo, PodEntry]]:
        """The Ready pods that reported their base model and that this adapter belongs on
        (with spec.replicas or spec.autoscale: the ones it is placed on)."""
        placed = self._placed(rec)
        return [
            (p.info, rec.pods.get(p.info.name, PodEntry()))
            for p in self._pods_in(rec.info.namespace)
            if p.report is not None
            and p.info.reachable
            and rec.info.targets(p.info, p.report.base_model)
            and (placed is None or p.info.name in placed.pods)
        ]

    def _placed(self, rec: AdapterRecord) -> placement.Placed | None:
        """The adapter's placement; None when it goes on every matching pod."""
        if not rec.info.placed:
            return None
        chosen = self._placement(rec.info.namespace)
        found = chosen.adapters.get(rec.info.name) if chosen is not None else None
        return found or placement.Placed(pods=(), wanted=self._replicas(rec.info, rec))

    # -- placement ----------------------------------------------------------------------------

    def _placement(self, namespace: str) -> placement.Placement | None:
        """Where the namespace's adapters with spec.replicas or spec.autoscale go, recomputed
        when an input changed (a pod came, went, became Ready or not, reported other capacity
        or another base model; an adapter came, went or changed its placement fields). None
        until every Ready pod has reported since this replica began to act: a placement made
        from some pods' reports would move adapters for nothing. A change wakes the namespace's
        pods and marks the adapters it moved. Changes in a burst are placed together, at most
        every PLACEMENT_COALESCE_S (the placement reads every adapter and pod of the namespace)."""
        current = self._placements.get(namespace)
        if namespace not in self._stale_placements and current is not None:
            return current
        if not self._heard(namespace):
            return current
        wait = self._placed_at.get(namespace, -PLACEMENT_COALESCE_S) + PLACEMENT_COALESCE_S
        wait -= time.monotonic()
        if current is not None and wait > 0:
            if namespace not in self._placement_due:
                self._placement_due.add(namespace)
                asyncio.get_running_loop().call_later(wait, self._place_later, namespace)
            return current
        self._stale_placements.discard(namespace)
        self._placed_at[namespace] = time.monotonic()
        reports = {
            p.info.name: (p.info, p.report)
            for p in self._pods_in(namespace)
            if p.report is not None and p.info.reachable
        }
        infos = [
            rec.info if (rec := self.adapters.get(i.key)) is not None else i
            for i in self._indexed(namespace)
        ]
        capacities, demands = placement.plan_demands(
            infos, reports, lambda info: self._replicas(info, self.adapters.get(info.key))
        )
        new = placement.plan_placement(capacities, demands)
        self._placements[namespace] = new
        moved = [
            name
            for name, placed in new.adapters.items()
            if current is None or current.adapters.get(name) != placed
        ]
        if moved:
            for name in moved:
                if (namespace, name) in self.adapters:
                    self._mark((namespace, name))
            self._wake_namespace(namespace)
        return new

    def _place_later(self, namespace: str) -> None:
        """The end of a coalescing wait: place now if something changed meanwhile (what moved
        is marked and its pods woken)."""
        self._placement_due.discard(namespace)
        if namespace in self._stale_placements:
            self._placement(namespace)

    def _replicas(self, info: AdapterInfo, rec: AdapterRecord | None) -> int:
        """How many pods an adapter with spec.replicas or spec.autoscale should be on."""
        return autoscale.replicas(info, rec.scale if rec is not None else None)

    # -- autoscaling --------------------------------------------------------------------------

    async def _autoscaler(self) -> None:
        """Every `autoscale_interval_s`: measure each autoscaled adapter's request rate from the
        pods' hit counters, choose its replicas (autoscale.plan_scale), and have the pods read
        again, so the next measurement has fresh counters."""
        while True:
            await asyncio.sleep(self.config.autoscale_interval_s)
            if not self.active.is_set():
                continue
            now = time.time()
            namespaces = set()
            for rec in list(self.adapters.values()):
                if rec.info.autoscale is not None and not rec.info.deleting:
                    self._autoscale(rec, rec.info.autoscale, now)
                    namespaces.add(rec.info.namespace)
            for namespace in namespaces:
                self._wake_namespace(namespace)

    def _autoscale(self, rec: AdapterRecord, spec: AutoscaleSpec, now: float) -> None:
        # One counter per pod and served name: a rollout's canary alias counts with the name.
        counts = autoscale.hit_counts(
            rec.info.name,
            (
                (p.info.name, p.report)
                for p in self._pods_in(rec.info.namespace)
                if p.report is not None
            ),
        )
        previous, rec.hits_seen = rec.hits_seen, (counts, now)
        if previous is None:
            return  # a first reading: counters hold history, not a rate
        rate = autoscale.request_rate(previous[0], counts, now - previous[1])
        policy = autoscale.policy_of(spec)
        current = rec.scale or autoscale.start(policy)
        rec.scale = autoscale.plan_scale(current, rate, now, policy)
        if rec.scale.replicas == current.replicas:
            return
        log.info(
            "action=autoscale adapter=%s/%s rate=%.3f replicas=%d->%d",
            *rec.key,
            rate,
            current.replicas,
            rec.scale.replicas,
        )
        self._post_event(
            rec.info,
            events.Note(
                "Normal",
                "Scaled",
                f"{rate:.2f} requests/s: replicas {current.replicas} -> {rec.scale.replicas}",
            ),
        )
        self._stale_placements.add(rec.info.namespace)
        self._mark(rec.key)
        self._wake_namespace(rec.info.namespace)

    def _heard(self, namespace: str) -> bool:
        """Whether every Ready pod of the namespace has reported since this replica began to
        act: until then a status could claim fewer pods than an earlier process had seen."""
        for pod in self._indexed_pods(namespace):
            prec = self.pods.get(pod.key)
            if pod.reachable and (prec is None or not prec.heard):
                return False
        return True

    async def _writer(self) -> None:
        """Write the status of changed adapters: coalesced, paced by status.write_delay, and
        each announced by at most one Event (events.plan_event)."""
        while True:
            now = time.monotonic()
            timeout = max(0.0, min(self._due.values()) - now) if self._due else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._writer_wake.wait(), timeout)
            self._writer_wake.clear()
            await asyncio.sleep(COALESCE_S)
            if not self.active.is_set():
                continue
            now = time.monotonic()
            keys = self._dirty | {k for k, t in self._due.items() if t <= now}
            self._dirty = set()
            heard: dict[str, bool] = {}
            writes = []
            for key in keys:
                due = self._due.pop(key, None)
                rec = self.adapters.get(key)
                if rec is None or rec.info.deleting:
                    continue  # a deleted adapter's status is no news to anyone
                ns = key[0]
                if not heard.setdefault(ns, self._heard(ns)):
                    self._due[key] = now + 0.5
                    continue
                targeted = self.targeted(rec)
                placed = self._placed(rec)
                self._advance_rollout(rec, targeted)
                summary = status_mod.summarise(
                    rec.info,
                    rec.staging_state,
                    targeted,
                    retry_bound=self.config.retry_bound,
                    placed=placed,
                    serving=rec.rollout.name_revision if rec.rollout is not None else None,
                )
                self._set_phase(rec, summary.phase)
                rollout_body = self._rollout_status(rec, targeted)
                # The routers read the weights from the status: a change there is written at once.
                reroutes = rollout.routing_changed((rec.written or {}).get("rollout"), rollout_body)
                if rec.headline != summary.headline:
                    rec.headline, rec.headline_since = summary.headline, now
                elif due is not None and due > now and not reroutes:
                    # A write is planned for this phase and reason already: it will take what
                    # is new then (rendering every change of a Loading adapter costs CPU).
                    self._due[key] = due
                    continue
                body = status_mod.render(
                    rec.info,
                    rec.staging_state,
                    targeted,
                    summary,
                    (rec.written or {}).get("conditions") or [],
                    kube.now_iso(),
                    placed,
                )
                body["rollout"] = rollout_body
                delay = status_mod.write_delay(
                    rec.written,
                    rec.written_headline,
                    body,
                    summary,
                    since_headline=now - rec.headline_since,
                    since_write=now - rec.written_at,
                    policy=self.policy,
                )
                if reroutes:
                    delay = 0.0
                if delay is None:
                    continue
                if delay > 0:
                    self._due[key] = now + delay
                    continue
                writes.append(self._write(rec, body, summary))
            await asyncio.gather(*writes)

    async def _write(
        self, rec: AdapterRecord, body: dict[str, Any], summary: status_mod.Summary
    ) -> None:
        async with self._write_slots:
            api = await self._api()
            try:
                await api.patch_adapter_status(rec.info.namespace, rec.info.name, body)
            except kube.ApiError as e:
                if e.status == 404:
                    return  # deleted meanwhile
                self._retry_write(rec.key, e)
                return
            except Exception as e:  # the next change or the retry writes it; never stop
                self._retry_write(rec.key, e)
                return
        note = events.plan_event(rec.written_headline, summary)
        rec.written, rec.written_headline = body, summary.headline
        rec.written_at = time.monotonic()
        if note is not None:
            log.info(
                "action=phase adapter=%s/%s phase=%s reason=%s ready=%s message=%r",
                *rec.key,
                summary.phase,
                summary.reason,
                body["ready"],
                summary.message,
            )
            self._post_event(rec.info, note)

    def _retry_write(self, key: Key, e: Exception) -> None:
        log.warning("writing the status of %s/%s failed: %s", *key, e)
        self._due[key] = time.monotonic() + 1.0
        self._writer_wake.set()

    def _set_phase(self, rec: AdapterRecord, phase: str | None) -> None:
        if rec.phase == phase:
            return
        if rec.phase is not None:
            self._phases[rec.phase] -= 1
        if phase is not None:
            self._phases[phase] += 1
        rec.phase = phase
        self.metrics.set_phases(dict(self._phases))

    # -- rollouts (spec.rollout) ---------------------------------------------------------------

    def _begin_rollout(self, rec: AdapterRecord, serving: str | None, staged: str) -> None:
        """`staged` became the adapter's newest revision: roll it out, or not (rollout.begin)."""
        before = rec.rollout
        rec.rollout = rollout.begin(before, serving, staged, rec.info.rollout)
        if rec.rollout is None or before is None or before.canary != rec.rollout.canary:
            rec.canary_pods = {}
        if rec.rollout != before:
            self._rollout_changed(rec, before)

    def _advance_rollout(self, rec: AdapterRecord, targeted: status_mod.Targeted) -> None:
        """Move the rollout on (rollout.advance), take a command from the annotation, and set
        a timer for the end of the step's pause."""
        info = rec.info
        if info.command is not None and not rec.taking_command:
            rec.taking_command = True
            self._spawn(self._take_command(rec, info.command), f"rollout {info.name}")
        self._step_rollout(rec, targeted, None)

    def _step_rollout(
        self, rec: AdapterRecord, targeted: status_mod.Targeted, command: str | None
    ) -> str | None:
        """Move the rollout on (rollout.advance decides); the command it acted on, if any."""
        r = rec.rollout
        if r is None:
            return None
        canary_ready, promoted = canary.readiness(r, targeted, rec.canary_pods)
        progress = rollout.advance(
            r,
            rec.info.rollout,
            time.time(),
            canary_ready=canary_ready,
            promoted_everywhere=promoted,
            command=command,
        )
        if rec.rollout_wake is not None:
            rec.rollout_wake.cancel()
            rec.rollout_wake = None
        if progress.wake_at is not None:
            rec.rollout_wake = asyncio.get_running_loop().call_later(
                max(0.0, progress.wake_at - time.time()) + 0.05, self._mark, rec.key
            )
        if progress.rollout != r:
            rec.rollout = progress.rollout
            if progress.rollout is None:
                rec.canary_pods = {}
            self._rollout_changed(rec, r)
        return progress.acted

    def _rollout_changed(self, rec: AdapterRecord, before: rollout.Rollout | None) -> None:
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
            self._wake_namespace(rec.info.namespace)
            self._collect_event.set()
            self._restage_compositions_of(rec.info)  # they follow what the name serves
        self._mark(rec.key)

    async def _take_command(self, rec: AdapterRecord, command: Command) -> None:
        """Remove the annotation from the version it was read on, then act on it: a command
        is acted on once, and one lost to a crash in between is given again by the user."""
        info = rec.info
        try:
            api = await self._api()
            await api.remove_annotation(
                info.namespace, info.name, rollout.COMMAND_ANNOTATION, command.resource_version
            )
        except Exception as e:
            rec.taking_command = False
            if isinstance(e, kube.ApiError) and e.status in (404, 409):
                # Deleted, or a newer version of the object is on its way here: that one
                # says whether there is a command.
                rec.info = dataclasses.replace(rec.info, command=None)
                return
            log.warning("action=rollout-command adapter=%s/%s error=%r", *info.key, e)
            self._due[rec.key] = time.monotonic() + 1.0  # the status pass then tries again
            self._writer_wake.set()
            return
        rec.taking_command = False
        if rec.info.command == command:
            rec.info = dataclasses.replace(rec.info, command=None)
        action = command.action
        r = rec.rollout
        acted = self._step_rollout(rec, self.targeted(rec), action)
        log.info(
            "action=rollout-command adapter=%s/%s command=%s result=%s",
            *info.key,
            action,
            "ok" if acted else "ignored",
        )
        if acted is None:
            message = rollout.ignored(action, r)
            self._post_event(info, events.Note("Warning", "RolloutCommandIgnored", message))
            return
        reason, message = rollout.acted(action, r, rec.rollout)
        self._post_event(info, events.Note("Normal", reason, message))

    def _rollout_status(
        self, rec: AdapterRecord, targeted: status_mod.Targeted
    ) -> dict[str, Any] | None:
        return canary.render_status(rec.rollout, rec.info, targeted, rec.canary_pods)

    # -- Events -------------------------------------------------------------------------------

    def _post_event(self, info: AdapterInfo, note: events.Note) -> None:
        """Post in the background: a pod's loads never wait for the API server. A repeat of a
        recent Event counts into its series."""
        name, count = self._series.record(
            (info.uid, note.type, note.reason, note.note),
            time.monotonic(),
            f"{info.name}.{uuid.uuid4().hex[:16]}",
        )
        self._spawn(self._send_event(object_ref(info), name, count, note))

    async def _send_event(
        self, regarding: dict[str, str], name: str, count: int, note: events.Note
    ) -> None:
        async with self._event_slots:
            api = await self._api()
            try:
                if count == 1:
                    await api.create_event(regarding, name, note.type, note.reason, note.note)
                else:
                    await api.count_event(regarding["namespace"], name, count)
            except Exception as e:  # an Event is never worth a retry storm
                log.warning("could not post event %s on %s: %s", note.reason, regarding["name"], e)

    # -- garbage collection -------------------------------------------------------------------

    async def _collector(self) -> None:
        while True:
            await self._collect_event.wait()
            await asyncio.sleep(1.0)
            self._collect_event.clear()
            if not self.active.is_set():
                continue
            if not self._all_reported():
                self._spawn(self._retry_collect())  # a pod not heard from may use any revision
                continue
            in_use = gc.revisions_in_use(
                (
                    (p.info.namespace, p.report.revisions())
                    for p in self.pods.values()
                    if p.report is not None
                ),
                (
                    (*rec.key, rec.rollout.stable)
                    for rec in self.adapters.values()
                    if rec.rollout is not None
                ),
            )
            plan, freed = await self.volume.collect(in_use)
            if plan:
                self.metrics.collected_bytes.inc(freed)
                log.info(
                    "action=collect revisions=%s objects=%d freed_bytes=%d",
                    ",".join(f"{r.namespace}/{r.name}@{r.sha256[:12]}" for r in plan.revisions),
                    len(plan.objects),
                    freed,
                )

    async def _retry_collect(self) -> None:
        await asyncio.sleep(2.0)
        self._collect_event.set()

    # -- helpers ------------------------------------------------------------------------------

    def _indexed(self, namespace: str) -> Iterable[AdapterInfo]:
        """The namespace's adapters as kopf's index has them: complete from the first event on,
        even while their own events are still being delivered."""
        if self._adapters_index is None:
            return [r.info for r in self._adapters_in(namespace)]
        return list(self._adapters_index.get(namespace, ()))

    def _indexed_pods(self, namespace: str) -> Iterable[PodInfo]:
        if self._pods_index is None:
            return [p.info for p in self._pods_in(namespace)]
        return list(self._pods_index.get(namespace, ()))

    def _all_reported(self) -> bool:
        """Whether every Ready pod has a report (kopf's index lists every pod there is)."""
        namespaces = set(self._pods_index or ()) | {k[0] for k in self.pods}
        return all(
            (prec := self.pods.get(pod.key)) is not None and prec.report is not None
            for ns in namespaces
            for pod in self._indexed_pods(ns)
            if pod.reachable
        )

    def _adapters_in(self, namespace: str) -> list[AdapterRecord]:
        return [r for k, r in self.adapters.items() if k[0] == namespace]

    def _pods_in(self, namespace: str) -> list[PodRecord]:
        return [p for k, p in self.pods.items() if k[0] == namespace]

    def _wake_namespace(self, namespace: str) -> None:
        for prec in self._pods_in(namespace):
            prec.wake.set()

    def _api_now(self) -> Api:
        assert self.api is not None, "used only after login"
        return self.api

    async def _api(self) -> Api:
        await self._logged_in.wait()
        return self._api_now()

    async def _after_login(self, coro: Coroutine[Any, Any, None]) -> None:
        await self._logged_in.wait()
        await coro

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _resolve(host: str) -> set[str]:
    """The addresses `host` resolves to; none when it does not resolve (the fetch then fails
    with its own message)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return set()
    return {str(i[4][0]) for i in infos}


def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()


def _seed(info: AdapterInfo, body: Body) -> AdapterRecord:
    """A record for an adapter first seen: what its status says an earlier process (or another
    replica) staged and wrote, so nothing is staged twice and no status goes backwards."""
    resumed = resume.plan_resume(info, body.get("status"))
    return AdapterRecord(
        info=info,
        rollout=resumed.rollout,
        scale=resumed.scale,
        staging_state=resumed.staging,
        written=resumed.written,
        written_headline=resumed.written_headline,
        recorded_loads=resumed.recorded_loads,
    )
