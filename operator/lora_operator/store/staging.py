"""The content-addressed store on the shared adapter volume: download, verify, publish, point
`current`.

Owns every write to the volume (layout in `lora_volume.layout`), and the lock that keeps
publishing and collection apart. A download streams into `<volume>/.tmp/` while it is hashed and
counted; only a verified file is hard-linked into the content store
`.objects/sha256/<hex>.safetensors`, then its revision, target and `current` are published
(`publishing`, by the atomic file operations of `volumefiles`: a kill at any point leaves at most
files under `.tmp/`, never a partial revision). A composition (`spec.compose`) is published the
same way, its revision built from a manifest and hard links to the weights of its members'
revisions (`stage_composition`). Each staged revision comes with what its weights declare, read
from their headers once: the download's when it is checked (`publishing.describe_file`), a stored
object's or a composition's members' when it is published (`publishing.describe_revision`). The
start-up check of the volume is `volumecheck`'s. Fetching is injected (`fetchers.fetch` by
default) and writes into a `sinks.Sink`, returning what the source resolved to (an oci:// tag's
manifest by digest), which the staged revision carries; nothing here speaks a network protocol.

This module holds the order of things and the locks: the checks before a staging, at most
`max_concurrent` stagings, the download into `.tmp/` and its reservation, and the locks
(`publishlocks`) under which publishing and unpublishing run one at a time in a namespace,
namespaces side by side, and collection alone, in threads.

Shared storage is shared bytes, not shared access: a namespace publishes only bytes it fetched
and verified itself, or that one of its revisions holds already. The content store is how equal
bytes are stored once, never a way to obtain them: a `sha256` pin reuses a stored object only
when the namespace holds it, and otherwise the source is downloaded and verified like any other
(then linked to the object already stored). What each namespace holds and downloads counts
against its quota (`quota.Ledger`, `--namespace-quota`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import TypeVar

from lora_volume import description, layout, stacks, targeting
from lora_volume import errors as volume_errors

from lora_operator.rules import errors, gc
from lora_operator.store import (
    downloads,
    fetchers,
    limits,
    publishing,
    publishlocks,
    quota,
    sinks,
    sources,
    volumefiles,
)

_T = TypeVar("_T")
# Writes the source's content into the sink; returns what the source resolved to, or None
# (`fetchers.fetch`).
Fetch = Callable[[sources.Source, sources.Credentials, sinks.Sink], Awaitable[str | None]]


class Store:
    """Stages adapters onto one volume, at most `max_concurrent` at a time."""

    def __init__(
        self,
        volume_root: Path,
        *,
        max_bytes: int = limits.DEFAULT_MAX_BYTES,
        max_concurrent: int = limits.DEFAULT_MAX_CONCURRENT,
        fetch: Fetch | None = None,
        policy: downloads.RetryPolicy | None = None,
        hf_endpoint: str | None = None,
        namespace_quota: int | None = limits.DEFAULT_NAMESPACE_QUOTA,
        on_usage: quota.UsageCallback | None = None,
    ) -> None:
        """`namespace_quota`: the bytes of the volume one namespace's revisions may hold
        (`quota`; None: no limit); `on_usage` hears each change of a namespace's usage."""
        self.root = volume_root
        self.hf_endpoint = hf_endpoint
        self.policy = policy or downloads.RetryPolicy()
        self.max_bytes = max_bytes
        self._semaphore = asyncio.Semaphore(max_concurrent)
        # Publishing in a namespace and garbage collection exclude each other (publishlocks).
        self._locks = publishlocks.PublishLocks()
        self._fetch: Fetch = fetch or self._default_fetch
        # What each namespace holds and is downloading; changed only under the namespace's lock
        # (or the collection's), but for the downloads' reservations, which are taken on the
        # fetchers' threads. Thread-safe: namespaces publish in threads side by side.
        self.ledger = quota.Ledger(namespace_quota, on_usage)

    async def _default_fetch(
        self, source: sources.Source, credentials: sources.Credentials, sink: sinks.Sink
    ) -> str | None:
        return await fetchers.fetch(
            source,
            credentials,
            sink,
            policy=self.policy,
            volume_root=self.root,
            hf_endpoint=self.hf_endpoint,
        )

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
    ) -> publishing.StagedRevision:
        """Make `source` the current revision of `namespace/name`; idempotent.

        With a `sha256` pin whose content a revision of this namespace already holds, nothing is
        downloaded; the same content stored for another namespace only is downloaded and
        verified all the same (a hash is no proof that the source has those bytes), then
        stored once. A download counts against the namespace's quota as it goes, and a
        revision that would take it past the quota is not published (`QuotaExceeded`).
        `progress` hears the bytes written so far: first 0, on the caller's loop, when the
        download begins (after its wait for one of the `max_concurrent` slots; never when the
        pin is held and nothing is downloaded), then each count from the fetcher's thread. `target`
        (the pods the adapter is for) is published before `current`. The revision carries what
        the source resolved to when it was fetched (`StagedRevision.resolved`; None when nothing
        was). Raises only StagingErrors: the volume's own checks (names, volume paths, the file)
        are mapped here, once.
        """
        try:
            return await self._stage(namespace, name, source, credentials, sha256, progress, target)
        except volume_errors.VolumeError as e:
            raise errors.from_volume(e) from e

    async def _stage(
        self,
        namespace: str,
        name: str,
        source: sources.Source,
        credentials: sources.Credentials | None,
        sha256: str | None,
        progress: sinks.ProgressCallback | None,
        target: targeting.Target | None,
    ) -> publishing.StagedRevision:
        layout.check_adapter_name(namespace, param="namespace")
        layout.check_adapter_name(name, param="adapter name")
        pin = sources.check_sha256(sha256)
        sources.check_not_pickle(source)
        if isinstance(source, sources.VolumeSource):
            _check_not_other_namespace(self.root, source.path, namespace)
        description = sources.describe(source)
        async with self._semaphore:
            # Under the lock: a collection can neither remove the object nor change what the
            # namespace holds in between.
            async with self._locks.namespace(namespace):
                if await asyncio.to_thread(self._holds, namespace, pin):
                    return await _to_thread_to_the_end(
                        publishing.publish_download,
                        self.root,
                        self.ledger,
                        namespace,
                        name,
                        pin,
                        None,
                        target,
                    )
                # A changed spec stages the source again, and its content is most often the
                # current revision's: the download reserves only what exceeds that, and
                # publishing decides exactly whether the namespace has room for it.
                credit = await asyncio.to_thread(self._current_size, namespace, name)
            tmp_root = layout.tmp_dir(self.root)
            try:
                tmp_root.mkdir(parents=True, exist_ok=True)
                fd, tmp_name = tempfile.mkstemp(dir=tmp_root, prefix="download-", suffix=".part")
            except OSError as e:
                raise sinks.disk_error(e) from e
            tmp = Path(tmp_name)
            reservation = quota.Reservation(self.ledger, namespace, progress, credit)
            try:
                with (
                    os.fdopen(fd, "w+b") as f,
                    # Its bytes count against the namespace's quota as they come: a download
                    # that does not fit stops when its source announces its size, or at the
                    # chunk that passes it, before that chunk is written.
                    sinks.Sink(
                        f,
                        max_bytes=self.max_bytes,
                        description=description,
                        progress=reservation.written,
                        announced=reservation.announced,
                    ) as sink,
                ):
                    if progress is not None:
                        # The download begins: it had a slot to wait for, and no pin it holds.
                        progress(0)
                    resolved = await self._fetch(source, credentials or sources.Credentials(), sink)
                    digest = await asyncio.to_thread(sink.finish)
                if pin is not None and digest != pin:
                    raise errors.ChecksumMismatch(
                        f"{description} has SHA-256 {digest}, but source.sha256 pins {pin}; "
                        "fix the pin or the source"
                    )
                adapter = await asyncio.to_thread(publishing.describe_file, tmp, description)
                async with self._locks.namespace(namespace):
                    staged = await _to_thread_to_the_end(
                        publishing.publish_download,
                        self.root,
                        self.ledger,
                        namespace,
                        name,
                        digest,
                        tmp,
                        target,
                        adapter,
                        reservation,
                    )
                return dataclasses.replace(staged, resolved=resolved)
            finally:
                reservation.release()
                tmp.unlink(missing_ok=True)

    def current_revision(self, namespace: str, name: str) -> str | None:
        return volumefiles.current_revision(self.root, namespace, name)

    def clean_tmp(self) -> int:
        """Clear `.tmp/` (once, when this replica starts to act, before it stages) and read
        what every namespace holds, which another replica may have changed."""
        removed = volumefiles.clean_tmp(self.root)
        self.ledger.load(volumefiles.held_objects(self.root), every=True)
        return removed

    def usage(self) -> dict[str, quota.Usage]:
        """Each namespace's usage of the volume, as far as the store has read it."""
        return self.ledger.usages()

    def _read_usage(self, namespace: str) -> None:
        """Read what `namespace` holds from the volume, once. Under the namespace's lock."""
        if not self.ledger.loaded(namespace):
            try:
                self.ledger.load(volumefiles.held_objects(self.root, namespace))
            except OSError as e:
                raise sinks.disk_error(e) from e

    def _current_size(self, namespace: str, name: str) -> int:
        """The size of the weights of `name`'s current revision; 0 without one."""
        sha256 = self.current_revision(namespace, name)
        if sha256 is None:
            return 0
        ns_root = layout.namespace_root(self.root, namespace)
        try:
            return (layout.revision_dir(ns_root, name, sha256) / layout.WEIGHTS_FILE).stat().st_size
        except OSError:
            return 0  # a composition's, or gone: nothing to count on

    def _holds(self, namespace: str, sha256: str | None) -> bool:
        """Whether a revision of `namespace` holds the stored content `sha256` (its usage read
        first). Under the namespace's lock."""
        self._read_usage(namespace)
        if sha256 is None:
            return False
        try:
            st = layout.object_path(self.root, sha256).stat()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise sinks.disk_error(e) from e
        return self.ledger.holds(namespace, (st.st_dev, st.st_ino))

    def describe_current(self, namespace: str, name: str) -> description.Description | None:
        """What the current revision of `namespace/name` declares (`describe_revision`); None
        when it has none. Reads headers only: for an adapter staged before, by an operator that
        did not record it."""
        ns_root = layout.namespace_root(self.root, namespace)
        sha256 = self.current_revision(namespace, name)
        if sha256 is None:
            return None
        return publishing.describe_revision(layout.revision_dir(ns_root, name, sha256), name)

    def publish_target(self, namespace: str, name: str, target: targeting.Target) -> bool:
        """Replace the target of an adapter already staged (a selector changed, or a staging
        that published none); whether anything was written. Nothing when it has no `current`."""
        ns_root = layout.namespace_root(self.root, namespace)
        if not layout.current_link(ns_root, name).is_symlink():
            return False
        try:
            return volumefiles.write_target(self.root, ns_root, name, target)
        except OSError as e:
            raise sinks.disk_error(e) from e

    async def unpublish(self, namespace: str, name: str) -> bool:
        """Remove the adapter's `current` (its deletion); `collect` then frees its files."""
        async with self._locks.namespace(namespace):
            return await asyncio.to_thread(volumefiles.remove_current, self.root, namespace, name)

    async def collect(self, in_use: Collection[gc.RevisionRef]) -> tuple[gc.GcPlan, int]:
        """Delete revisions neither current nor in `in_use` (what pods report), and the
        objects left without a revision; returns the plan applied and the bytes freed."""
        async with self._locks.everything():
            snapshot = await asyncio.to_thread(volumefiles.scan_volume, self.root)
            plan = gc.plan_gc(snapshot, in_use)
            freed = await asyncio.to_thread(volumefiles.apply_gc, self.root, plan) if plan else 0
            if plan:
                # What the namespaces hold shrank: stagings over their quota retry into it.
                held = await asyncio.to_thread(volumefiles.held_objects, self.root)
                self.ledger.load(held, every=True)
        return plan, freed

    async def stage_composition(
        self,
        namespace: str,
        name: str,
        entries: Sequence[stacks.StackEntry],
        *,
        target: targeting.Target | None = None,
    ) -> publishing.StagedRevision:
        """Make the composition of `entries` (members' staged revisions, at their scales) the
        current revision of `namespace/name`: its manifest and hard links to the weights of the
        members' revisions in this namespace (`lora_volume.stacks`), never to the store's
        objects by hash; idempotent, nothing is downloaded."""
        try:
            layout.check_adapter_name(namespace, param="namespace")
            layout.check_adapter_name(name, param="adapter name")
        except volume_errors.VolumeError as e:
            raise errors.from_volume(e) from e
        manifest = stacks.manifest_bytes(entries)
        digest = hashlib.sha256(manifest).hexdigest()
        async with self._semaphore, self._locks.namespace(namespace):
            return await _to_thread_to_the_end(
                self._publish_composition, namespace, name, digest, manifest, entries, target
            )

    def _publish_composition(
        self,
        namespace: str,
        name: str,
        digest: str,
        manifest: bytes,
        entries: Sequence[stacks.StackEntry],
        target: targeting.Target | None,
    ) -> publishing.StagedRevision:
        self._read_usage(namespace)
        return publishing.publish_composition(
            self.root, self.ledger, namespace, name, digest, manifest, entries, target
        )


async def _to_thread_to_the_end(fn: Callable[..., _T], *args: object) -> _T:
    """Run `fn` in a thread; a cancellation waits for it to finish before it propagates, so
    whoever holds a lock around this call holds it until the volume is consistent again (an
    unpublish after a cancelled staging never races the staging's publish)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


def _check_not_other_namespace(volume_root: Path, path: Path, namespace: str) -> None:
    """A volume path must lie in the adapter's own namespace folder or in `_shared/`: a
    namespace's folder is what its pods read, and no other namespace may copy from it."""
    try:
        parts = path.resolve().relative_to(volume_root.resolve()).parts
    except ValueError:
        return  # outside the volume: the fetcher refuses it with the allowed-roots message
    if len(parts) >= 2 and parts[0] in (namespace, layout.SHARED):
        return
    raise errors.InvalidSource(
        f"{path} is outside this namespace's folder on the volume: put the file under "
        f"{volume_root / namespace}/ or {volume_root / layout.SHARED}/"
    )
