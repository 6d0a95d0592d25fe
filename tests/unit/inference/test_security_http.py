"""Who may register which name, and who may call what, over real HTTP on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lora_volume.targeting import Target, parse_selector

from tests.support.http import assert_error
from tests.unit.inference.conftest import ADMIN_TOKEN, Assets, Server, publish


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
    assert old_key not in server.engine.residency.gpu and old_key not in server.engine.residency.cpu
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
    publish(root, "pixel", assets.adapter_b)
    await server.load("b", assets.adapter_b)
    assert (await server.image(model="pixel") == await server.image(model="b")).all()
    assert server.engine.registry.get("pixel").origin == "resolver"


async def test_request_adapters_can_be_turned_off(start_server: Any, assets: Assets) -> None:
    server = await start_server(allow_request_adapters=False)
    status, body = await server.post(
        "/v1/images/generations",
        {
            "prompt": "x",
            "size": "32x32",
            "lora": {"name": "x", "local_path": str(assets.adapter_a)},
        },
        token=None,
    )
    error = assert_error(status, body, 403, param="lora.local_path")
    assert "--allow-request-adapters" in error["message"]
    # Names the server serves still work.
    await server.load("a", assets.adapter_a)
    await server.image(model="a")


CLIENT_TOKEN = "client-secret"
GPU, CPU = {"matchLabels": {"tier": "gpu"}}, {"matchLabels": {"tier": "cpu"}}
READS = ["/v1/models", "/v1/adapters"]


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["missing", "wrong"])
async def test_the_client_token_guards_generation_and_reads(
    start_server: Any, token: str | None
) -> None:
    server = await start_server(client_token=CLIENT_TOKEN)
    for path in READS:
        status, body = await server.get(path, token=token)
        assert "client token" in assert_error(status, body, 401)["message"]
    status, body = await server.post(
        "/v1/images/generations", {"prompt": "x", "size": "32x32"}, token=token
    )
    assert "client token" in assert_error(status, body, 401)["message"]


@pytest.mark.parametrize("token", [CLIENT_TOKEN, ADMIN_TOKEN], ids=["client", "admin"])
async def test_the_client_or_admin_token_is_accepted(start_server: Any, token: str) -> None:
    server = await start_server(client_token=CLIENT_TOKEN)
    for path in READS:
        status, body = await server.get(path, token=token)
        assert status == 200, body
    status, body = await server.post(
        "/v1/images/generations",
        {"prompt": "x", "size": "32x32", "num_inference_steps": 2},
        token=token,
    )
    assert status == 200, body


async def test_probes_and_metrics_stay_open(start_server: Any) -> None:
    server = await start_server(client_token=CLIENT_TOKEN)
    for path in ["/health", "/ready"]:
        assert (await server.get(path))[0] == 200
    async with server.session.get(server.url("/metrics")) as resp:
        assert resp.status == 200


async def test_the_client_token_does_not_open_load(start_server: Any, assets: Assets) -> None:
    server = await start_server(client_token=CLIENT_TOKEN)
    status, body = await server.post(
        "/v1/load_lora_adapter",
        {"lora_name": "a", "lora_path": str(assets.adapter_a)},
        token=CLIENT_TOKEN,
    )
    assert "admin token" in assert_error(status, body, 401)["message"]


async def test_the_resolver_serves_only_adapters_meant_for_the_pod(
    start_server: Any, assets: Assets, tmp_path: Path
) -> None:
    root = tmp_path / "volume"
    model = assets.model.name
    publish(root, "mine", assets.adapter_a, Target(model, parse_selector(GPU)))
    publish(root, "theirs", assets.adapter_a, Target(model, parse_selector(CPU)))
    publish(root, "other-base", assets.adapter_a, Target("flux-dev"))
    publish(root, "by-hand", assets.adapter_a, None)
    labels = tmp_path / "labels"
    labels.write_text('app.kubernetes.io/component="inference"\ntier="gpu"\n')
    server = await start_server(adapter_root=root, pod_labels_file=labels)
    await server.image(model="mine")
    await server.image(model="by-hand")
    for name, reason in [("theirs", "selector"), ("other-base", "base model 'flux-dev'")]:
        status, body = await server.post(
            "/v1/images/generations", {"prompt": "x", "size": "32x32", "model": name}, token=None
        )
        message = assert_error(status, body, 404, param="model")["message"]
        assert "not served by this pod" in message and reason in message, message
    # The labels follow the pod (the Downward API rewrites the file).
    labels.write_text('tier="cpu"\n')
    await server.image(model="theirs")
    # A lone server, without labels, resolves everything.
    lone = await start_server(adapter_root=root)
    await lone.image(model="mine")
    await lone.image(model="other-base")
