"""Admission over real HTTP on 127.0.0.1: file reads stay off the event loop, one name at a time.

A read is slowed through our own seams (`files.read_adapter_config`, `layout.resolve_on_root`):
the patched function blocks its thread until the test lets it go. Run on the event loop, as the
engine once did, it would stall every answer until its timeout, and these tests would fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lora_volume import files, layout

from tests.unit.inference.conftest import Assets, Server, Stall, publish


@pytest.fixture
def stalled_config_read(monkeypatch: pytest.MonkeyPatch, assets: Assets) -> Iterator[Stall]:
    """`adapter_config.json` of `assets.adapter_a` reads slowly; every other read is untouched."""
    stall = Stall(
        files.read_adapter_config,
        lambda args: Path(args[0]).resolve() == assets.adapter_a.resolve(),
    )
    monkeypatch.setattr(files, "read_adapter_config", stall)
    yield stall
    stall.release()


async def answers_while_stalled(server: Server, stall: Stall) -> None:
    """/health, /v1/models and a base-model image all answer while `stall` holds its read."""
    await stall.wait_started()
    status, _ = await server.get("/health")
    assert status == 200
    status, _ = await server.get("/v1/models")
    assert status == 200
    await server.image()
    assert not stall.finished.is_set(), "the server answered only after the read finished"


async def test_a_slow_adapter_config_read_does_not_block_the_server(
    server: Server, assets: Assets, stalled_config_read: Stall
) -> None:
    load = asyncio.create_task(server.load("slow", assets.adapter_a))
    try:
        await answers_while_stalled(server, stalled_config_read)
    finally:
        stalled_config_read.release()
    await load
    assert server.engine.registry.get("slow") is not None


async def test_a_slow_adapter_root_lookup_does_not_block_the_server(
    start_server: Any, assets: Assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "volume"
    publish(root, "pixel", assets.adapter_a)
    server = await start_server(adapter_root=root, allowed_roots=(assets.root,))
    stall = Stall(layout.resolve_on_root, lambda args: args[1] == "pixel")
    monkeypatch.setattr(layout, "resolve_on_root", stall)
    resolving = asyncio.create_task(server.image(model="pixel"))
    try:
        await answers_while_stalled(server, stall)
    finally:
        stall.release()
    await resolving
    assert server.engine.registry.get("pixel").origin == "resolver"


async def test_concurrent_loads_of_one_name_register_it_once(
    server: Server, assets: Assets, stalled_config_read: Stall
) -> None:
    """The second load waits for the first one's read, then sees its record: a 400, one parse."""
    body = {"lora_name": "same", "lora_path": str(assets.adapter_a)}
    parses = server.metric("lora_adapter_load_seconds_count", tier="cpu")
    first = asyncio.create_task(server.post("/v1/load_lora_adapter", body))
    await stalled_config_read.wait_started()
    second = asyncio.create_task(
        server.post("/v1/load_lora_adapter", body | {"lora_path": str(assets.adapter_b)})
    )
    await asyncio.sleep(0.2)  # the second load is well under way, waiting for the name
    assert not second.done()
    stalled_config_read.release()
    (status_1, _), (status_2, answer_2) = await first, await second
    assert (status_1, status_2) == (200, 400)
    assert "already loaded" in answer_2["error"]["message"]
    record = server.engine.registry.get("same")
    assert record.path == assets.adapter_a.resolve()
    assert server.metric("lora_adapter_load_seconds_count", tier="cpu") == parses + 1


async def test_a_stalled_read_of_one_name_does_not_hold_up_another(
    server: Server, assets: Assets, stalled_config_read: Stall
) -> None:
    slow = asyncio.create_task(server.load("slow", assets.adapter_a))
    try:
        await stalled_config_read.wait_started()
        await server.load("other", assets.adapter_b)
        assert not stalled_config_read.finished.is_set()
    finally:
        stalled_config_read.release()
    await slow
    assert {r.name for r in server.engine.registry.records()} == {"slow", "other"}


async def test_a_file_changed_since_its_load_is_reported_not_waited_for(
    start_server: Any, assets: Assets, tmp_path: Path
) -> None:
    """The read ahead of `a` finds other bytes than were loaded: the request for it gets the
    error (a 422 naming the change) instead of waiting for a read that can never succeed."""
    import shutil

    moved = tmp_path / "a"
    shutil.copytree(assets.adapter_a, moved)
    server = await start_server(
        max_loras=1, max_cpu_loras=1, max_batch_size=1, allowed_roots=(assets.root, tmp_path)
    )
    await server.load("a", moved)
    await server.load("b", assets.adapter_b)  # the CPU tier holds one parse: a's goes
    weights = moved / "pytorch_lora_weights.safetensors"
    shutil.copy(assets.adapter_b / "pytorch_lora_weights.safetensors", weights)
    body = {"model": "a", "prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2}
    async with asyncio.timeout(60):
        status, answer = await server.post("/v1/images/generations", body, token=None)
    assert status == 422 and "changed since it was loaded" in answer["error"]["message"]
    await server.image()  # the worker goes on
