"""Garbage collection: the pure plan, exhaustively; the executor on a real staged volume."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from lora_operator.rules import gc
from lora_operator.store import publishing, sources, staging, volumefiles
from lora_volume import layout

from tests.support.loras import lora_bytes, sha

A1 = gc.RevisionRef("ns", "a", "1" * 64)
A2 = gc.RevisionRef("ns", "a", "2" * 64)
B1 = gc.RevisionRef("other", "b", "1" * 64)  # same content as A1, another adapter
C3 = gc.RevisionRef("ns", "c", "3" * 64)


def snap(revisions: set[gc.RevisionRef], current: set[gc.RevisionRef]) -> gc.VolumeSnapshot:
    objects = frozenset(r.sha256 for r in revisions) | {"9" * 64}  # plus an orphan object
    return gc.VolumeSnapshot(frozenset(revisions), frozenset(current), objects)


@pytest.mark.parametrize(
    ("revisions", "current", "in_use", "dropped_revisions", "dropped_objects"),
    [
        ({A1, A2}, {A2}, set(), [A1], ["1" * 64, "9" * 64]),
        ({A1, A2}, {A2}, {A1}, [], ["9" * 64]),
        ({A1, B1}, {B1}, set(), [A1], ["9" * 64]),  # content kept: B1 holds it
        ({A1, A2, C3}, set(), set(), [A1, A2, C3], ["1" * 64, "2" * 64, "3" * 64, "9" * 64]),
        ({A2}, {A1, A2}, set(), [], ["9" * 64]),  # A1's directory vanished: content kept
        (set(), set(), {A1}, [], ["9" * 64]),
    ],
    ids=[
        "old-revision",
        "old-revision-in-use",
        "shared-content",
        "all-deleted",
        "current-dir-missing",
        "in-use-not-on-disk",
    ],
)
def test_plan_gc(
    revisions: set[gc.RevisionRef],
    current: set[gc.RevisionRef],
    in_use: set[gc.RevisionRef],
    dropped_revisions: list[gc.RevisionRef],
    dropped_objects: list[str],
) -> None:
    snapshot = snap(revisions, current)
    if A1 in current and A1 not in revisions:
        snapshot = gc.VolumeSnapshot(
            snapshot.revisions, snapshot.current, snapshot.objects | {A1.sha256}
        )
    plan = gc.plan_gc(snapshot, in_use)
    assert list(plan.revisions) == sorted(dropped_revisions)
    assert list(plan.objects) == sorted(dropped_objects)


def test_empty_plan_is_falsy() -> None:
    assert not gc.plan_gc(gc.VolumeSnapshot(frozenset(), frozenset(), frozenset()), ())


async def _stage(
    store: staging.Store, root: Path, ns: str, name: str, data: bytes
) -> publishing.StagedRevision:
    path = root / layout.SHARED / f"{sha(data)}.safetensors"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return await store.stage(ns, name, sources.VolumeSource(path))


async def test_collect_on_a_real_volume(tmp_path: Path) -> None:
    store = staging.Store(tmp_path)
    old, new = lora_bytes(40), lora_bytes(41)
    first = await _stage(store, tmp_path, "ns", "a", old)
    await _stage(store, tmp_path, "other", "b", old)
    second = await _stage(store, tmp_path, "ns", "a", new)
    old_ref = gc.RevisionRef("ns", "a", first.sha256)

    # A pod still reports the old revision: nothing goes.
    plan, freed = await store.collect({old_ref})
    assert not plan and freed == 0
    assert first.path.is_dir()

    # No pod uses it any more: the revision goes, the content stays (other/b holds it).
    plan, freed = await store.collect(set())
    assert plan.revisions == (old_ref,) and plan.objects == () and freed == 0
    assert not first.path.exists() and second.path.is_dir()
    assert layout.object_path(tmp_path, sha(old)).is_file()

    # other/b is deleted: its revision, its directory and the last link to the content go.
    assert await store.unpublish("other", "b")
    plan, freed = await store.collect(set())
    assert freed == len(old)
    assert not layout.object_path(tmp_path, sha(old)).exists()
    assert not (tmp_path / "other" / "b").exists()
    assert layout.resolve_on_root(tmp_path / "ns", "a") == second.path
    assert list(layout.tmp_dir(tmp_path).iterdir()) == []
    assert volumefiles.scan_volume(tmp_path) == gc.VolumeSnapshot(
        frozenset({gc.RevisionRef("ns", "a", second.sha256)}),
        frozenset({gc.RevisionRef("ns", "a", second.sha256)}),
        frozenset({second.sha256}),
    )


async def test_restaging_after_collection_rebuilds(tmp_path: Path) -> None:
    store = staging.Store(tmp_path)
    data = lora_bytes(42)
    await _stage(store, tmp_path, "ns", "a", data)
    await store.unpublish("ns", "a")
    await store.collect(set())
    assert volumefiles.scan_volume(tmp_path).objects == frozenset()
    again = await _stage(store, tmp_path, "ns", "a", data)
    assert not again.reused and (again.path / layout.WEIGHTS_FILE).read_bytes() == data


async def test_collect_racing_stagings_never_breaks_a_current(tmp_path: Path) -> None:
    """Stagings (some pinned re-stages of collected content) interleaved with collections."""
    store = staging.Store(tmp_path, max_concurrent=4)
    blobs = [lora_bytes(50 + i) for i in range(4)]
    for blob in blobs:
        (tmp_path / layout.SHARED).mkdir(exist_ok=True)
        (tmp_path / layout.SHARED / f"{sha(blob)}.safetensors").write_bytes(blob)

    async def stage(i: int) -> publishing.StagedRevision:
        blob = blobs[i % len(blobs)]
        return await store.stage(
            "ns",
            f"a{i % 3}",
            sources.VolumeSource(tmp_path / layout.SHARED / f"{sha(blob)}.safetensors"),
            sha256=sha(blob) if i % 2 else None,
        )

    async def collect() -> None:
        for _ in range(10):
            await store.collect(set())
            await asyncio.sleep(0)

    results = await asyncio.gather(*(stage(i) for i in range(24)), collect())
    assert all(isinstance(r, publishing.StagedRevision) for r in results[:-1])
    await store.collect(set())
    for name in ("a0", "a1", "a2"):
        found = layout.resolve_on_root(tmp_path / "ns", name)
        assert found is not None
        digest = volumefiles.current_revision(tmp_path, "ns", name)
        assert digest is not None
        assert sha((found / layout.WEIGHTS_FILE).read_bytes()) == digest
    snapshot = volumefiles.scan_volume(tmp_path)
    assert snapshot.revisions == snapshot.current
    assert snapshot.objects == {r.sha256 for r in snapshot.current}
