"""Repeated load/unload cycles must not grow the pipeline's parameters or the process's memory."""

from __future__ import annotations

import gc

import psutil
import pytest

from tests.unit.inference.conftest import Assets, Server

CYCLES = 300


@pytest.mark.slow
async def test_load_unload_cycles_do_not_grow(server: Server, assets: Assets) -> None:
    engine = server.engine
    process = psutil.Process()
    base_params = engine.backend.parameter_count()

    async def cycle(i: int) -> None:
        path = assets.adapter_b if i % 2 else assets.adapter_a
        await server.load(f"cycle-{i}", path, pinned=True)  # pinned: resident in the pipeline now
        status, _ = await server.post("/v1/unload_lora_adapter", {"lora_name": f"cycle-{i}"})
        assert status == 200
        await engine.idle()

    for i in range(30):  # warm-up: allocator pools, caches
        await cycle(i)
    gc.collect()
    rss_before = process.memory_info().rss
    for i in range(30, CYCLES):
        await cycle(i)
    gc.collect()
    growth_mb = (process.memory_info().rss - rss_before) / 2**20
    assert engine.backend.resident_keys() == set()
    assert engine.backend.parameter_count() == base_params
    assert (
        len(engine.registry) == 0
        and len(engine.residency.cpu) == 0
        and len(engine.residency.gpu) == 0
    )
    assert growth_mb < 64, f"RSS grew by {growth_mb:.1f} MiB over {CYCLES - 30} cycles"
