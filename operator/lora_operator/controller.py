"""The controller: stages adapters, keeps every inference pod's adapters equal to what it should
hold, and writes each LoRAAdapter's status. kopf's handlers (handlers.py) feed it events; the
decisions are pure functions (planning.py, status.py); this module does the I/O and the waiting.

One worker per inference pod reconciles that pod, so calls to a pod never race; a semaphore
bounds the calls in flight across pods. A worker runs when something it depends on changes (the
pod: new, Ready, restarted, relabelled; an adapter of its namespace: staged, respecified,
deleted), after a failure's backoff, and every `resync_s` otherwise. It reads the pod's
`/v1/models`, plans, acts, and reads `/v1/models` again: what the pod reports is the only
evidence a pod serves an adapter, and nothing is kept that a restart would need.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import kopf

from lora_operator import errors, gc, planning, sources, staging
from lora_operator import status as status_mod
from lora_operator.config import OperatorConfig
from lora_operator.kube import ApiError, KubeApi
from lora_operator.metrics import Metrics
from lora_operator.model import AdapterInfo, PodInfo, StagedRef, adapter_info, object_ref
from lora_operator.podclient import PodClient, PodError

log = logging.getLogger("lora_operator")

Key = tuple[str, str]  # (namespace, name)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def backoff(attempt: int, cap: float) -> float:
    """1 s, 2 s, 4 s ... capped: retries never storm, and never stop."""
    return float(min(cap, 2 ** max(0, attempt - 1)))


def needs_staging(
    info: AdapterInfo, observed_generation: int | None, volume_current: str | None
) -> bool:
    """Whether the spec's source must be staged (again), or the volume already holds it (pure)."""
    return not (
        info.staged is not None
        and observed_generation == info.generation
        and volume_current == info.staged.sha256
    )


@dataclass
class PodWorker:
    info: PodInfo
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    retry_in: float | None = None  # a backoff after a failure, instead of the resync interval
    failures: int = 0  # consecutive failures to read the pod's /v1/models


@dataclass
class PodView:
    """The last thing a pod reported, with the pod it came from."""

    pod: PodInfo
    report: planning.PodReport


class Controller:
    def __init__(self, config: OperatorConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.store = staging.Store(
            config.volume_root,
            max_bytes=config.max_adapter_bytes,
            max_concurrent=config.max_concurrent_stagings,
            hf_endpoint=config.hf_endpoint,
        )
        self.pods_client = PodClient(
            admin_token=config.admin_token, timeout_s=config.load_timeout_s
        )
        self.kube: KubeApi | None = None
        self._logged_in = asyncio.Event()
        self._pods_index: kopf.Index[str, PodInfo] | None = None
        self._adapters_index: kopf.Index[str, AdapterInfo] | None = None
        self._calls = asyncio.Semaphore(config.max_concurrent_loads)
        # API writes in flight at once: status patches and Events (kube-apiserver's default
        # client-side budget is small; a burst of hundreds must queue here, not time out).
        self._status_slots = asyncio.Semaphore(8)
        self._event_slots = asyncio.Semaphore(8)
        self._status_locks: dict[Key, asyncio.Lock] = {}
        self.workers: dict[Key, PodWorker] = {}
        self.views: dict[Key, PodView] = {}
        self.staging: dict[Key, status_mod.StagingState] = {}
        self.entries: dict[Key, dict[str, status_mod.PodEntry]] = {}
        self._fingerprints: dict[Key, tuple[Any, ...]] = {}
        self._conditions: dict[Key, list[dict[str, Any]]] = {}
        self._written: dict[Key, dict[str, Any]] = {}
        self._phases: dict[Key, str] = {}
        self._dirty: set[Key] = set()
        self._dirty_event = asyncio.Event()
        self._collect_event = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self._on_stop: list[Callable[[], Awaitable[None]]] = []

    # -- lifecycle ----------------------------------------------------------------------------

    def use_credentials(self, info: kopf.ConnectionInfo) -> None:
        old, self.kube = self.kube, KubeApi(info)
        if old is not None:
            self._background.append(asyncio.create_task(old.close()))
        self._logged_in.set()

    def start(
        self, pods_index: kopf.Index[str, PodInfo], adapters_index: kopf.Index[str, AdapterInfo]
    ) -> None:
        self._pods_index, self._adapters_index = pods_index, adapters_index
        removed = staging.clean_tmp(self.config.volume_root)
        if removed:
            log.info("action=clean-tmp removed=%d (stagings a previous run left)", removed)
        self._background += [
            asyncio.create_task(self._status_writer(), name="status-writer"),
            asyncio.create_task(self._collector(), name="collector"),
        ]

    def on_stop(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._on_stop.append(callback)

    async def stop(self) -> None:
        for callback in self._on_stop:
            await callback()
        tasks = [w.task for w in self.workers.values() if w.task] + self._background
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pods_client.close()
        if self.kube is not None:
            await self.kube.close()

    # -- what kopf tells us -------------------------------------------------------------------

    def adapter_changed(self, body: kopf.Body | dict[str, Any], deleted: bool = False) -> None:
        info = adapter_info(body)
        key = info.key
        if deleted:
            self._forget_adapter(key)
            return
        if key not in self.staging:
            self._seed(key, info, body)
        fingerprint = (
            info.deleting,
            info.staged,
            info.scale,
            info.pinned,
            info.selector,
            info.base_model,
        )
        if self._fingerprints.get(key) != fingerprint:
            self._fingerprints[key] = fingerprint
            self._wake_namespace(info.namespace)
            self._mark(key)

    def _seed(self, key: Key, info: AdapterInfo, body: Any) -> None:
        """After a restart: what the status says was staged (staging checks the volume)."""
        st = dict(body.get("status") or {})
        staged = st.get("staged") or {}
        state = self.staging[key] = status_mod.StagingState(
            staged=info.staged,
            path=staged.get("path"),
            staged_at=staged.get("stagedAt"),
            observed_generation=st.get("observedGeneration"),
        )
        conditions = list(st.get("conditions") or [])
        self._conditions[key] = conditions
        # observedGeneration moves only on success or a permanent failure: a Staged=False
        # condition of this generation is a permanent failure, not to be retried on resume.
        failed = next((c for c in conditions if c.get("type") == "Staged"), None)
        if (
            failed is not None
            and failed.get("status") == "False"
            and state.observed_generation == info.generation
        ):
            state.permanent = True
            state.error_reason, state.error_message = failed.get("reason"), failed.get("message")

    def pod_changed(self, info: PodInfo, deleted: bool = False) -> None:
        key = info.key
        worker = self.workers.get(key)
        if deleted:
            if worker is not None and worker.task is not None:
                worker.task.cancel()
            self.workers.pop(key, None)
            self.views.pop(key, None)
            self._drop_pod_entries(info)
            return
        if worker is None:
            worker = self.workers[key] = PodWorker(info=info)
            worker.task = asyncio.create_task(self._pod_loop(worker), name=f"pod {info.name}")
            worker.wake.set()
            return
        before, worker.info = worker.info, info
        if before != info:  # new IP, readiness, restart, labels, annotations...
            if before.uid != info.uid or before.restarts != info.restarts:
                self.views.pop(key, None)  # a new process: what it held is gone
            worker.wake.set()

    # -- staging (called by the create/update/resume handlers) ---------------------------------

    async def ensure_staged(self, body: kopf.Body | dict[str, Any]) -> None:
        """Stage the spec's source unless the volume holds it; raise kopf's retry errors."""
        info = adapter_info(body)
        key = info.key
        self.adapter_changed(body)
        state = self.staging[key]
        current = staging.current_revision(self.config.volume_root, info.namespace, info.name)
        if not needs_staging(info, state.observed_generation, current):
            return
        spec = body["spec"]
        source_spec = spec["source"]
        state.in_progress, state.bytes_so_far = True, 0
        state.permanent = False
        self._mark(key)
        loop = asyncio.get_running_loop()

        def progress(n: int) -> None:  # may run on a worker thread (s3, volume copies)
            state.bytes_so_far = n
            loop.call_soon_threadsafe(self._mark, key)

        started = time.monotonic()
        try:
            source = sources.parse_source(source_spec["uri"], source_spec.get("revision"))
            self._event(info, "Normal", "Staging", f"staging {sources.describe(source)}")
            credentials = await self._credentials(info, source_spec)
            staged = await self.store.stage(
                info.namespace,
                info.name,
                source,
                credentials=credentials,
                sha256=source_spec.get("sha256"),
                progress=progress,
            )
        except errors.StagingError as e:
            raise await self._staging_failed(info, state, e) from e
        seconds = time.monotonic() - started
        state.in_progress = False
        state.attempts, state.degraded, state.permanent = 0, False, False
        state.error_reason = state.error_message = None
        state.staged = StagedRef(sha256=staged.sha256, size=staged.size)
        state.path, state.staged_at = str(staged.path), now_iso()
        state.observed_generation = info.generation
        self.metrics.stagings.labels("ok").inc()
        self.metrics.staging_seconds.observe(seconds)
        if not staged.reused:
            self.metrics.staged_bytes.inc(staged.size)
        log.info(
            "action=staged adapter=%s/%s sha256=%s bytes=%d reused=%s seconds=%.3f",
            info.namespace,
            info.name,
            staged.sha256,
            staged.size,
            staged.reused,
            seconds,
        )
        self._event(
            info,
            "Normal",
            "Staged",
            f"staged sha256 {staged.sha256} ({staged.size} bytes) in {seconds:.1f}s",
        )
        await self._write_status(key)  # pods act on status.staged, through the adapters index
        self._collect_event.set()

    async def _credentials(
        self, info: AdapterInfo, source_spec: dict[str, Any]
    ) -> sources.Credentials:
        ref = (source_spec.get("secretRef") or {}).get("name")
        if not ref:
            return sources.Credentials()
        await self._logged_in.wait()
        assert self.kube is not None
        try:
            data = await self.kube.read_secret(info.namespace, ref)
        except ApiError as e:
            if e.status == 404:
                raise errors.SourceUnavailable(
                    f"Secret {ref!r} (source.secretRef) does not exist in namespace "
                    f"{info.namespace}; create it"
                ) from e
            raise errors.SourceUnavailable(f"cannot read Secret {ref!r}: {e}") from e
        return sources.credentials_from_secret(data)

    async def _staging_failed(
        self, info: AdapterInfo, state: status_mod.StagingState, e: errors.StagingError
    ) -> kopf.PermanentError | kopf.TemporaryError:
        """Record and announce the failure; the kopf error that retries it (or not)."""
        state.in_progress = False
        state.error_reason, state.error_message = e.reason, e.message
        log.warning(
            "action=stage adapter=%s/%s result=%s reason=%s message=%r",
            info.namespace,
            info.name,
            "permanent" if e.permanent else "transient",
            e.reason,
            e.message,
        )
        if e.permanent:
            state.permanent = True
            state.observed_generation = info.generation
            self.metrics.stagings.labels("permanent").inc()
            self._event(info, "Warning", e.reason, e.message)
            await self._write_status(info.key)
            return kopf.PermanentError(e.message)
        state.attempts += 1
        state.degraded = state.attempts >= self.config.retry_bound
        delay = backoff(state.attempts, self.config.max_backoff_s)
        self.metrics.stagings.labels("transient").inc()
        self._event(info, "Warning", e.reason, f"{e.message} (retrying in {delay:.0f}s)")
        await self._write_status(info.key)
        return kopf.TemporaryError(e.message, delay=delay)

    # -- deletion (the finalizer) -------------------------------------------------------------

    async def delete(self, body: kopf.Body | dict[str, Any]) -> None:
        """Unload from every pod (gone pods are fine), unpublish, collect, then let go."""
        info = adapter_info(body)
        self.adapter_changed(body)  # deleting: the pods' workers unload it
        deadline = time.monotonic() + self.config.unload_grace_s
        while holders := self._holders(info):
            if time.monotonic() > deadline:
                self._event(
                    info,
                    "Warning",
                    "UnloadIncomplete",
                    f"pods still report the adapter after {self.config.unload_grace_s:.0f}s: "
                    f"{', '.join(holders)}; releasing it anyway",
                )
                break
            await asyncio.sleep(0.2)
        await self.store.unpublish(info.namespace, info.name)
        log.info("action=delete adapter=%s/%s", info.namespace, info.name)
        self._event(info, "Normal", "Deleted", "unloaded from every pod and unpublished")
        self._forget_adapter(info.key)
        self._collect_event.set()

    def _holders(self, info: AdapterInfo) -> list[str]:
        return sorted(
            v.pod.name
            for k, v in self.views.items()
            if k[0] == info.namespace and info.name in v.report.managed() and k in self.workers
        )

    def _forget_adapter(self, key: Key) -> None:
        tables: tuple[dict[Key, Any], ...] = (
            self._status_locks,
            self.staging,
            self.entries,
            self._fingerprints,
            self._conditions,
            self._written,
            self._phases,
        )
        for table in tables:
            table.pop(key, None)
        self._update_phase_gauge()

    # -- pods ---------------------------------------------------------------------------------

    async def _pod_loop(self, worker: PodWorker) -> None:
        while True:
            timeout = worker.retry_in if worker.retry_in is not None else self.config.resync_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.wake.wait(), timeout)
            worker.wake.clear()
            try:
                await self._reconcile_pod(worker)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the pod's reconciliation for good
                log.exception("reconciling pod %s/%s failed", *worker.info.key)
                worker.retry_in = self.config.max_backoff_s

    async def _reconcile_pod(self, worker: PodWorker) -> None:
        pod = worker.info
        started = time.monotonic()
        if not pod.reachable:
            if self.views.pop(pod.key, None) is not None:
                self._mark_namespace(pod.namespace)
            worker.retry_in = None
            return
        try:
            async with self._calls:
                report = await self.pods_client.models(pod)
        except PodError as e:
            worker.failures += 1
            worker.retry_in = backoff(worker.failures, self.config.max_backoff_s)
            log.info("action=read-models pod=%s/%s result=error message=%r", *pod.key, e.message)
            return
        worker.failures = 0
        wants = self._wants_for(pod, report.base_model)
        actions = planning.plan_pod(wants, report)
        acted = False
        for action in actions:
            if worker.info.uid != pod.uid or not worker.info.reachable:
                break  # the pod changed under us: the next pass starts over
            acted |= await self._act(pod, action)
        if acted:
            try:
                async with self._calls:
                    report = await self.pods_client.models(pod)
            except PodError as e:
                worker.retry_in = 1.0
                log.info("action=verify pod=%s/%s result=error message=%r", *pod.key, e.message)
                return
        before = self.views.get(pod.key)
        self.views[pod.key] = PodView(pod=pod, report=report)
        retry = self._record_report(pod, report, wants)
        worker.retry_in = retry
        if before is None or before.report.managed() != report.managed():
            self._collect_event.set()
        self._mark_namespace(pod.namespace)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    def _wants_for(self, pod: PodInfo, base_model: str | None) -> dict[str, planning.Want]:
        wants = {}
        for a in self._adapters(pod.namespace):
            if a.deleting or a.staged is None or not a.targets(pod, base_model):
                continue
            wants[a.name] = planning.Want(
                name=a.name, sha256=a.staged.sha256, scale=a.scale, pinned=a.pinned
            )
        return wants

    async def _act(self, pod: PodInfo, action: planning.Action) -> bool:
        """Carry out one planned call; True when the pod may have changed."""
        if isinstance(action, planning.Unload):
            return await self._unload(pod, action.name)
        entry = self.entries.setdefault((pod.namespace, action.name), {}).setdefault(
            pod.name, status_mod.PodEntry()
        )
        if isinstance(action, planning.Conflict):
            entry.state, entry.permanent, entry.failed_for = "Failed", True, action
            entry.last_error = (
                f"pod {pod.name} already serves an adapter named {action.name!r} that the "
                "operator did not load (a --lora flag?); rename the LoRAAdapter or drop the flag"
            )
            return False
        want = action.want
        if entry.state == "Failed" and entry.failed_for == want and entry.permanent:
            return False  # refused before: retried only when the spec or the revision changes
        entry.state = "Loading"
        self._mark((pod.namespace, want.name))
        started = time.monotonic()
        try:
            async with self._calls:
                await self.pods_client.load(pod, want, inplace=action.inplace)
        except PodError as e:
            self._load_failed(pod, want, entry, e)
            return True
        seconds = time.monotonic() - started
        self.metrics.loads.labels("ok").inc()
        self.metrics.load_seconds.observe(seconds)
        entry.load_seconds, entry.loaded_at = round(seconds, 3), now_iso()
        entry.attempts, entry.permanent, entry.failed_for, entry.last_error = 0, False, None, None
        log.info(
            "action=%s pod=%s/%s adapter=%s revision=%s result=ok seconds=%.3f",
            "load-inplace" if action.inplace else "load",
            pod.namespace,
            pod.name,
            want.name,
            want.sha256,
            seconds,
        )
        info = self._adapter(pod.namespace, want.name)
        if info is not None:
            self._event(
                info,
                "Normal",
                "Loaded",
                f"pod {pod.name} loaded revision {want.sha256[:12]} in {seconds:.2f}s",
            )
        return True

    def _load_failed(
        self, pod: PodInfo, want: planning.Want, entry: status_mod.PodEntry, e: PodError
    ) -> None:
        entry.last_error = e.message
        entry.failed_for = want
        result = "permanent" if e.permanent else "transient"
        self.metrics.loads.labels(result).inc()
        log.warning(
            "action=load pod=%s/%s adapter=%s revision=%s result=%s message=%r",
            pod.namespace,
            pod.name,
            want.name,
            want.sha256,
            result,
            e.message,
        )
        if e.permanent:
            entry.state, entry.permanent = "Failed", True
        else:
            entry.attempts += 1
            entry.permanent = False
            entry.state = "Failed" if entry.attempts >= self.config.retry_bound else "Pending"
        info = self._adapter(pod.namespace, want.name)
        if info is not None and (e.permanent or entry.attempts == self.config.retry_bound):
            self._event(info, "Warning", "LoadFailed", f"pod {pod.name}: {e.message}")

    async def _unload(self, pod: PodInfo, name: str) -> bool:
        try:
            async with self._calls:
                await self.pods_client.unload(pod, name)
        except PodError as e:
            self.metrics.unloads.labels("error").inc()
            log.warning(
                "action=unload pod=%s/%s adapter=%s result=error message=%r",
                pod.namespace,
                pod.name,
                name,
                e.message,
            )
            return True
        self.metrics.unloads.labels("ok").inc()
        log.info("action=unload pod=%s/%s adapter=%s result=ok", pod.namespace, pod.name, name)
        self.entries.get((pod.namespace, name), {}).pop(pod.name, None)
        info = self._adapter(pod.namespace, name)
        if info is not None:
            self._event(info, "Normal", "Unloaded", f"unloaded from pod {pod.name}")
        return True

    def _record_report(
        self, pod: PodInfo, report: planning.PodReport, wants: dict[str, planning.Want]
    ) -> float | None:
        """Update the pod's entries from what it reported; the delay of a needed retry."""
        retry: float | None = None
        for name, want in wants.items():
            entry = self.entries.setdefault((pod.namespace, name), {}).setdefault(
                pod.name, status_mod.PodEntry()
            )
            card = report.cards.get(name)
            if card is not None and planning.satisfied(want, card):
                entry.state, entry.revision = "Loaded", card.revision
                entry.attempts, entry.permanent, entry.last_error = 0, False, None
                continue
            entry.revision = card.revision if card is not None else None
            if entry.state == "Failed" and entry.permanent:
                continue
            if entry.state != "Failed":  # e.g. Loaded before the container restarted empty
                entry.state = "Pending"
            delay = backoff(entry.attempts + 1, self.config.max_backoff_s)
            retry = delay if retry is None else min(retry, delay)
        # Adapters that no longer want this pod lose its entry.
        for (namespace, name), per_pod in self.entries.items():
            if namespace == pod.namespace and name not in wants and pod.name in per_pod:
                del per_pod[pod.name]
                self._mark((namespace, name))
        return retry

    def _drop_pod_entries(self, pod: PodInfo) -> None:
        for (namespace, name), per_pod in self.entries.items():
            if namespace == pod.namespace and per_pod.pop(pod.name, None) is not None:
                self._mark((namespace, name))
        self._mark_namespace(pod.namespace)

    # -- status -------------------------------------------------------------------------------

    def _mark(self, key: Key) -> None:
        self._dirty.add(key)
        self._dirty_event.set()

    def _mark_namespace(self, namespace: str) -> None:
        for a in self._adapters(namespace):
            self._mark(a.key)

    async def _status_writer(self) -> None:
        while True:
            await self._dirty_event.wait()
            await asyncio.sleep(0.1)  # coalesce a burst of changes into one patch per adapter
            self._dirty_event.clear()
            keys, self._dirty = self._dirty, set()
            await asyncio.gather(*(self._write_status_or_retry(key) for key in sorted(keys)))

    async def _write_status_or_retry(self, key: Key) -> None:
        async with self._status_slots:
            try:
                await self._write_status(key)
            except Exception as e:  # the next change retries; never stop writing
                log.warning("writing the status of %s/%s failed: %s", *key, e)
                self._spawn(self._retry_mark(key))

    async def _retry_mark(self, key: Key) -> None:
        await asyncio.sleep(1.0)
        self._mark(key)

    def targeted(self, info: AdapterInfo) -> list[tuple[PodInfo, status_mod.PodEntry]]:
        """The Ready pods this adapter belongs on, with its entry on each."""
        per_pod = self.entries.setdefault(info.key, {})
        out = []
        for pod in self._pods(info.namespace):
            view = self.views.get(pod.key)
            if view is not None and pod.reachable and info.targets(pod, view.report.base_model):
                out.append((pod, per_pod.setdefault(pod.name, status_mod.PodEntry())))
        return out

    async def _write_status(self, key: Key) -> None:
        # One write per adapter at a time, each computed inside the lock: the last patch to land
        # is always built from the newest state (the writer and the stage handler both write).
        async with self._status_locks.setdefault(key, asyncio.Lock()):
            await self._write_status_locked(key)

    async def _write_status_locked(self, key: Key) -> None:
        info = self._adapter(*key)
        state = self.staging.get(key)
        if info is None or state is None:
            return
        targeted = [] if info.deleting else self.targeted(info)
        summary = status_mod.summarise(info, state, targeted)
        body = status_mod.render(
            info, state, targeted, summary, self._conditions.get(key, []), now_iso()
        )
        if body == self._written.get(key):
            return
        await self._logged_in.wait()
        assert self.kube is not None
        try:
            await self.kube.patch_adapter_status(info.namespace, info.name, body)
        except ApiError as e:
            if e.status == 404:
                return  # deleted meanwhile
            raise
        self._written[key] = body
        self._conditions[key] = body["conditions"]
        previous = self._phases.get(key)
        self._phases[key] = summary.phase
        self._update_phase_gauge()
        if previous != summary.phase and summary.phase not in ("Staging",):
            kind = "Warning" if summary.phase in status_mod.WARNING_PHASES else "Normal"
            log.info(
                "action=phase adapter=%s/%s phase=%s ready=%s message=%r",
                *key,
                summary.phase,
                body["ready"],
                summary.message,
            )
            self._event(info, kind, summary.phase, summary.message or summary.phase)

    def _update_phase_gauge(self) -> None:
        counts: dict[str, int] = {}
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        self.metrics.set_phases(counts)

    # -- garbage collection -------------------------------------------------------------------

    async def _collector(self) -> None:
        while True:
            await self._collect_event.wait()
            await asyncio.sleep(1.0)
            self._collect_event.clear()
            if any(p.reachable and p.key not in self.views for p in self._all_pods()):
                self._spawn(self._retry_collect())  # a pod we have not heard from may use any
                continue
            in_use = {
                gc.RevisionRef(ns, name, sha)
                for (ns, _), view in self.views.items()
                for name, sha in view.report.managed().items()
            }
            plan, freed = await self.store.collect(in_use)
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

    def _pods(self, namespace: str) -> list[PodInfo]:
        if self._pods_index is None:
            return []
        return list(self._pods_index.get(namespace, ()))

    def _all_pods(self) -> list[PodInfo]:
        return [p for ns in list(self._pods_index or ()) for p in self._pods(ns)]

    def _adapters(self, namespace: str) -> Iterable[AdapterInfo]:
        if self._adapters_index is None:
            return ()
        return list(self._adapters_index.get(namespace, ()))

    def _adapter(self, namespace: str, name: str) -> AdapterInfo | None:
        return next((a for a in self._adapters(namespace) if a.name == name), None)

    def _wake_namespace(self, namespace: str) -> None:
        for pod in self._pods(namespace):
            worker = self.workers.get(pod.key)
            if worker is not None:
                worker.wake.set()

    def _event(self, info: AdapterInfo, type_: str, reason: str, message: str) -> None:
        """Post an Event in the background: a pod's loads must not wait for the API server."""
        self._spawn(self._post_event(object_ref(info), type_, reason, message))

    async def _post_event(
        self, regarding: dict[str, str], type_: str, reason: str, message: str
    ) -> None:
        async with self._event_slots:
            await self._logged_in.wait()
            assert self.kube is not None
            await self.kube.post_event(regarding, type_, reason, message)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.append(task)
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        if task in self._background:
            self._background.remove(task)
