"""Namespaces sharing one volume: a namespace gets bytes it fetched and verified itself, within
its quota (the store on a real temporary volume; the ledger's arithmetic alone:
test_quota.py)."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest
from lora_operator.edges import metrics
from lora_operator.rules import errors
from lora_operator.store import quota, sinks, sources, staging, volumefiles
from lora_volume import layout, stacks

from tests.support.loras import lora_bytes, sha
from tests.support.origin import Origin
from tests.support.staging import make_store, tmp_entries

SIZE = len(lora_bytes(0))  # every rank-4 file of lora_bytes has this size


def own_file(volume: Path, namespace: str, name: str, data: bytes) -> sources.VolumeSource:
    """A file in the namespace's own folder of the volume (where its sources may lie)."""
    path = volume / namespace / "src" / f"{name}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return sources.VolumeSource(path)


# ---- bytes only through one's own door


async def test_a_pinned_hash_of_another_namespaces_bytes_is_downloaded_not_granted(
    origin: Origin, tmp_path: Path
) -> None:
    private = lora_bytes(40)
    store = make_store(tmp_path)
    theirs = await store.stage("team-b", "private", own_file(tmp_path, "team-b", "p", private))
    pin = theirs.sha256
    # team-a names the hash with a source that has not got the bytes: the source is asked
    # (and refuses, or answers with other bytes), never the store.
    with pytest.raises(errors.SourceNotFound):
        await store.stage(
            "team-a", "stolen", sources.HttpsSource(origin.url("/nothing")), sha256=pin
        )
    assert origin.hits["/nothing"] == 1
    decoy = own_file(tmp_path, "team-a", "decoy", lora_bytes(41))
    with pytest.raises(errors.ChecksumMismatch):
        await store.stage("team-a", "stolen", decoy, sha256=pin)
    assert store.current_revision("team-a", "stolen") is None
    assert not (tmp_path / "team-a" / "stolen").exists()
    assert tmp_entries(tmp_path) == []
    # A source that really has the bytes: fetched and verified like any other, then linked to
    # the object already stored, not stored twice.
    url = origin.serve("/private.safetensors", private)
    mine = await store.stage("team-a", "mine", sources.HttpsSource(url), sha256=pin)
    assert origin.hits["/private.safetensors"] == 1
    assert mine.sha256 == pin and mine.reused
    assert os.path.samefile(mine.path / layout.WEIGHTS_FILE, layout.object_path(tmp_path, pin))
    # Now team-a holds them: another of its adapters pinning them downloads nothing.
    again = await store.stage("team-a", "again", sources.HttpsSource(url), sha256=pin)
    assert again.reused and origin.hits["/private.safetensors"] == 1


async def test_a_pinned_hash_is_downloaded_again_once_the_namespace_no_longer_holds_it(
    origin: Origin, tmp_path: Path
) -> None:
    data = lora_bytes(42)
    store = make_store(tmp_path)
    source = sources.HttpsSource(origin.serve("/w.safetensors", data))
    await store.stage("team-b", "keeps", own_file(tmp_path, "team-b", "w", data))
    await store.stage("team-a", "x", source, sha256=sha(data))
    await store.stage("team-a", "x", source, sha256=sha(data))  # held: no download
    assert origin.hits["/w.safetensors"] == 1
    await store.unpublish("team-a", "x")
    await store.collect(set())  # team-a's revision goes; team-b's keeps the object
    assert layout.object_path(tmp_path, sha(data)).is_file()
    await store.stage("team-a", "x", source, sha256=sha(data))
    assert origin.hits["/w.safetensors"] == 2


async def test_the_store_and_other_namespaces_stay_out_of_reach_of_volume_paths(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path)
    theirs = await store.stage("team-b", "p", own_file(tmp_path, "team-b", "p", lora_bytes(43)))
    shared = tmp_path / layout.SHARED
    shared.mkdir()
    # Links an admin's drop folder might hold, by mistake or by design: into another
    # namespace's revision, the store's object, the store's folder.
    (shared / "to-team-b.safetensors").symlink_to(theirs.path / layout.WEIGHTS_FILE)
    (shared / "to-object.safetensors").symlink_to(layout.object_path(tmp_path, theirs.sha256))
    (shared / "to-objects").symlink_to(tmp_path / layout.OBJECTS)
    for path in (
        shared / "to-team-b.safetensors",
        shared / "to-object.safetensors",
        shared / "to-objects" / "sha256" / f"{theirs.sha256}.safetensors",
        layout.object_path(tmp_path, theirs.sha256),
    ):
        with pytest.raises(errors.InvalidSource):
            await store.stage("team-a", "copy", sources.VolumeSource(path))
    assert not (tmp_path / "team-a").exists()


# ---- quota


async def test_a_namespace_over_its_quota_is_refused_and_another_still_stages(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path, namespace_quota=2 * SIZE + SIZE // 2)
    for i in range(2):
        await store.stage("team-a", f"a{i}", own_file(tmp_path, "team-a", f"a{i}", lora_bytes(i)))
    with pytest.raises(errors.QuotaExceeded) as e:
        await store.stage("team-a", "a2", own_file(tmp_path, "team-a", "a2", lora_bytes(2)))
    assert not e.value.permanent and e.value.degrades_at_once
    used, limit = quota.size(2 * SIZE), quota.size(2 * SIZE + SIZE // 2)
    assert f"namespace team-a uses {used} of its {limit} quota" in str(e.value)
    assert store.current_revision("team-a", "a2") is None
    assert not layout.object_path(tmp_path, sha(lora_bytes(2))).exists()
    assert tmp_entries(tmp_path) == []
    # team-b's quota is its own: it stages and publishes as if team-a were not there.
    for i in range(2):
        source = own_file(tmp_path, "team-b", f"b{i}", lora_bytes(10 + i))
        b = await store.stage("team-b", f"b{i}", source)
        assert store.current_revision("team-b", f"b{i}") == b.sha256
    assert {ns: u.total for ns, u in store.usage().items()} == {
        "team-a": 2 * SIZE,
        "team-b": 2 * SIZE,
    }


async def test_shared_bytes_count_once_per_namespace_and_in_each_namespace_that_holds_them(
    tmp_path: Path,
) -> None:
    data = lora_bytes(44)
    store = make_store(tmp_path, namespace_quota=2 * SIZE)
    source = own_file(tmp_path, "team-a", "w", data)
    await store.stage("team-a", "one", source)
    await store.stage("team-a", "two", source)  # the same file again: nothing more
    await store.stage("team-b", "three", own_file(tmp_path, "team-b", "w", data))
    assert {ns: u.total for ns, u in store.usage().items()} == {"team-a": SIZE, "team-b": SIZE}
    await store.stage("team-a", "four", own_file(tmp_path, "team-a", "v", lora_bytes(45)))
    assert store.usage()["team-a"].total == 2 * SIZE
    # Full, yet what it holds already it may publish again, under any name, by its pin.
    pinned = await store.stage("team-a", "five", source, sha256=sha(data))
    assert pinned.reused and store.usage()["team-a"].total == 2 * SIZE
    # Without the pin the bytes are unknown until downloaded, and a download needs room.
    for new in (source, own_file(tmp_path, "team-a", "u", lora_bytes(46))):
        with pytest.raises(errors.QuotaExceeded):
            await store.stage("team-a", "six", new)


async def test_a_full_namespace_may_stage_an_adapters_source_again_but_no_new_content(
    origin: Origin, tmp_path: Path
) -> None:
    """A changed spec (a scale, a selector) stages an unpinned source again: at the quota, its
    download may repeat the current revision's size, and publishing decides exactly."""
    store = make_store(tmp_path, namespace_quota=SIZE)
    old, new = lora_bytes(54), lora_bytes(55)
    source = sources.HttpsSource(origin.serve("/w.safetensors", old))
    first = await store.stage("team-a", "x", source)
    again = await store.stage("team-a", "x", source)  # the same bytes: nothing added
    assert again.sha256 == first.sha256 and origin.hits["/w.safetensors"] == 2
    origin.serve("/w.safetensors", new)  # the source now serves other bytes
    with pytest.raises(errors.QuotaExceeded, match="needs"):
        await store.stage("team-a", "x", source)
    assert store.current_revision("team-a", "x") == first.sha256  # its pods keep it
    assert store.usage()["team-a"] == quota.Usage(SIZE, 0)
    assert tmp_entries(tmp_path) == []
    # Another adapter gets no such credit.
    with pytest.raises(errors.QuotaExceeded):
        await store.stage("team-a", "y", source)


async def test_an_adapter_over_the_quota_stages_once_the_namespace_frees_some(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path, namespace_quota=SIZE)
    await store.stage("team-a", "old", own_file(tmp_path, "team-a", "old", lora_bytes(53)))
    new = own_file(tmp_path, "team-a", "new", lora_bytes(47))
    with pytest.raises(errors.QuotaExceeded):
        await store.stage("team-a", "new", new)
    await store.unpublish("team-a", "old")
    with pytest.raises(errors.QuotaExceeded):  # unpublished, not collected: still held
        await store.stage("team-a", "new", new)
    await store.collect(set())
    assert store.usage()["team-a"].total == 0
    staged = await store.stage("team-a", "new", new)
    assert store.current_revision("team-a", "new") == staged.sha256
    assert store.usage()["team-a"].total == SIZE


async def test_downloads_in_progress_count_so_parallel_stagings_cannot_overcommit(
    tmp_path: Path,
) -> None:
    """Two downloads of one namespace at once, room for one: the second stops at the chunk
    that passes the quota, while the first has it reserved; the first publishes."""
    first_data, second_data = lora_bytes(48), lora_bytes(49)
    halfway, go_on = asyncio.Event(), asyncio.Event()
    written: dict[str, int] = {}

    async def fetch(
        source: sources.Source, credentials: sources.Credentials, sink: sinks.Sink
    ) -> None:
        first = source == sources.HttpsSource("https://example.com/first")
        data = first_data if first else second_data
        for i in range(0, len(data), 100):
            sink.write(data[i : i + 100])
            written[sources.describe(source)] = sink.size
            if first and i + 200 >= len(data) and not halfway.is_set():
                halfway.set()  # the first is all but written: the second has no room
                await go_on.wait()

    store = staging.Store(tmp_path, fetch=fetch, namespace_quota=SIZE + SIZE // 2)
    first = asyncio.create_task(
        store.stage("team-a", "first", sources.HttpsSource("https://example.com/first"))
    )
    await halfway.wait()
    with pytest.raises(errors.QuotaExceeded, match="downloads in progress"):
        await store.stage("team-a", "second", sources.HttpsSource("https://example.com/second"))
    assert written["https://example.com/second"] < len(second_data)  # stopped early
    # The first one's, what it has written; the second one's reservation is gone.
    assert store.usage()["team-a"].downloading == written["https://example.com/first"]
    go_on.set()
    staged = await first
    assert store.current_revision("team-a", "first") == staged.sha256
    assert store.usage()["team-a"] == quota.Usage(SIZE, 0)


async def test_a_source_announcing_more_than_the_quota_leaves_is_refused_before_its_body(
    tmp_path: Path,
) -> None:
    bodies: list[str] = []

    async def fetch(
        source: sources.Source, credentials: sources.Credentials, sink: sinks.Sink
    ) -> None:
        sink.expect(3 * SIZE)  # Content-Length, before any byte of the body is read
        bodies.append(sources.describe(source))

    store = staging.Store(tmp_path, fetch=fetch, namespace_quota=2 * SIZE)
    with pytest.raises(errors.QuotaExceeded, match=re.escape(f"needs {quota.size(3 * SIZE)} more")):
        await store.stage("team-a", "big", sources.HttpsSource("https://example.com/big"))
    assert bodies == [] and store.usage()["team-a"].total == 0


async def test_a_composition_adds_only_its_manifest(tmp_path: Path) -> None:
    store = make_store(tmp_path, namespace_quota=2 * SIZE + 10)
    staged = [
        await store.stage("team-a", n, own_file(tmp_path, "team-a", n, lora_bytes(50 + i)))
        for i, n in enumerate(("a", "b"))
    ]
    entries = [stacks.StackEntry(s.name, s.sha256, 1.0) for s in staged]
    with pytest.raises(errors.QuotaExceeded, match="needs"):  # the manifest does not fit
        await store.stage_composition("team-a", "ab", entries)
    store.ledger.limit = 3 * SIZE
    duo = await store.stage_composition("team-a", "ab", entries)
    manifest = (duo.path / stacks.STACK_FILE).stat().st_size
    assert store.usage()["team-a"].total == 2 * SIZE + manifest


async def test_usage_is_read_from_the_volume_and_reported_as_metrics(tmp_path: Path) -> None:
    await make_store(tmp_path).stage(
        "team-a", "w", own_file(tmp_path, "team-a", "w", lora_bytes(52))
    )
    # Another process (a restarted operator, the replica that takes over) reads it back.
    gauges = metrics.Metrics()
    store = make_store(tmp_path, on_usage=gauges.set_namespace_usage)
    assert store.clean_tmp() == 0
    assert gauges.registry.get_sample_value(
        "lora_operator_namespace_volume_bytes", {"namespace": "team-a"}
    ) == float(SIZE)
    assert volumefiles.held_objects(tmp_path) == {
        "team-a": volumefiles.revision_files(
            layout.revision_dir(tmp_path / "team-a", "w", sha(lora_bytes(52)))
        )
    }
    await store.unpublish("team-a", "w")
    await store.collect(set())
    assert (
        gauges.registry.get_sample_value(
            "lora_operator_namespace_volume_bytes", {"namespace": "team-a"}
        )
        is None
    )
    gauges.set_namespace_quota(5 * SIZE)
    assert gauges.registry.get_sample_value("lora_operator_namespace_quota_bytes") == 5 * SIZE
    gauges.set_namespace_quota(None)
    assert gauges.registry.get_sample_value("lora_operator_namespace_quota_bytes") == float("inf")
