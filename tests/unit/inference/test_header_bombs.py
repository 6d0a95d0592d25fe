"""The server reads headers through lora_volume.files, within its bounds: each header bomb, and
an adapter_config.json bomb beside good weights, is a 422 that says what is wrong, and the
server goes on serving. What refusing them costs in memory, read as the server reads them:
tests/unit/volume/test_header_bounds.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_volume import files

from tests.support import bombs
from tests.unit.inference.conftest import Assets, Server


@pytest.fixture
def bomb_root(assets: Assets) -> Iterator[Path]:
    folder = assets.root / "bombs"
    folder.mkdir(exist_ok=True)
    yield folder
    shutil.rmtree(folder)


async def test_each_bomb_is_a_422_saying_why_and_the_server_serves_on(
    server: Server, assets: Assets, bomb_root: Path
) -> None:
    base = await server.image()
    for bomb in bombs.bombs():
        path = bombs.write_bomb(bomb_root, bomb)
        status, body = await server.post(
            "/v1/load_lora_adapter", {"lora_name": bomb.name, "lora_path": str(path)}
        )
        assert status == 422, (bomb.name, body)
        assert bomb.message in body["error"]["message"], bomb.name
        assert body["error"]["param"] == "lora_path"
        path.unlink()
    # adapter_config.json, read before the weights: nested past its bound, beside good weights.
    nested = bomb_root / "nested-config"
    shutil.copytree(assets.adapter_a, nested)
    (nested / files.ADAPTER_CONFIG).write_text("[" * 100_000 + "]" * 100_000)
    status, body = await server.post(
        "/v1/load_lora_adapter", {"lora_name": "nested-config", "lora_path": str(nested)}
    )
    assert status == 422, body
    assert "adapter_config.json nests deeper than 16 levels" in body["error"]["message"]
    await server.load("a", assets.adapter_a)
    assert (await server.image(model="a")).shape == base.shape
