"""Garbage collection of the shared adapter volume: decide (pure), then delete.

`plan_gc` decides from a snapshot of the volume and the set of revisions pods still use; it keeps
every revision an adapter's `current` points to. `scan_volume` reads the snapshot and `apply_gc`
deletes; `staging.Store.collect` runs the three under the store's publish lock, so a staging
that has stored an object but not yet linked its revision never loses it.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from lora_volume import layout


@dataclass(frozen=True, order=True)
class RevisionRef:
    namespace: str
    name: str
    sha256: str


@dataclass(frozen=True)
class VolumeSnapshot:
    revisions: frozenset[RevisionRef]  # every revision directory
    current: frozenset[RevisionRef]  # what each adapter's `current` points to
    objects: frozenset[str]  # the SHA-256 of every stored object


@dataclass(frozen=True)
class GcPlan:
    revisions: tuple[RevisionRef, ...]
    objects: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.revisions or self.objects)


def plan_gc(snapshot: VolumeSnapshot, in_use: Collection[RevisionRef]) -> GcPlan:
    """Revisions neither current nor in use, and objects no kept revision holds (pure)."""
    keep = snapshot.current | frozenset(in_use)
    drop = sorted(r for r in snapshot.revisions if r not in keep)
    kept_content = {r.sha256 for r in snapshot.revisions if r in keep}
    # A current revision whose directory vanished still protects its content: staging can
    # rebuild the directory from the object without downloading again.
    kept_content |= {r.sha256 for r in snapshot.current}
    return GcPlan(
        revisions=tuple(drop),
        objects=tuple(sorted(o for o in snapshot.objects if o not in kept_content)),
    )


def scan_volume(volume_root: Path) -> VolumeSnapshot:
    revisions: set[RevisionRef] = set()
    current: set[RevisionRef] = set()
    for ns_dir in _subdirs(volume_root):
        if ns_dir.name.startswith("."):
            continue  # .objects, .tmp: the store's own folders
        for adapter in _subdirs(ns_dir):
            for rev in _subdirs(adapter / layout.REVISIONS):
                revisions.add(RevisionRef(ns_dir.name, adapter.name, rev.name))
            link = layout.current_link(ns_dir, adapter.name)
            if link.is_symlink():
                current.add(RevisionRef(ns_dir.name, adapter.name, Path(os.readlink(link)).name))
    objects_dir = layout.object_path(volume_root, "x").parent
    objects = (
        {p.name.removesuffix(".safetensors") for p in objects_dir.iterdir()}
        if objects_dir.is_dir()
        else set()
    )
    return VolumeSnapshot(frozenset(revisions), frozenset(current), frozenset(objects))


def apply_gc(volume_root: Path, plan: GcPlan) -> int:
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
