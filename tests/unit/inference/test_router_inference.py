"""The router in front of real inference servers (the tiny SD 1.5 pipeline): the official
`openai` client works through it unchanged, errors pass through, and requests follow residency."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import openai
from PIL import Image

from tests.support.fleet import fleet_of
from tests.unit.inference.conftest import Assets
from tests.unit.router import conftest as router_suite
from tests.unit.router.conftest import StartRouter

# Here with the inference suite, whose fixtures it uses (the tiny model, its adapters, live
# servers around it), so that the router's own unit tests never import torch; the router
# suite's fixture starts the routers.
start_router = router_suite.start_router

EXTRA = {"num_inference_steps": 2, "seed": 7}


def pixels(b64: str | None) -> np.ndarray:
    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


async def test_the_openai_client_works_through_the_router(
    start_server: Callable[..., Any], start_router: StartRouter, assets: Assets
) -> None:
    router, servers = await fleet_of(start_server, start_router, assets, 2)
    client = openai.AsyncOpenAI(base_url=router.url("/v1"), api_key="unused")
    result = await client.images.generate(
        model="pixel-art",
        prompt="a lighthouse",
        size="32x32",
        response_format="b64_json",
        extra_body=EXTRA,
    )
    assert result.data is not None
    assert np.array_equal(
        pixels(result.data[0].b64_json), await servers[0].image(model="pixel-art")
    )

    models = await client.models.list()
    model_id = servers[0].engine.config.model_id
    assert [m.id for m in models.data] == [model_id, "pixel-art", "watercolor"]
    # What the client sees the models were made from: names, never a path on a pod.
    assert [m.to_dict()["root"] for m in models.data] == [model_id, "pixel-art", "watercolor"]

    try:
        await client.images.generate(model="ghost", prompt="x", size="32x32", extra_body=EXTRA)
    except openai.NotFoundError as e:
        assert e.status_code == 404
        assert isinstance(e.body, dict) and "ghost" in str(e.body.get("message"))
    else:
        raise AssertionError("an unknown model must be a 404, as from the server itself")
    try:
        await client.images.generate(model="pixel-art", prompt="x", size="7x7", extra_body=EXTRA)
    except openai.BadRequestError as e:
        assert e.status_code == 400
    else:
        raise AssertionError("a bad size must be the server's 400")
    await client.close()


async def test_an_adapter_keeps_going_to_the_pod_where_it_is_resident(
    start_server: Callable[..., Any], start_router: StartRouter, assets: Assets
) -> None:
    router, servers = await fleet_of(start_server, start_router, assets, 2)
    body = {"model": "watercolor", "prompt": "a lighthouse", "size": "32x32", **EXTRA}
    async with router.session.post(router.url("/v1/images/generations"), json=body) as r:
        assert r.status == 200
        first = r.headers["x-lora-pod"]
    # Once a report shows it resident there, it keeps going there.
    reports = router.fleet.reports
    await router.wait_until(
        "watercolor resident", lambda: "watercolor" in reports[first].residency.gpu
    )
    for _ in range(3):
        async with router.session.post(router.url("/v1/images/generations"), json=body) as r:
            assert r.status == 200
            assert (r.headers["x-lora-pod"], r.headers["x-lora-route"]) == (first, "gpu-resident")
    hits = [s.metric("lora_adapter_lookups_total", result="hit") for s in servers]
    assert sum(hits) >= 3
