"""Garbage collection of the shared adapter volume: what to delete (pure).

`plan_gc` decides from a snapshot of the volume and the set of revisions pods still use; it keeps
every revision an adapter's `current` points to. The store (`staging`), which owns every write to
the volume, reads the snapshot (`scan_volume`) and deletes (`apply_gc`); `Store.collect` runs the
three under its publish lock, so a staging that has stored an object but not yet linked its
revision never loses it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


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


def revisions_in_use(
    held: Iterable[tuple[str, Iterable[tuple[str, str]]]],
    stable: Iterable[tuple[str, str, str]],
) -> set[RevisionRef]:
    """The revisions collection must keep: what every pod holds (namespace, its (adapter,
    revision) pairs), and each rollout's stable revision (namespace, name, revision), which may
    serve again (an abort) even where no pod holds it now."""
    in_use = {RevisionRef(ns, name, sha) for ns, pairs in held for name, sha in pairs}
    return in_use | {RevisionRef(*ref) for ref in stable}
