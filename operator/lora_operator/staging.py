"""The content-addressed store on the shared adapter volume: download, verify, publish, point
`current`.

Owns every write to the volume (layout in `lora_volume.layout`), and the lock that keeps
publishing and collection apart. A download streams into `<volume>/.tmp/` while it is hashed and
counted; only a verified file is hard-linked into the content store
`.objects/sha256/<hex>.safetensors`, then its revision, target and `current` are published by the
atomic file operations of `volumefiles` (so a kill at any point leaves at most files under
`.tmp/`, never a partial revision). A composition (`spec.compose`) is published the same way, its
revision built from a manifest and hard links to its members' stored objects
(`stage_composition`). Each staged revision comes with what its weights declare, read from
their headers once: the download's when it is checked (`describe_file`), a stored object's or a
composition's members' when it is published (`describe_revision`). The start-up check of the
volume is `volumecheck`'s. Fetching is injected (`fetchers.fetch` by default) and writes into
a `sinks.Sink`; nothing here speaks a network protocol.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from lora_volume import description, files, layout, stacks, targeting
from lora_volume import errors as volume_errors

from lora_operator import errors, fetchers, gc, limits, sinks, sources, volumefiles

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
        policy: fetchers.RetryPolicy | None = None,
        hf_endpoint: str | None = None,
    ) -> None:
        self.root = volume_root
        self.hf_endpoint = hf_endpoint
        self.policy = policy or fetchers.RetryPolicy()
        self.max_bytes = max_bytes
        self._semaphore = asyncio.Semaphore(max_concurrent)
        # Publishing and garbage collection exclude each other: between storing an object and
        # linking its revision, the object looks unreferenced.
        self._publish_lock = asyncio.Lock()
        self._fetch: Fetch = fetch or self._default_fetch

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

        With a `sha256` pin whose content is already stored, nothing is downloaded. `target`
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
            if pin is not None:
                # Checked under the lock: a collection cannot remove the object in between.
                async with self._publish_lock:
                    if layout.object_path(self.root, pin).is_file():
                        return await _to_thread_to_the_end(
                            self._publish, namespace, name, pin, None, target
                        )
            tmp_root = layout.tmp_dir(self.root)
            try:
                tmp_root.mkdir(parents=True, exist_ok=True)
                fd, tmp_name = tempfile.mkstemp(dir=tmp_root, prefix="download-", suffix=".part")
            except OSError as e:
                raise sinks.disk_error(e) from e
            tmp = Path(tmp_name)
            try:
                with (
                    os.fdopen(fd, "w+b") as f,
                    sinks.Sink(
                        f, max_bytes=self.max_bytes, description=description, progress=progress
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
                        self._publish, namespace, name, digest, tmp, target, adapter
                    )
            finally:
                tmp.unlink(missing_ok=True)

    def current_revision(self, namespace: str, name: str) -> str | None:
        return volumefiles.current_revision(self.root, namespace, name)

    def clean_tmp(self) -> int:
        return volumefiles.clean_tmp(self.root)

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
        return plan, freed

    def _publish(
        self,
        namespace: str,
        name: str,
        digest: str,
        tmp: Path | None,
        target: targeting.Target | None,
        adapter: description.Description | None = None,
    ) -> StagedRevision:
        """Publish `digest` (from the download at `tmp`, or already stored) as `name`'s current
        revision; `adapter`: what the download declares, already read (None: read it from the
        stored object)."""
        try:
            return self._publish_unchecked(namespace, name, digest, tmp, target, adapter)
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
    ) -> StagedRevision:
        obj = layout.object_path(self.root, digest)
        obj.parent.mkdir(parents=True, exist_ok=True)
        reused = True
        if tmp is not None:
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
        current revision of `namespace/name`: its manifest and hard links to the members'
        stored weights (`lora_volume.stacks`); idempotent, nothing is downloaded."""
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
        objects = {e.name: layout.object_path(self.root, e.sha256) for e in entries}
        gone = [n for n, obj in objects.items() if not obj.is_file()]
        if gone:
            # Collected between the member's staging and this one: staging the member again
            # (its next change, or the operator's restart) brings the content back.
            raise errors.MemberNotStaged(
                f"the staged weights of {', '.join(map(repr, gone))} are no longer on the "
                "volume; waiting for them to be staged again"
            )

        def fill(building: Path) -> None:
            (building / stacks.MEMBERS_DIR).mkdir()
            for entry in entries:
                os.link(objects[entry.name], building / entry.file)
            (building / stacks.STACK_FILE).write_bytes(manifest)
            os.chmod(building / stacks.STACK_FILE, 0o444)
            os.chmod(building / stacks.MEMBERS_DIR, 0o755)
            volumefiles.fsync_dir(building / stacks.MEMBERS_DIR)

        ns_root = layout.namespace_root(self.root, namespace)
        revision = layout.revision_dir(ns_root, name, digest)
        reused = revision.is_dir()
        try:
            volumefiles.build_revision(self.root, revision, fill)
            volumefiles.point(self.root, ns_root, name, digest, target)
        except OSError as e:
            raise sinks.disk_error(e) from e
        return StagedRevision(
            namespace=namespace,
            name=name,
            sha256=digest,
            size=len(manifest) + sum(obj.stat().st_size for obj in objects.values()),
            path=revision,
            reused=reused,
            adapter=describe_revision(revision, name),
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
