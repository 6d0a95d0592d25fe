"""The content-addressed store on the shared adapter volume: download, verify, publish, point
`current`.

Owns every write to the volume (layout in `lora_volume.layout`), and the lock that keeps
publishing and collection apart. A download streams into `<volume>/.tmp/` while it is hashed and
counted; only a verified file is hard-linked into the content store
`.objects/sha256/<hex>.safetensors`, then its revision, target and `current` are published by the
atomic file operations of `volumefiles` (so a kill at any point leaves at most files under
`.tmp/`, never a partial revision). A composition (`spec.compose`) is published the same way, its
revision built from a manifest and hard links to the weights of its members' revisions
(`stage_composition`). Each staged revision comes with what its weights declare, read from their
headers once: the download's when it is checked (`describe_file`), a stored object's or a
composition's members' when it is published (`describe_revision`). The start-up check of the
volume is `volumecheck`'s. Fetching is injected (`fetchers.fetch` by default) and writes into a
`sinks.Sink`; nothing here speaks a network protocol.

Shared storage is shared bytes, not shared access: a namespace publishes only bytes it fetched
and verified itself, or that one of its revisions holds already. The content store is how equal
bytes are stored once, never a way to obtain them: a `sha256` pin reuses a stored object only
when the namespace holds it, and otherwise the source is downloaded and verified like any other
(then linked to the object already stored). What each namespace holds and downloads counts
against its quota (`quota.Ledger`, `--namespace-quota`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from lora_volume import description, files, layout, stacks, targeting
from lora_volume import errors as volume_errors

from lora_operator.rules import errors, gc
from lora_operator.store import downloads, fetchers, limits, quota, sinks, sources, volumefiles

_T = TypeVar("_T")
Fetch = Callable[[sources.Source, sources.Credentials, sinks.Sink], Awaitable[None]]


@dataclass(frozen=True)
class StagedRevision:
    namespace: str
    name: str
    sha256: str
    size: int
    path: Path  # the revision directory, what a pod's load call names
    reused: bool  # the content was already in the store: nothing new was written
    adapter: description.Description  # what its weights declare (`describe_revision`)


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
        # Publishing and garbage collection exclude each other: between storing an object and
        # linking its revision, the object looks unreferenced.
        self._publish_lock = asyncio.Lock()
        self._fetch: Fetch = fetch or self._default_fetch
        # What each namespace holds and is downloading; changed only under the publish lock,
        # but for the downloads' reservations, which are taken on the fetchers' threads.
        self.ledger = quota.Ledger(namespace_quota, on_usage)

    async def _default_fetch(
        self, source: sources.Source, credentials: sources.Credentials, sink: sinks.Sink
    ) -> None:
        await fetchers.fetch(
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
    ) -> StagedRevision:
        """Make `source` the current revision of `namespace/name`; idempotent.

        With a `sha256` pin whose content a revision of this namespace already holds, nothing is
        downloaded; the same content stored for another namespace only is downloaded and
        verified all the same (a hash is no proof that the source has those bytes), then
        stored once. A download counts against the namespace's quota as it goes, and a
        revision that would take it past the quota is not published (`QuotaExceeded`). `target`
        (the pods the adapter is for) is published before `current`. Raises only StagingErrors:
        the volume's own checks (names, volume paths, the file) are mapped here, once.
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
    ) -> StagedRevision:
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
            async with self._publish_lock:
                if await asyncio.to_thread(self._holds, namespace, pin):
                    return await _to_thread_to_the_end(
                        self._publish, namespace, name, pin, None, target
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
            reservation = _Reservation(self.ledger, namespace, progress, credit)
            try:
                with (
                    os.fdopen(fd, "w+b") as f,
                    _ReservingSink(
                        f,
                        max_bytes=self.max_bytes,
                        description=description,
                        reservation=reservation,
                    ) as sink,
                ):
                    await self._fetch(source, credentials or sources.Credentials(), sink)
                    digest = await asyncio.to_thread(sink.finish)
                if pin is not None and digest != pin:
                    raise errors.ChecksumMismatch(
                        f"{description} has SHA-256 {digest}, but source.sha256 pins {pin}; "
                        "fix the pin or the source"
                    )
                adapter = await asyncio.to_thread(describe_file, tmp, description)
                async with self._publish_lock:
                    return await _to_thread_to_the_end(
                        self._publish, namespace, name, digest, tmp, target, adapter, reservation
                    )
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
        """Read what `namespace` holds from the volume, once. Under the publish lock."""
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
        first). Under the publish lock."""
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
        return describe_revision(layout.revision_dir(ns_root, name, sha256), name)

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
        async with self._publish_lock:
            return await asyncio.to_thread(volumefiles.remove_current, self.root, namespace, name)

    async def collect(self, in_use: Collection[gc.RevisionRef]) -> tuple[gc.GcPlan, int]:
        """Delete revisions neither current nor in `in_use` (what pods report), and the
        objects left without a revision; returns the plan applied and the bytes freed."""
        async with self._publish_lock:
            snapshot = await asyncio.to_thread(volumefiles.scan_volume, self.root)
            plan = gc.plan_gc(snapshot, in_use)
            freed = await asyncio.to_thread(volumefiles.apply_gc, self.root, plan) if plan else 0
            if plan:
                # What the namespaces hold shrank: stagings over their quota retry into it.
                held = await asyncio.to_thread(volumefiles.held_objects, self.root)
                self.ledger.load(held, every=True)
        return plan, freed

    def _publish(
        self,
        namespace: str,
        name: str,
        digest: str,
        tmp: Path | None,
        target: targeting.Target | None,
        adapter: description.Description | None = None,
        reservation: _Reservation | None = None,
    ) -> StagedRevision:
        """Publish `digest` (from the download at `tmp`, or already held by the namespace) as
        `name`'s current revision; `adapter`: what the download declares, already read (None:
        read it from the stored object); `reservation`: the download's, which the published
        revision takes over."""
        try:
            return self._publish_unchecked(
                namespace, name, digest, tmp, target, adapter, reservation
            )
        except OSError as e:
            raise sinks.disk_error(e) from e

    def _publish_unchecked(
        self,
        namespace: str,
        name: str,
        digest: str,
        tmp: Path | None,
        target: targeting.Target | None,
        adapter: description.Description | None,
        reservation: _Reservation | None,
    ) -> StagedRevision:
        obj = layout.object_path(self.root, digest)
        obj.parent.mkdir(parents=True, exist_ok=True)
        reused = True
        if tmp is not None:
            # Verified by this namespace's own download, so it may hold the bytes, stored
            # once: the object already there (another namespace's) or the download.
            stored = obj.stat() if obj.exists() else tmp.stat()
            self.ledger.admit(
                namespace,
                reservation,
                {(stored.st_dev, stored.st_ino): stored.st_size},
            )
            os.chmod(tmp, 0o444)
            try:
                os.link(tmp, obj)
                reused = False
                volumefiles.fsync_dir(obj.parent)
            except FileExistsError:
                pass
        ns_root = layout.namespace_root(self.root, namespace)
        revision = layout.revision_dir(ns_root, name, digest)
        volumefiles.build_revision(
            self.root, revision, lambda d: os.link(obj, d / layout.WEIGHTS_FILE)
        )
        self.ledger.commit(namespace, reservation, volumefiles.revision_files(revision))
        volumefiles.point(self.root, ns_root, name, digest, target)
        return StagedRevision(
            namespace=namespace,
            name=name,
            sha256=digest,
            size=obj.stat().st_size,
            path=revision,
            reused=reused,
            adapter=adapter or describe_revision(revision, name),
        )

    async def stage_composition(
        self,
        namespace: str,
        name: str,
        entries: Sequence[stacks.StackEntry],
        *,
        target: targeting.Target | None = None,
    ) -> StagedRevision:
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
        async with self._semaphore, self._publish_lock:
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
    ) -> StagedRevision:
        self._read_usage(namespace)
        ns_root = layout.namespace_root(self.root, namespace)
        # Through the namespace's own door: its members' revisions, which it staged itself.
        weights = {
            e.name: layout.revision_dir(ns_root, e.name, e.sha256) / layout.WEIGHTS_FILE
            for e in entries
        }
        gone = [n for n, path in weights.items() if not path.is_file()]
        if gone:
            # Collected between the member's staging and this one: staging the member again
            # (its next change, or the operator's restart) brings the content back.
            raise errors.MemberNotStaged(
                f"the staged revisions of {', '.join(map(repr, gone))} are no longer on the "
                "volume; waiting for them to be staged again"
            )

        def fill(building: Path) -> None:
            (building / stacks.MEMBERS_DIR).mkdir()
            for entry in entries:
                os.link(weights[entry.name], building / entry.file)
            (building / stacks.STACK_FILE).write_bytes(manifest)
            os.chmod(building / stacks.STACK_FILE, 0o444)
            os.chmod(building / stacks.MEMBERS_DIR, 0o755)
            volumefiles.fsync_dir(building / stacks.MEMBERS_DIR)

        revision = layout.revision_dir(ns_root, name, digest)
        reused = revision.is_dir()
        try:
            if not reused:
                members = [path.stat() for path in weights.values()]
                self.ledger.admit(
                    namespace,
                    None,
                    {(st.st_dev, st.st_ino): st.st_size for st in members},
                    extra=len(manifest),
                )
            volumefiles.build_revision(self.root, revision, fill)
            self.ledger.commit(namespace, None, volumefiles.revision_files(revision))
            volumefiles.point(self.root, ns_root, name, digest, target)
            size = len(manifest) + sum(path.stat().st_size for path in weights.values())
        except OSError as e:
            raise sinks.disk_error(e) from e
        return StagedRevision(
            namespace=namespace,
            name=name,
            sha256=digest,
            size=size,
            path=revision,
            reused=reused,
            adapter=describe_revision(revision, name),
        )


class _Reservation:
    """One download's share of its namespace's quota (`quota.Ledger.reserve`, with itself as
    the token): what its source announced or what it has written, whichever is more, less
    `credit` (the size of the adapter's current revision, which the download most often
    repeats). A share that would pass the quota raises QuotaExceeded where the fetcher writes,
    which ends the download. `progress` (the staging's) hears what is written."""

    def __init__(
        self,
        ledger: quota.Ledger,
        namespace: str,
        progress: sinks.ProgressCallback | None,
        credit: int = 0,
    ) -> None:
        self._ledger, self._namespace, self._progress = ledger, namespace, progress
        self._credit = credit
        self._announced = self._written = 0

    def announced(self, declared: int | None) -> None:
        self._announced = declared or 0
        self._reserve()

    def written(self, n: int) -> None:  # the sink's progress callback: the fetcher's thread
        self._written = n
        self._reserve()
        if self._progress is not None:
            self._progress(n)

    def _reserve(self) -> None:
        share = max(self._announced, self._written) - self._credit
        self._ledger.reserve(self._namespace, self, max(0, share))

    def release(self) -> None:
        self._ledger.release(self._namespace, self)


class _ReservingSink(sinks.Sink):
    """A sink whose bytes count against the namespace's quota as they come: a download that
    does not fit stops when its source announces its size, or at the chunk that passes it,
    before that chunk is written."""

    def __init__(
        self, file: BinaryIO, *, max_bytes: int, description: str, reservation: _Reservation
    ) -> None:
        super().__init__(
            file, max_bytes=max_bytes, description=description, progress=reservation.written
        )
        self._reservation = reservation

    def expect(self, declared: int | None) -> None:
        super().expect(declared)
        self._reservation.announced(declared)


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


def describe_revision(revision: Path, name: str) -> description.Description:
    """What the weights of a published revision declare, from their headers only (a few
    kilobytes each, however large the file): a composition's is its members' stacked
    (`description.stacked`), in the manifest's order. Raises only StagingErrors."""
    try:
        if stacks.is_stack(revision):
            manifest = revision / stacks.STACK_FILE
            entries = stacks.parse_manifest(manifest.read_bytes(), where=str(manifest))
            return description.stacked(
                [
                    describe_file(revision / e.file, f"member {e.name!r} of {name!r}")
                    for e in entries
                ]
            )
        return describe_file(revision / layout.WEIGHTS_FILE, repr(name))
    except volume_errors.VolumeError as e:
        raise errors.from_volume(e) from e
    except OSError as e:
        raise sinks.disk_error(e) from e


def describe_file(path: Path, what: str) -> description.Description:
    """What the safetensors file at `path` declares; refuses one that is not an adapter the
    server serves, with the server's own checks (`lora_volume.errors.InvalidAdapter`)."""
    return description.describe(files.read_safetensors_header(path, name=what), name=what)


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
