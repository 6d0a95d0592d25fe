"""The store on the shared adapter volume: download, verify, publish, point `current`.

Owns every write to the volume (layout in `lora_volume.layout`). A download streams
into `<volume>/.tmp/` while it is hashed and counted; only a verified file is hard-linked into
the content store `.objects/sha256/<hex>.safetensors`, a revision directory is built in `.tmp/`
and renamed into place, the adapter's target (which pods it is for) is a file renamed into place,
and `current` is a new symlink renamed over the old one. So a kill at any
point leaves at most files under `.tmp/` (removed by `clean_tmp`), never a partial revision.
A composition (`spec.compose`) is published the same way, its revision built from a manifest and
hard links to its members' stored objects (`stage_composition`).
Fetching is injected (`fetchers.fetch` by default) and writes into a `sinks.Sink`; nothing here
speaks a network protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from lora_volume import errors as volume_errors
from lora_volume import files, layout, stacks, targeting

from lora_operator import errors, fetchers, gc, sinks, sources

_T = TypeVar("_T")
Fetch = Callable[[sources.Source, sources.Credentials, sinks.Sink], Awaitable[None]]

DEFAULT_MAX_BYTES = 2 * 1024**3
DEFAULT_MAX_CONCURRENT = 4


@dataclass(frozen=True)
class StagedRevision:
    namespace: str
    name: str
    sha256: str
    size: int
    path: Path  # the revision directory, what a pod's load call names
    reused: bool  # the content was already in the store: nothing new was written


class Store:
    """Stages adapters onto one volume, at most `max_concurrent` at a time."""

    def __init__(
        self,
        volume_root: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
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
                await asyncio.to_thread(verify_lora_file, tmp, description)
                async with self._publish_lock:
                    return await _to_thread_to_the_end(
                        self._publish, namespace, name, digest, tmp, target
                    )
            finally:
                tmp.unlink(missing_ok=True)

    def current_revision(self, namespace: str, name: str) -> str | None:
        return current_revision(self.root, namespace, name)

    def clean_tmp(self) -> int:
        return clean_tmp(self.root)

    def publish_target(self, namespace: str, name: str, target: targeting.Target) -> bool:
        """Replace the target of an adapter already staged (a selector changed, or a staging
        that published none); whether anything was written. Nothing when it has no `current`."""
        ns_root = layout.namespace_root(self.root, namespace)
        if not layout.current_link(ns_root, name).is_symlink():
            return False
        try:
            return _write_target(self.root, ns_root, name, target)
        except OSError as e:
            raise sinks.disk_error(e) from e

    async def unpublish(self, namespace: str, name: str) -> bool:
        """Remove the adapter's `current` (its deletion); `collect` then frees its files."""
        async with self._publish_lock:
            return await asyncio.to_thread(remove_current, self.root, namespace, name)

    async def collect(self, in_use: Collection[gc.RevisionRef]) -> tuple[gc.GcPlan, int]:
        """Delete revisions neither current nor in `in_use` (what pods report), and the
        objects left without a revision; returns the plan applied and the bytes freed."""
        async with self._publish_lock:
            snapshot = await asyncio.to_thread(scan_volume, self.root)
            plan = gc.plan_gc(snapshot, in_use)
            freed = await asyncio.to_thread(apply_gc, self.root, plan) if plan else 0
        return plan, freed

    def _publish(
        self,
        namespace: str,
        name: str,
        digest: str,
        tmp: Path | None,
        target: targeting.Target | None,
    ) -> StagedRevision:
        try:
            return self._publish_unchecked(namespace, name, digest, tmp, target)
        except OSError as e:
            raise sinks.disk_error(e) from e

    def _publish_unchecked(
        self,
        namespace: str,
        name: str,
        digest: str,
        tmp: Path | None,
        target: targeting.Target | None,
    ) -> StagedRevision:
        obj = layout.object_path(self.root, digest)
        obj.parent.mkdir(parents=True, exist_ok=True)
        reused = True
        if tmp is not None:
            os.chmod(tmp, 0o444)
            try:
                os.link(tmp, obj)
                reused = False
                _fsync_dir(obj.parent)
            except FileExistsError:
                pass
        ns_root = layout.namespace_root(self.root, namespace)
        revision = layout.revision_dir(ns_root, name, digest)
        _build_revision(self.root, revision, lambda d: os.link(obj, d / layout.WEIGHTS_FILE))
        _point(self.root, ns_root, name, digest, target)
        return StagedRevision(
            namespace=namespace,
            name=name,
            sha256=digest,
            size=obj.stat().st_size,
            path=revision,
            reused=reused,
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
            _fsync_dir(building / stacks.MEMBERS_DIR)

        ns_root = layout.namespace_root(self.root, namespace)
        revision = layout.revision_dir(ns_root, name, digest)
        reused = revision.is_dir()
        try:
            _build_revision(self.root, revision, fill)
            _point(self.root, ns_root, name, digest, target)
        except OSError as e:
            raise sinks.disk_error(e) from e
        return StagedRevision(
            namespace=namespace,
            name=name,
            sha256=digest,
            size=len(manifest) + sum(obj.stat().st_size for obj in objects.values()),
            path=revision,
            reused=reused,
        )


def _build_revision(volume_root: Path, revision: Path, fill: Callable[[Path], None]) -> None:
    """Create `revision` unless it exists: filled by `fill` in `.tmp/`, then renamed into place,
    so no reader ever sees it half-built."""
    if revision.is_dir():
        return
    building = Path(tempfile.mkdtemp(dir=layout.tmp_dir(volume_root), prefix="revision-"))
    try:
        fill(building)
        os.chmod(building, 0o755)
        _fsync_dir(building)
        revision.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(building, revision)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        _fsync_dir(revision.parent)
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _point(
    volume_root: Path, ns_root: Path, name: str, digest: str, target: targeting.Target | None
) -> None:
    """Publish `target`, then point `current` at the revision `digest`."""
    if target is not None:
        # Before `current`: a pod that sees the adapter also sees which pods it is for.
        _write_target(volume_root, ns_root, name, target)
    _point_current(volume_root, ns_root, name, digest)


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


def _point_current(volume_root: Path, ns_root: Path, name: str, digest: str) -> None:
    link = layout.current_link(ns_root, name)
    target = f"{layout.REVISIONS}/{digest}"
    if link.is_symlink() and os.readlink(link) == target:
        return
    # Built in .tmp/ and renamed across directories (same volume), so a kill between the two
    # steps leaves nothing in the adapter's directory.
    tmp_link = layout.tmp_dir(volume_root) / f"current-{os.urandom(8).hex()}"
    os.symlink(target, tmp_link)
    try:
        os.replace(tmp_link, link)
    finally:
        tmp_link.unlink(missing_ok=True)
    _fsync_dir(link.parent)


def _write_target(volume_root: Path, ns_root: Path, name: str, target: targeting.Target) -> bool:
    """Publish `target` next to the adapter, atomically (written in .tmp/, renamed over)."""
    path = layout.target_file(ns_root, name)
    text = target.to_json()
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return False
    tmp = layout.tmp_dir(volume_root) / f"target-{os.urandom(8).hex()}"
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o444)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return True


def current_revision(volume_root: Path, namespace: str, name: str) -> str | None:
    """The SHA-256 `current` points at, or None when the adapter has none."""
    link = layout.current_link(layout.namespace_root(volume_root, namespace), name)
    if not link.is_symlink():
        return None
    return Path(os.readlink(link)).name


def remove_current(volume_root: Path, namespace: str, name: str) -> bool:
    """Unpublish an adapter (its deletion): pods stop resolving it; GC then frees its files."""
    ns_root = layout.namespace_root(volume_root, namespace)
    link = layout.current_link(ns_root, name)
    if not link.is_symlink():
        return False
    link.unlink()
    # After the link: a pod never sees a published adapter without its target.
    layout.target_file(ns_root, name).unlink(missing_ok=True)
    _fsync_dir(link.parent)
    return True


def verify_lora_file(path: Path, description: str) -> None:
    """Refuse a file that is not a sane LoRA safetensors, with the server's own checks
    (`lora_volume.errors.InvalidAdapter`)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) == 8:
            (header_len,) = struct.unpack("<Q", head)
            head += f.read(min(header_len, files.MAX_HEADER_BYTES))
    header = files.parse_safetensors_header(head, size, name=description)
    files.check_lora_keys(list(header.tensors), name=description)


def clean_tmp(volume_root: Path) -> int:
    """Remove what interrupted stagings left in `.tmp/`; call once at start, before staging."""
    tmp_root = layout.tmp_dir(volume_root)
    if not tmp_root.is_dir():
        return 0
    removed = 0
    for entry in tmp_root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed += 1
    return removed


# What the store does on the volume, in the order `check_volume` tries it.
VOLUME_STEPS = (
    "write a file",
    "hard-link a file into .objects/",
    "create a symbolic link",
    "rename a symbolic link over another",
    "rename a directory out of .tmp/",
)


def scan_volume(volume_root: Path) -> gc.VolumeSnapshot:
    """What the volume holds: every revision, what each `current` points to, every object."""
    revisions: set[gc.RevisionRef] = set()
    current: set[gc.RevisionRef] = set()
    for ns_dir in _subdirs(volume_root):
        if ns_dir.name.startswith("."):
            continue  # .objects, .tmp: the store's own folders
        for adapter in _subdirs(ns_dir):
            for rev in _subdirs(adapter / layout.REVISIONS):
                revisions.add(gc.RevisionRef(ns_dir.name, adapter.name, rev.name))
            link = layout.current_link(ns_dir, adapter.name)
            if link.is_symlink():
                current.add(gc.RevisionRef(ns_dir.name, adapter.name, Path(os.readlink(link)).name))
    objects_dir = layout.object_path(volume_root, "x").parent
    objects = (
        {p.name.removesuffix(".safetensors") for p in objects_dir.iterdir()}
        if objects_dir.is_dir()
        else set()
    )
    return gc.VolumeSnapshot(frozenset(revisions), frozenset(current), frozenset(objects))


def apply_gc(volume_root: Path, plan: gc.GcPlan) -> int:
    """Delete what `plan` names; returns the bytes freed (objects only, the revisions' links
    share their inodes). A revision is renamed into `.tmp/` first, so no reader ever sees a
    half-deleted directory; files a pod still has open stay readable until it closes them.
    """
    tmp_root = layout.tmp_dir(volume_root)
    tmp_root.mkdir(parents=True, exist_ok=True)
    for ref in plan.revisions:
        ns_root = layout.namespace_root(volume_root, ref.namespace)
        revision = layout.revision_dir(ns_root, ref.name, ref.sha256)
        doomed = tmp_root / f"gc-{os.urandom(8).hex()}"
        try:
            os.rename(revision, doomed)
        except FileNotFoundError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        _rmdir_if_empty(revision.parent)
        _rmdir_if_empty(revision.parent.parent)
    freed = 0
    for digest in plan.objects:
        obj = layout.object_path(volume_root, digest)
        try:
            freed += obj.stat().st_size
            obj.unlink()
        except FileNotFoundError:
            continue
    return freed


def _subdirs(path: Path) -> list[Path]:
    if not path.is_dir():
        return []
    return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise


def volume_hint(step: str, errno_: int | None) -> str:
    """What to change when `step` failed with `errno_` on the adapter volume (pure)."""
    if errno_ == errno.EROFS:
        return "the volume is mounted read-only; the operator mounts it read-write"
    if errno_ == errno.EXDEV:
        return (
            "the volume's folders are on different file systems (a subPath or a separate "
            "mount under it); mount one volume at the root"
        )
    if errno_ in (errno.ENOSPC, errno.EDQUOT):
        return "the volume is full"
    if step == VOLUME_STEPS[0] and errno_ in (errno.EACCES, errno.EPERM):
        return (
            "the operator's user cannot write it: give the pod an fsGroup the volume honours, "
            "or make the volume writable by uid 65532"
        )
    if step in VOLUME_STEPS[1:3]:
        return (
            "this file system has no hard links or symbolic links (vfat/exFAT, SMB without "
            "UNIX extensions, object-store FUSE mounts)"
        )
    return "this file system does not rename atomically"


def check_volume(volume_root: Path) -> None:
    """Try, on the volume itself, each operation the store relies on; raise VolumeUnsupported
    naming the first that fails and what to change. Leaves nothing behind."""
    if not volume_root.is_dir():
        raise errors.VolumeUnsupported(
            f"the adapter volume {volume_root} does not exist: mount the shared adapter volume "
            "there, read-write, or pass --volume-root"
        )
    tag = f".probe-{os.urandom(6).hex()}"
    tmp_root, objects = layout.tmp_dir(volume_root), volume_root / layout.OBJECTS
    probe, linked = tmp_root / tag, objects / tag
    link_target, renamed = objects / f"{tag}-current", objects / f"{tag}-dir"
    steps = iter(VOLUME_STEPS)
    step = next(steps)
    try:
        tmp_root.mkdir(exist_ok=True)
        objects.mkdir(exist_ok=True)
        probe.mkdir()
        (probe / "file").write_bytes(b"probe")
        step = next(steps)
        os.link(probe / "file", linked)
        step = next(steps)
        os.symlink("file", probe / "new")
        os.symlink("old", link_target)
        step = next(steps)
        os.replace(probe / "new", link_target)
        if os.readlink(link_target) != "file":
            raise OSError(None, "the link still points at the old target")
        step = next(steps)
        (probe / "dir").mkdir()
        os.rename(probe / "dir", renamed)
    except OSError as e:
        raise errors.VolumeUnsupported(
            f"the adapter volume {volume_root} cannot hold the adapter store: could not "
            f"{step} ({e.strerror or e}): {volume_hint(step, e.errno)}. The operator needs "
            "a POSIX file system with hard links, symbolic links and atomic rename (NFS, "
            "CephFS, EFS, Filestore, Azure Files NFS, ext4, xfs)"
        ) from e
    finally:
        shutil.rmtree(probe, ignore_errors=True)
        for leftover in (linked, link_target):
            with contextlib.suppress(OSError):
                leftover.unlink()
        with contextlib.suppress(OSError):
            renamed.rmdir()


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
