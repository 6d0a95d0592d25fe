"""Staging from a path already on the volume, and what a real kill mid-staging leaves behind."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from lora_operator.rules import errors
from lora_operator.store import sinks, sources, staging, volumefiles
from lora_volume import description, files, formats, layout, stacks, targeting

from tests.support.loras import lora_bytes, sha
from tests.support.staging import NS, make_store, tmp_entries, visible


def shared(volume: Path) -> Path:
    """The volume's folder every namespace may copy from (an admin's drop folder)."""
    folder = volume / layout.SHARED
    folder.mkdir(exist_ok=True)
    return folder


async def test_copy_from_a_file_on_the_volume(tmp_path: Path) -> None:
    data = lora_bytes(20)
    incoming = shared(tmp_path) / "incoming"
    incoming.mkdir()
    (incoming / "pixel.safetensors").write_bytes(data)
    staged = await staging.Store(tmp_path).stage(
        NS, "pixel", sources.parse_source(str(incoming / "pixel.safetensors"))
    )
    assert staged.sha256 == sha(data)
    found = layout.resolve_on_root(layout.namespace_root(tmp_path, NS), "pixel")
    assert found is not None
    assert files.find_weights_file(found).read_bytes() == data


async def test_copy_from_an_adapter_directory(tmp_path: Path) -> None:
    data = lora_bytes(21)
    adapter = shared(tmp_path) / "incoming" / "peft"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(data)
    (adapter / "adapter_config.json").write_text("{}")
    staged = await staging.Store(tmp_path).stage(NS, "p", sources.VolumeSource(adapter))
    assert staged.sha256 == sha(data)


async def test_path_outside_the_volume_refused(tmp_path: Path) -> None:
    volume, outside = tmp_path / "volume", tmp_path / "outside"
    volume.mkdir()
    outside.mkdir()
    (outside / "w.safetensors").write_bytes(lora_bytes(22))
    (volume / "sneaky.safetensors").symlink_to(outside / "w.safetensors")
    store = staging.Store(volume)
    for path in (outside / "w.safetensors", volume / "sneaky.safetensors"):
        with pytest.raises(errors.InvalidSource, match="outside the allowed roots") as e:
            await store.stage(NS, "x", sources.VolumeSource(path))
        assert e.value.permanent
    assert visible(volume) == ["sneaky.safetensors"]


async def test_missing_path_and_store_internals(tmp_path: Path) -> None:
    store = staging.Store(tmp_path)
    with pytest.raises(errors.SourceNotFound, match="does not exist"):
        await store.stage(NS, "x", sources.VolumeSource(shared(tmp_path) / "nope.safetensors"))
    data = lora_bytes(23)
    (shared(tmp_path) / "w.safetensors").write_bytes(data)
    await store.stage(NS, "x", sources.VolumeSource(shared(tmp_path) / "w.safetensors"))
    with pytest.raises(errors.InvalidSource, match="outside this namespace's folder"):
        await store.stage(NS, "y", sources.VolumeSource(layout.object_path(tmp_path, sha(data))))


def test_a_killed_staging_leaves_only_a_temp_file(tmp_path: Path) -> None:
    data = lora_bytes(24, rank=256)
    (shared(tmp_path) / "w.safetensors").write_bytes(data)
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from pathlib import Path
        from lora_operator.store import sources, staging

        def die(size: int) -> None:
            if size:  # once it has written: no cleanup, no finally, as if the pod were killed
                os._exit(9)

        asyncio.run(staging.Store(Path({str(tmp_path)!r})).stage(
            {NS!r}, "x", sources.VolumeSource(Path({str(shared(tmp_path) / "w.safetensors")!r})),
            progress=die,
        ))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()
    assert visible(tmp_path) == ["_shared", "_shared/w.safetensors"]
    assert len(tmp_entries(tmp_path)) == 1
    assert volumefiles.clean_tmp(tmp_path) == 1
    assert tmp_entries(tmp_path) == []


async def test_restart_after_a_kill_completes(tmp_path: Path) -> None:
    data = lora_bytes(25)
    (shared(tmp_path) / "w.safetensors").write_bytes(data)
    layout.tmp_dir(tmp_path).mkdir()
    (layout.tmp_dir(tmp_path) / "download-left.part").write_bytes(data[:10])
    (layout.tmp_dir(tmp_path) / "revision-left").mkdir()
    assert volumefiles.clean_tmp(tmp_path) == 2
    staged = await staging.Store(tmp_path).stage(
        NS, "x", sources.VolumeSource(shared(tmp_path) / "w.safetensors")
    )
    assert volumefiles.current_revision(tmp_path, NS, "x") == staged.sha256


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_volume_is_transient() -> None:
    with (
        open("/dev/full", "wb", buffering=0) as f,
        sinks.Sink(f, max_bytes=1 << 20, description="x") as sink,
        pytest.raises(errors.DiskFull, match="volume is full") as e,
    ):
        sink.write(b"\0" * 4096)
        sink.finish()  # the write fails on the sink's thread, and says so here at the latest
    assert not e.value.permanent


def test_the_sink_keeps_each_chunk_as_it_was_when_the_caller_reuses_its_buffer(
    tmp_path: Path,
) -> None:
    buffer = bytearray(1000)
    expected = hashlib.sha256()
    with (
        (tmp_path / "f").open("w+b") as f,
        sinks.Sink(f, max_bytes=1 << 30, description="x") as sink,
    ):
        for i in range(5000):  # past a batch: handed over to the sink's thread
            buffer[:] = bytes([i % 256]) * 1000
            sink.write(bytes(buffer))
            expected.update(buffer)
        assert sink.finish() == expected.hexdigest()
    assert (tmp_path / "f").read_bytes()[-1000:] == bytes([4999 % 256]) * 1000


def test_a_closed_sink_stops_a_fetcher_that_still_writes(tmp_path: Path) -> None:
    with (tmp_path / "f").open("w+b") as f:
        with sinks.Sink(f, max_bytes=1 << 20, description="x") as sink:
            sink.write(b"\0" * 100)
        with pytest.raises(errors.SourceUnavailable, match="stopped"):
            sink.write(b"\0" * 100)


async def test_another_namespaces_folder_is_out_of_reach(tmp_path: Path) -> None:
    data = lora_bytes(26)
    (shared(tmp_path) / "w.safetensors").write_bytes(data)
    store = staging.Store(tmp_path)
    theirs = await store.stage(
        "team-b", "secret", sources.VolumeSource(shared(tmp_path) / "w.safetensors")
    )
    current = layout.current_link(tmp_path / "team-b", "secret")
    dropped = tmp_path / "team-b" / "src" / "w.safetensors"  # a file team-b's pods can read
    dropped.parent.mkdir(parents=True)
    dropped.write_bytes(data)
    loose = tmp_path / "loose.safetensors"  # top level: neither a namespace nor _shared/
    loose.write_bytes(data)
    for path in (current, theirs.path / layout.WEIGHTS_FILE, dropped, loose):
        with pytest.raises(errors.InvalidSource, match="outside this namespace's folder"):
            await store.stage("team-a", "copy", sources.VolumeSource(path))
    mine = await store.stage("team-b", "copy", sources.VolumeSource(current))
    assert mine.sha256 == theirs.sha256


async def test_the_target_is_published_before_current_and_follows_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (shared(tmp_path) / "w.safetensors").write_bytes(lora_bytes(1))
    source = sources.VolumeSource(shared(tmp_path) / "w.safetensors")
    ns_root = layout.namespace_root(tmp_path, NS)
    gpu = targeting.Target("sd", targeting.parse_selector({"matchLabels": {"tier": "gpu"}}))
    seen_first: list[targeting.Target | None] = []
    point_current = volumefiles.point_current

    def checking(volume_root: Path, ns: Path, name: str, digest: str) -> None:
        seen_first.append(layout.read_target(ns, name))
        point_current(volume_root, ns, name, digest)

    monkeypatch.setattr(volumefiles, "point_current", checking)
    store = make_store(tmp_path)
    await store.stage(NS, "x", source, target=gpu)
    assert seen_first == [gpu]
    assert layout.read_target(ns_root, "x") == gpu
    # A selector change with the same weights: the target alone is replaced.
    cpu = targeting.Target("sd", targeting.parse_selector({"matchLabels": {"tier": "cpu"}}))
    assert store.publish_target(NS, "x", cpu) is True
    assert store.publish_target(NS, "x", cpu) is False  # unchanged: nothing written
    assert layout.read_target(ns_root, "x") == cpu
    assert tmp_entries(tmp_path) == []
    # Unpublished: neither `current` nor the target, and the leftover directory is not
    # mistaken for a hand-filled adapter.
    assert await store.unpublish(NS, "x")
    assert layout.read_target(ns_root, "x") is None
    assert layout.resolve_on_root(ns_root, "x") is None
    assert store.publish_target(NS, "x", cpu) is False  # nothing to describe


async def test_every_staged_revision_says_what_its_file_declares(tmp_path: Path) -> None:
    """Fresh, reused from the store, composed, or read again later: the same description."""
    store = staging.Store(tmp_path)
    incoming = shared(tmp_path)
    words = {"modelspec.trigger_phrase": "pixel, 8bit"}
    (incoming / "a.safetensors").write_bytes(lora_bytes(30, rank=4, metadata=words))
    (incoming / "b.safetensors").write_bytes(lora_bytes(31, rank=8))
    a = await store.stage(NS, "a", sources.VolumeSource(incoming / "a.safetensors"))
    assert a.adapter == description.Description(formats.LORA, 4, ("unet",), ("pixel", "8bit"))
    again = await store.stage(
        NS, "a2", sources.VolumeSource(incoming / "a.safetensors"), sha256=a.sha256
    )
    assert again.reused and again.adapter == a.adapter
    b = await store.stage(NS, "b", sources.VolumeSource(incoming / "b.safetensors"))
    stack = await store.stage_composition(
        NS, "ab", [stacks.StackEntry("b", b.sha256, 1.0), stacks.StackEntry("a", a.sha256, 0.5)]
    )
    # Members in the manifest's (name) order: a's words first; ranks add up.
    assert stack.adapter == description.Description(
        description.STACK, 12, ("unet",), ("pixel", "8bit")
    )
    assert store.describe_current(NS, "ab") == stack.adapter
    assert store.describe_current(NS, "a") == a.adapter
    assert store.describe_current(NS, "never-staged") is None
