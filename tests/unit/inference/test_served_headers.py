"""Every answer names the model it was made with: `x-lora-model` (the adapter's name on the
server, a stack's members at their scales, or the base model's id) and `x-lora-revision` (the
sha256 of the adapter's weights), from the server and unchanged through the router."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.support.fleet import fleet_of
from tests.unit.inference.conftest import Assets, Server
from tests.unit.router import conftest as router_suite
from tests.unit.router.conftest import StartRouter

start_router = router_suite.start_router

BODY = {"prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2, "seed": 7}


async def _served(session: Any, url: str, **request: Any) -> tuple[str, str | None]:
    async with session.post(url, json={**BODY, **request}) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-lora-model"], r.headers.get("x-lora-revision")


async def test_the_answer_names_the_adapter_and_revision_it_was_made_with(
    server: Server, assets: Assets
) -> None:
    await server.load("pixel-art", assets.adapter_a)
    await server.load("watercolor", assets.adapter_b)
    _, models = await server.get("/v1/models")
    sha = {card["id"]: card.get("sha256") for card in models["data"]}
    url = server.url("/v1/images/generations")
    assert await _served(server.session, url, model="pixel-art") == ("pixel-art", sha["pixel-art"])
    assert await _served(server.session, url, lora={"name": "watercolor", "scale": 0.5}) == (
        "watercolor",
        sha["watercolor"],
    )
    model_id = server.engine.config.model_id
    assert await _served(server.session, url) == (model_id, None)
    stack = [{"name": "watercolor", "scale": 0.5}, {"name": "pixel-art", "scale": 0.8}]
    name, revision = await _served(server.session, url, lora=stack)
    assert name == "pixel-art*0.8+watercolor*0.5"
    assert revision is not None and revision not in (sha["pixel-art"], sha["watercolor"])
    # A new version under the same name: the answer names the new weights.
    await server.load("pixel-art", assets.kohya, load_inplace=True)
    _, models = await server.get("/v1/models")
    new = next(card["sha256"] for card in models["data"] if card["id"] == "pixel-art")
    assert new != sha["pixel-art"]
    assert await _served(server.session, url, model="pixel-art") == ("pixel-art", new)


async def test_the_router_passes_the_names_on(
    start_server: Callable[..., Any], start_router: StartRouter, assets: Assets
) -> None:
    router, servers = await fleet_of(start_server, start_router, assets, 2)
    _, models = await servers[0].get("/v1/models")
    sha = {card["id"]: card.get("sha256") for card in models["data"]}
    served = await _served(router.session, router.url("/v1/images/generations"), model="watercolor")
    assert served == ("watercolor", sha["watercolor"])
