"""Staging from a real HTTP server on 127.0.0.1 onto a real directory: the whole store path."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from lora_operator.rules import errors
from lora_operator.store import publishing, sinks, sources, staging, volumefiles
from lora_volume import files, layout

from tests.support.loras import lora_bytes, not_lora_bytes, sha
from tests.support.origin import Origin
from tests.support.staging import NS, make_store, tmp_entries, visible


async def test_stage_publishes_what_the_server_reads(origin: Origin, tmp_path: Path) -> None:
    data = lora_bytes(1)
    url = origin.serve("/a/pixel.safetensors", data)
    seen: list[int] = []
    staged = await make_store(tmp_path).stage(
        NS, "pixel", sources.HttpsSource(url), sha256=sha(data), progress=seen.append
    )
    assert staged.sha256 == sha(data)
    assert staged.size == len(data)
    assert not staged.reused
    assert seen[-1] == len(data)
    ns_root = layout.namespace_root(tmp_path, NS)
    assert staged.path == layout.revision_dir(ns_root, "pixel", sha(data))
    # The reader's contract: the server's resolver and file finder land on the weights.
    resolved = layout.resolve_on_root(ns_root, "pixel")
    assert resolved == staged.path
    weights = files.find_weights_file(resolved)
    assert weights.name == layout.WEIGHTS_FILE
    assert weights.read_bytes() == data
    assert os.readlink(layout.current_link(ns_root, "pixel")) == f"revisions/{sha(data)}"
    assert weights.stat().st_ino == layout.object_path(tmp_path, sha(data)).stat().st_ino
    assert tmp_entries(tmp_path) == []
    assert volumefiles.current_revision(tmp_path, NS, "pixel") == sha(data)


async def test_404_is_permanent_and_publishes_nothing(origin: Origin, tmp_path: Path) -> None:
    with pytest.raises(errors.SourceNotFound, match="HTTP 404") as e:
        await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(origin.url("/nope")))
    assert e.value.permanent
    assert visible(tmp_path) == []
    assert tmp_entries(tmp_path) == []
    assert origin.hits["/nope"] == 1  # not retried


async def test_500_then_success_is_retried(origin: Origin, tmp_path: Path) -> None:
    data = lora_bytes(2)

    async def flaky(request: web.Request) -> web.StreamResponse:
        if origin.hits["/flaky"] < 2:
            raise web.HTTPInternalServerError()
        return web.Response(body=data)

    origin.routes["/flaky"] = flaky
    staged = await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(origin.url("/flaky")))
    assert staged.sha256 == sha(data)
    assert origin.hits["/flaky"] == 2


async def test_500_forever_is_transient(origin: Origin, tmp_path: Path) -> None:
    async def down(request: web.Request) -> web.StreamResponse:
        raise web.HTTPServiceUnavailable()

    origin.routes["/down"] = down
    with pytest.raises(errors.SourceUnavailable, match="after 3 attempts") as e:
        await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(origin.url("/down")))
    assert not e.value.permanent
    assert origin.hits["/down"] == 3
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


@pytest_asyncio.fixture
async def lying_server() -> AsyncIterator[str]:
    """Announces 1000 bytes, sends 100, closes: a truncated body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = lora_bytes(3)[:100]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/w.safetensors"
    finally:
        server.close()
        await server.wait_closed()


async def test_truncated_body_is_detected(lying_server: str, tmp_path: Path) -> None:
    with pytest.raises(errors.SourceUnavailable, match="after 3 attempts"):
        await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(lying_server))
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_checksum_mismatch(origin: Origin, tmp_path: Path) -> None:
    url = origin.serve("/w.safetensors", lora_bytes(4))
    with pytest.raises(errors.ChecksumMismatch, match="fix the pin") as e:
        await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(url), sha256="0" * 64)
    assert e.value.permanent
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_pickle_refused_by_name_without_download(origin: Origin, tmp_path: Path) -> None:
    url = origin.serve("/pytorch_lora_weights.bin", b"\x80\x04pickle")
    with pytest.raises(errors.PickleRefused):
        await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(url))
    assert origin.hits == {}


async def test_pickle_content_under_a_safetensors_name(origin: Origin, tmp_path: Path) -> None:
    url = origin.serve("/w.safetensors", b"\x80\x04\x95" + b"\x00" * 64)
    with pytest.raises(errors.NotALora, match="not a valid safetensors"):
        await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(url))
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_non_lora_safetensors(origin: Origin, tmp_path: Path) -> None:
    url = origin.serve("/full.safetensors", not_lora_bytes())
    with pytest.raises(errors.NotALora, match="not part of a LoRA"):
        await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(url))
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_size_limit_mid_download(origin: Origin, tmp_path: Path) -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # chunked: no Content-Length to refuse up front
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(b"\x00" * 4096)
        return resp

    origin.routes["/big.safetensors"] = endless
    seen: list[int] = []
    with pytest.raises(errors.TooLarge, match="staging limit of 10000 bytes") as e:
        await make_store(tmp_path, max_bytes=10_000).stage(
            NS, "x", sources.HttpsSource(origin.url("/big.safetensors")), progress=seen.append
        )
    assert e.value.permanent
    assert all(size <= 10_000 for size in seen)  # never past the limit on disk
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_declared_size_over_limit_refused_up_front(origin: Origin, tmp_path: Path) -> None:
    url = origin.serve("/w.safetensors", lora_bytes(5))
    seen: list[int] = []
    with pytest.raises(errors.TooLarge):
        await make_store(tmp_path, max_bytes=100).stage(
            NS, "x", sources.HttpsSource(url), progress=seen.append
        )
    assert seen == [0]  # the download began, and wrote nothing


async def test_same_content_for_two_adapters_is_stored_once(origin: Origin, tmp_path: Path) -> None:
    data = lora_bytes(6)
    store = make_store(tmp_path)
    one = await store.stage(NS, "one", sources.HttpsSource(origin.serve("/1", data)))
    two = await store.stage("team-b", "two", sources.HttpsSource(origin.serve("/2", data)))
    assert not one.reused and two.reused
    inode = layout.object_path(tmp_path, sha(data)).stat().st_ino
    for staged in (one, two):
        assert (staged.path / layout.WEIGHTS_FILE).stat().st_ino == inode
    assert len(list((tmp_path / layout.OBJECTS / "sha256").iterdir())) == 1


async def test_restaging_a_pinned_revision_downloads_nothing(
    origin: Origin, tmp_path: Path
) -> None:
    data = lora_bytes(7)
    url = origin.serve("/w.safetensors", data)
    store = make_store(tmp_path)
    first = await store.stage(NS, "x", sources.HttpsSource(url), sha256=sha(data))
    again = await store.stage(NS, "x", sources.HttpsSource(url), sha256=sha(data))
    assert again == publishing.StagedRevision(**{**first.__dict__, "reused": True})
    assert origin.hits["/w.safetensors"] == 1


async def test_update_moves_current_and_keeps_the_old_revision(
    origin: Origin, tmp_path: Path
) -> None:
    old, new = lora_bytes(8), lora_bytes(9)
    store = make_store(tmp_path)
    first = await store.stage(NS, "x", sources.HttpsSource(origin.serve("/old", old)))
    second = await store.stage(NS, "x", sources.HttpsSource(origin.serve("/new", new)))
    ns_root = layout.namespace_root(tmp_path, NS)
    assert layout.resolve_on_root(ns_root, "x") == second.path
    assert (first.path / layout.WEIGHTS_FILE).read_bytes() == old  # untouched under its pods
    assert volumefiles.current_revision(tmp_path, NS, "x") == sha(new)
    # Only the second left a revision that may be unused (the stager collects after it alone).
    assert (first.superseded, second.superseded) == (False, True)
    same = await store.stage(NS, "x", sources.HttpsSource(origin.url("/new")))
    assert (same.sha256, same.superseded) == (second.sha256, False)


async def test_authorization_from_the_secret(origin: Origin, tmp_path: Path) -> None:
    data = lora_bytes(10)

    async def guarded(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != "Bearer right":
            raise web.HTTPForbidden()
        return web.Response(body=data)

    origin.routes["/private.safetensors"] = guarded
    source = sources.HttpsSource(origin.url("/private.safetensors"))
    store = make_store(tmp_path)
    with pytest.raises(errors.SourceForbidden, match="AUTHORIZATION") as e:
        creds = sources.credentials_from_secret({"AUTHORIZATION": "Bearer wrong"})
        await store.stage(NS, "x", source, credentials=creds)
    assert "wrong" not in str(e.value)
    creds = sources.credentials_from_secret({"AUTHORIZATION": "Bearer right"})
    staged = await store.stage(NS, "x", source, credentials=creds)
    assert staged.sha256 == sha(data)


async def test_failure_in_progress_leaves_nothing(origin: Origin, tmp_path: Path) -> None:
    url = origin.serve("/w.safetensors", lora_bytes(11, rank=64))

    class Killed(Exception):
        pass

    def die(size: int) -> None:
        if not size:
            return  # the download begins: fail once it has written
        assert visible(tmp_path) == []
        assert len(tmp_entries(tmp_path)) == 1  # the download lives only in .tmp/
        raise Killed

    with pytest.raises(Killed):
        await make_store(tmp_path).stage(NS, "x", sources.HttpsSource(url), progress=die)
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_a_cancelled_staging_stops_downloading(origin: Origin, tmp_path: Path) -> None:
    """The download runs on a worker thread; cancelling the staging (a new spec, a deletion)
    must end it too, not leave it reading the rest of the file."""
    disconnected = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            for _ in range(2000):  # 20 s: longer than the test waits for the disconnect
                await resp.write(b"\0" * 65536)
                await asyncio.sleep(0.01)
        except (ConnectionError, RuntimeError):  # aiohttp says so either way
            loop.call_soon_threadsafe(disconnected.set)
            raise
        return resp

    origin.routes["/endless.safetensors"] = endless
    started = asyncio.Event()

    def progress(n: int) -> None:  # runs on the fetcher's thread
        if n > 1 << 20:
            loop.call_soon_threadsafe(started.set)

    task = asyncio.create_task(
        make_store(tmp_path).stage(
            NS, "x", sources.HttpsSource(origin.url("/endless.safetensors")), progress=progress
        )
    )
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(disconnected.wait(), 10)
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_concurrency_limit(tmp_path: Path) -> None:
    data = lora_bytes(12)
    running = 0
    peak = 0

    async def slow_fetch(
        source: sources.Source, creds: sources.Credentials, sink: sinks.Sink
    ) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        sink.write(data)
        running -= 1

    store = staging.Store(tmp_path, max_concurrent=2, fetch=slow_fetch)
    await asyncio.gather(
        *(store.stage(NS, f"a{i}", sources.HttpsSource("https://h/x")) for i in range(6))
    )
    assert peak == 2
    assert len(list((tmp_path / layout.OBJECTS / "sha256").iterdir())) == 1


async def test_invalid_names_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for ns, name in (("../etc", "x"), ("ns", "a/b"), ("ns", ".objects")):
        with pytest.raises(errors.InvalidSource):
            await store.stage(ns, name, sources.HttpsSource("https://h/x"))


async def test_hf_file_with_revision_and_token(origin: Origin, tmp_path: Path) -> None:
    """hf:// with a file goes through huggingface_hub's URL scheme, here against a local Hub."""
    data = lora_bytes(13)

    async def hub(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != "Bearer hf_secret":
            raise web.HTTPUnauthorized()
        return web.Response(body=data)

    origin.routes["/org/repo/resolve/v1.0/pytorch_lora_weights.safetensors"] = hub
    store = make_store(tmp_path, hf_endpoint=origin.base)
    source = sources.parse_source("hf://org/repo/pytorch_lora_weights.safetensors", "v1.0")
    with pytest.raises(errors.SourceForbidden, match="HF_TOKEN"):
        await store.stage(NS, "x", source)
    creds = sources.credentials_from_secret({"HF_TOKEN": "hf_secret"})
    staged = await store.stage(NS, "x", source, credentials=creds)
    assert staged.sha256 == sha(data)
    with pytest.raises(errors.SourceNotFound):
        await store.stage(NS, "x", sources.parse_source("hf://org/repo/nope.safetensors"))


async def test_a_compressing_server_sends_the_file_as_is(origin: Origin, tmp_path: Path) -> None:
    data = lora_bytes(14, rank=64)

    async def compressing(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=data)
        resp.enable_compression()  # gzip whenever the client accepts it
        return resp

    origin.routes["/gz.safetensors"] = compressing
    staged = await make_store(tmp_path).stage(
        NS, "x", sources.HttpsSource(origin.url("/gz.safetensors")), sha256=sha(data)
    )
    assert staged.size == len(data)
