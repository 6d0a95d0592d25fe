"""Who may register which name, and who may call what, over real HTTP on 127.0.0.1."""

from __future__ import annotations

from typing import Any

from tests.inference.conftest import Assets, Server
from tests.inference.test_http_api import assert_error


async def test_an_admin_load_replaces_a_request_registration(
    server: Server, assets: Assets
) -> None:
    await server.image(lora={"name": "x", "local_path": str(assets.adapter_a)})
    old_key = server.engine.registry.get("x").key
    # What the operator does: a plain load (no load_inplace) of a name it manages.
    await server.load("x", assets.adapter_b)
    await server.load("b", assets.adapter_b)
    assert (await server.image(model="x") == await server.image(model="b")).all()
    _, adapters = await server.get("/v1/adapters")
    assert {a["id"]: a["origin"] for a in adapters["data"]}["x"] == "api"
    await server.engine.idle()
    assert old_key not in server.engine.gpu and old_key not in server.engine.cpu
    # ... and a request can no longer take the name back.
    status, body = await server.post(
        "/v1/images/generations",
        {"prompt": "x", "size": "32x32", "lora": {"name": "x", "local_path": str(assets.kohya)}},
        token=None,
    )
    assert "cannot replace" in assert_error(status, body, 400, param="lora.name")["message"]


async def test_a_published_name_replaces_a_request_registration(
    start_server: Any, assets: Assets, tmp_path: Any
) -> None:
    root = tmp_path / "volume"
    (root / "pixel").mkdir(parents=True)
    (root / "pixel" / "revisions").mkdir()
    server = await start_server(adapter_root=root, allowed_roots=(assets.root,))
    await server.image(lora={"name": "pixel", "local_path": str(assets.adapter_a)})
    # The operator publishes `pixel` on the volume: the next request naming it gets that one.
    (root / "pixel" / "revisions" / ("0" * 64)).symlink_to(assets.adapter_b)
    (root / "pixel" / "current").symlink_to("revisions/" + "0" * 64)
    await server.load("b", assets.adapter_b)
    assert (await server.image(model="pixel") == await server.image(model="b")).all()
    assert server.engine.registry.get("pixel").origin == "resolver"
