from __future__ import annotations

import numpy as np

from tests.unit.inference.conftest import Assets, Server


async def test_base_and_adapter_images_differ(server: Server, assets: Assets) -> None:
    base = await server.image()
    await server.load("a", assets.adapter_a)
    with_a = await server.image(model="a")
    again_base = await server.image()
    assert not np.array_equal(base, with_a)
    assert np.array_equal(base, again_base)
