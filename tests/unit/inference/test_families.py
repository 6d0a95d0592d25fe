"""SDXL, SD 3.5 and Flux tiny pipelines through the real server: load, generate, unload."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from diffusers import DiffusionPipeline
from lora_inference.app import create_app
from lora_inference.config import ServerConfig
from lora_inference.pipeline import DiffusionBackend
from lora_inference.tools.random_adapters import write_random_adapter
from lora_inference.tools.tiny_models import write_tiny_model

from tests.unit.inference.conftest import Server


@pytest.mark.parametrize("arch", ["sdxl", "sd3", "flux"])
async def test_family_loads_adapters_and_generates(arch: str, tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / f"tiny-{arch}", arch)
    pipe = DiffusionPipeline.from_pretrained(str(model))
    adapters = tmp_path / "adapters"
    with_te = write_random_adapter(
        adapters / "te", pipe, base_model=model.name, seed=5, text_encoder=True
    )
    plain = write_random_adapter(adapters / "plain", pipe, base_model=model.name, seed=6)
    backend = DiffusionBackend.load(model, device="cpu", dtype=torch.float32)
    config = ServerConfig(model=model, allowed_roots=(adapters,), max_loras=1)
    server = TestServer(create_app(config, backend=backend), host="127.0.0.1")
    await server.start_server()
    async with ClientSession() as session:
        live = Server(server, session, server.app)
        while (await live.get("/ready"))[0] != 200:
            pass
        base = await live.image()
        await live.load("te", with_te)
        await live.load("plain", plain)
        te_image = await live.image(model="te")
        plain_image = await live.image(model="plain")
        assert not np.array_equal(te_image, base)
        assert not np.array_equal(plain_image, te_image)
        assert np.array_equal(await live.image(model="te"), te_image)  # after an eviction
        assert np.array_equal(await live.image(), base)
    await server.close()


async def test_an_adapter_for_another_architecture_is_refused(tmp_path: Path) -> None:
    sd15 = DiffusionBackend.load(
        write_tiny_model(tmp_path / "sd15", "sd15"), device="cpu", dtype=torch.float32
    )
    sdxl_pipe = DiffusionPipeline.from_pretrained(str(write_tiny_model(tmp_path / "sdxl", "sdxl")))
    foreign = write_random_adapter(tmp_path / "xl", sdxl_pipe, base_model="sdxl", text_encoder=True)
    from lora_inference import errors

    with pytest.raises(errors.IncompatibleAdapter, match="does not fit this model"):
        sd15.parse_adapter(foreign, name="xl", max_rank=64)
