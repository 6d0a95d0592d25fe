"""The official `openai` client against the server: generation by adapter name, extra fields."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
from PIL import Image

from tests.unit.inference.conftest import Assets, Server


async def test_openai_client_round_trips(server: Server, assets: Assets) -> None:
    await server.load("pixel-art", assets.adapter_a)
    client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused")
    extra = {"num_inference_steps": 2, "seed": 7}
    result = await client.images.generate(
        model="pixel-art",
        prompt="a lighthouse",
        size="32x32",
        response_format="b64_json",
        extra_body=extra,
    )
    assert result.data is not None and result.data[0].b64_json is not None
    image = np.asarray(
        Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB")
    )
    assert np.array_equal(image, await server.image(model="pixel-art"))

    scaled = await client.images.generate(
        model=server.engine.config.model_id,
        prompt="a lighthouse",
        size="32x32",
        extra_body={**extra, "lora": {"name": "pixel-art", "scale": 0.0}},
    )
    assert scaled.data is not None and scaled.data[0].b64_json is not None
    base = np.asarray(
        Image.open(io.BytesIO(base64.b64decode(scaled.data[0].b64_json))).convert("RGB")
    )
    assert np.array_equal(base, await server.image())

    models = await client.models.list()
    assert {m.id for m in models.data} == {server.engine.config.model_id, "pixel-art"}

    try:
        await client.images.generate(model="ghost", prompt="x", size="32x32")
    except openai.NotFoundError as e:
        assert e.status_code == 404
    else:
        raise AssertionError("an unknown model must be a 404")
    await client.close()
