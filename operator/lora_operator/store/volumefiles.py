"""The store's operations on the volume's files, each atomic: a revision built in `.tmp/` and
renamed into place, `current` a new symbolic link renamed over the old one, the target written
in `.tmp/` and renamed over; unpublishing, what the volume holds (`scan_volume`), what each
namespace's revisions hold (`held_objects`, its usage for `quota`), deleting what `gc` plans
(`apply_gc`), and clearing `.tmp/` of what interrupted stagings left.

Blocking file-system calls only (the `Store` runs them in threads, under its lock). A kill at any
point leaves at most files under `.tmp/`, never a partial revision.
Must not: download, verify content, or decide what to delete (`gc.plan_gc` does).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from lora_volume import layout, targeting

from lora_operator.rules import gc
from lora_operator.store import quota


def build_revision(volume_root: Path, revision: Path, fill: Callable[[Path], None]) -> None:
    """Create `revision` unless it exists: filled by `fill` in `.tmp/`, then renamed into place,
    so no reader ever sees it half-built."""
    if revision.is_dir():
        return
    building = Path(tempfile.mkdtemp(dir=layout.tmp_dir(volume_root), prefix="revision-"))
    try:
        fill(building)
        os.chmod(building, 0o755)
        fsync_dir(building)
        revision.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(building, revision)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        fsync_dir(revision.parent)
    finally:
        shutil.rmtree(building, ignore_errors=True)


def point(
    volume_root: Path, ns_root: Path, name: str, digest: str, target: targeting.Target | None
) -> bool:
    """Publish `target`, then point `current` at the revision `digest`; whether `current`
    pointed at another revision before (`point_current`)."""
    if target is not None:
        # Before `current`: a pod that sees the adapter also sees which pods it is for.
        write_target(volume_root, ns_root, name, target)
    return point_current(volume_root, ns_root, name, digest)


def point_current(volume_root: Path, ns_root: Path, name: str, digest: str) -> bool:
    """Point `current` at the revision `digest`; whether it pointed at another one before
    (that one may be in use by nothing now)."""
    link = layout.current_link(ns_root, name)
    target = f"{layout.REVISIONS}/{digest}"
    before = os.readlink(link) if link.is_symlink() else None
    if before == target:
        return False
    # Built in .tmp/ and renamed across directories (same volume), so a kill between the two
    # steps leaves nothing in the adapter's directory.
    tmp_link = layout.tmp_dir(volume_root) / f"current-{os.urandom(8).hex()}"
    os.symlink(target, tmp_link)
    try:
        os.replace(tmp_link, link)
    finally:
        tmp_link.unlink(missing_ok=True)
    fsync_dir(link.parent)
    return before is not None


def write_target(volume_root: Path, ns_root: Path, name: str, target: targeting.Target) -> bool:
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
    fsync_dir(path.parent)
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
    fsync_dir(link.parent)
    return True


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


def held_objects(
    volume_root: Path, namespace: str | None = None
) -> dict[str, dict[quota.ObjectKey, int]]:
    """The files each namespace's revisions hold (`revision_files`), every namespace's or
    `namespace`'s only; hand-placed files outside `revisions/` count for no one."""
    if namespace is not None:
        ns_dirs = [layout.namespace_root(volume_root, namespace)]
    else:
        # .objects, .tmp and _shared are no namespace's: no Kubernetes name starts so.
        ns_dirs = [d for d in _subdirs(volume_root) if d.name[0].isalnum()]
    held: dict[str, dict[quota.ObjectKey, int]] = {}
    for ns_dir in ns_dirs:
        files: dict[quota.ObjectKey, int] = {}
        for adapter in _subdirs(ns_dir):
            for revision in _subdirs(adapter / layout.REVISIONS):
                files.update(revision_files(revision))
        held[ns_dir.name] = files
    return held


def revision_files(revision: Path) -> dict[quota.ObjectKey, int]:
    """The files of one revision directory (a composition's members included), by identity: a
    hard link to a stored object is that object."""
    files: dict[quota.ObjectKey, int] = {}
    for folder, _, names in os.walk(revision):
        for file in names:
            try:
                st = os.lstat(os.path.join(folder, file))
            except FileNotFoundError:
                continue  # collected meanwhile
            if stat.S_ISREG(st.st_mode):
                files[(st.st_dev, st.st_ino)] = st.st_size
    return files


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
