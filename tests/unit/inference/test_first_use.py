"""A first use stays off the critical path: batches of resident adapters never wait for another
adapter's file to be read, and queued requests' adapters are read while a batch runs.

Over real HTTP on 127.0.0.1 around the tiny pipeline. A read (`parse_adapter`) or a pipeline
call (`run_batch`) is slowed through the backend's seam: the patched method blocks its thread
until the test lets it go (`Stall`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.unit.inference.conftest import STALL_S, Assets, Server, Stall, publish

# Turns of the event loop a queued request may wait before the worker takes it into a batch:
# a worker that takes it at once needs one or two, a worker that holds the batch for anything
# (a read, a timer) needs as many as that lasts.
TURNS = 20


def stall_reads_of(server: Server, adapter: Path, monkeypatch: pytest.MonkeyPatch) -> Stall:
    backend = server.engine.backend
    stall = Stall(backend.parse_adapter, lambda args: Path(args[0]).resolve() == adapter.resolve())
    monkeypatch.setattr(backend, "parse_adapter", stall)
    return stall


async def taken_at_once(server: Server) -> bool:
    """Whether the request being sent is taken into a batch within TURNS turns of the event loop
    of reaching the queue (waits for it to get there; nothing else may be queued or running)."""
    engine = server.engine
    async with asyncio.timeout(STALL_S):
        while not (engine.occupancy().waiting or engine.occupancy().running):
            await asyncio.sleep(0)
    for _ in range(TURNS):
        if engine.occupancy().running:
            return True
        await asyncio.sleep(0)
    return False


async def test_a_batch_of_resident_adapters_starts_at_once_while_another_is_read_for_its_first_use(
    start_server: Any, assets: Assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fresh` is published on the adapter root and never used: its first request reads its
    file, which stalls. A request for `b`, resident, in a batch with room for three more images,
    is taken into a batch at once and answered: the batch does not wait for `fresh` to join."""
    root = tmp_path / "volume"
    publish(root, "fresh", assets.adapter_a)
    server = await start_server(
        adapter_root=root, allowed_roots=(assets.root,), max_loras=2, max_batch_size=4
    )
    await server.load("b", assets.adapter_b)
    await server.image(model="b")  # b takes a GPU slot
    stall = stall_reads_of(server, assets.adapter_a, monkeypatch)
    first_use = asyncio.create_task(server.image(model="fresh"))
    try:
        await stall.wait_started()
        answer = asyncio.create_task(server.image(model="b"))
        assert await taken_at_once(server), "b's batch waited for fresh's first use"
        await answer
        assert not stall.finished.is_set(), "b was answered only after fresh's file was read"
    finally:
        stall.release()
    await first_use
    assert server.engine.registry.get("fresh").origin == "resolver"


async def test_a_first_use_is_read_while_batches_of_resident_adapters_run(
    start_server: Any, assets: Assets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`a` was dropped from the CPU tier, so its next request reads the file again; while that
    read is stalled, a request for `b`, resident in the GPU slot, is answered."""
    server = await start_server(max_loras=1, max_cpu_loras=1, max_batch_size=1)
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)  # the CPU tier holds one parse: a's goes
    await server.image(model="b")  # b takes the GPU slot
    stall = stall_reads_of(server, assets.adapter_a, monkeypatch)
    first_use = asyncio.create_task(server.image(model="a"))
    try:
        await stall.wait_started()
        await server.image(model="b")
        assert not stall.finished.is_set(), "b waited for a's file to be read"
    finally:
        stall.release()
    await first_use
    assert server.engine.residency.tier_of(server.engine.registry.get("a")) == "gpu"


async def test_a_queued_requests_adapter_is_read_while_a_batch_runs(
    start_server: Any, assets: Assets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request for `a` (registered, its parse dropped from the CPU tier) arrives while a batch
    of `b` runs: its file is read during that batch, not after it, so the batch after next
    need not wait for it."""
    server = await start_server(max_loras=1, max_cpu_loras=1, max_batch_size=1)
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)  # the CPU tier holds one parse: a's goes
    await server.image(model="b")  # b takes the GPU slot
    backend = server.engine.backend
    batch = Stall(backend.run_batch, lambda args: True)
    monkeypatch.setattr(backend, "run_batch", batch)
    read = stall_reads_of(server, assets.adapter_a, monkeypatch)
    running = asyncio.create_task(server.image(model="b"))
    waiting: asyncio.Task[Any] | None = None
    try:
        await batch.wait_started()
        waiting = asyncio.create_task(server.image(model="a"))
        await read.wait_started()
        assert not batch.finished.is_set(), "a's file was read only after the batch ended"
    finally:
        batch.release()
        read.release()
    await running
    assert waiting is not None
    await waiting
    assert server.engine.residency.tier_of(server.engine.registry.get("a")) == "gpu"
