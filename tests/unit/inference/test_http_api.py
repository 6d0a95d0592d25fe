"""The HTTP API over real HTTP on 127.0.0.1: every status code the contract names."""

from __future__ import annotations

import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from lora_operator.rules import planning
from lora_podapi import models as models_api

from tests.support.http import assert_error
from tests.unit.inference.bad_adapters import BadAdapter
from tests.unit.inference.conftest import ADMIN_TOKEN, Assets, Server, publish


async def test_load_returns_vllm_success_text(server: Server, assets: Assets) -> None:
    status, body = await server.post(
        "/v1/load_lora_adapter", {"lora_name": "pixel", "lora_path": str(assets.adapter_a)}
    )
    assert (status, body) == (200, "Success: LoRA adapter 'pixel' added successfully.")
    status, body = await server.post("/v1/unload_lora_adapter", {"lora_name": "pixel"})
    assert (status, body) == (200, "Success: LoRA adapter 'pixel' removed successfully.")


async def test_a_load_asked_for_json_answers_the_adapters_card(
    server: Server, assets: Assets
) -> None:
    # The operator asks for JSON: the card the load made, as /v1/models lists it from then on.
    async with server.session.post(
        server.url("/v1/load_lora_adapter"),
        json={"lora_name": "pixel", "lora_path": str(assets.adapter_a), "scale": 0.5},
        headers={"Accept": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as resp:
        assert resp.status == 200
        answered = await resp.json()
    status, listed = await server.get("/v1/models")
    assert status == 200
    (card,) = [c for c in listed["data"] if c["id"] == "pixel"]
    assert answered == card
    assert (answered["scale"], answered["parent"]) == (0.5, listed["data"][0]["id"])


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"lora_path": "/x"}, id="missing-name"),
        pytest.param({"lora_name": "a"}, id="missing-path"),
        pytest.param({"lora_name": "../a", "lora_path": "/x"}, id="invalid-name"),
        pytest.param({"lora_name": "a", "lora_path": 5}, id="path-type"),
    ],
)
async def test_bad_load_bodies_are_400(server: Server, body: dict[str, Any]) -> None:
    status, payload = await server.post("/v1/load_lora_adapter", body)
    assert_error(status, payload, 400)


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[" * 200_000 + b"]" * 200_000, b'{"n": ' + b"9" * 5000 + b"}"],
    ids=["syntax", "nesting-bomb", "long-number"],
)
async def test_invalid_json_is_400(server: Server, body: bytes) -> None:
    async with server.session.post(
        server.url("/v1/images/generations"),
        data=body,
        headers={"Content-Type": "application/json"},
    ) as resp:
        assert_error(resp.status, await resp.json(), 400)


async def test_duplicate_name_is_400_unless_inplace(server: Server, assets: Assets) -> None:
    await server.load("dup", assets.adapter_a)
    status, body = await server.post(
        "/v1/load_lora_adapter", {"lora_name": "dup", "lora_path": str(assets.adapter_b)}
    )
    assert "load_inplace" in assert_error(status, body, 400, param="lora_name")["message"]
    await server.load("dup", assets.adapter_b, load_inplace=True)


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_admin_endpoints_need_the_token(
    server: Server, assets: Assets, token: str | None
) -> None:
    body = {"lora_name": "x", "lora_path": str(assets.adapter_a)}
    status, payload = await server.post("/v1/load_lora_adapter", body, token=token)
    assert_error(status, payload, 401)
    status, payload = await server.post("/v1/unload_lora_adapter", {"lora_name": "x"}, token=token)
    assert_error(status, payload, 401)


async def test_no_token_configured_means_open_admin(start_server: Any, assets: Assets) -> None:
    server = await start_server(admin_token=None)
    status, _ = await server.post(
        "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(assets.adapter_a)}, token=None
    )
    assert status == 200


async def test_bad_adapters_get_their_status(
    server: Server, bad_adapters: list[BadAdapter]
) -> None:
    for bad in bad_adapters:
        status, body = await server.post(
            "/v1/load_lora_adapter", {"lora_name": bad.name, "lora_path": str(bad.path)}
        )
        error = assert_error(status, body, bad.status)
        assert bad.message in error["message"], (bad.name, error)
    _, models = await server.get("/v1/models")
    assert [m["id"] for m in models["data"]] == [server.engine.config.model_id]


async def test_rank_above_the_limit_is_422(start_server: Any, assets: Assets) -> None:
    server = await start_server(max_lora_rank=2)
    status, body = await server.post(
        "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(assets.adapter_a)}
    )
    assert "--max-lora-rank 2" in assert_error(status, body, 422)["message"]


async def test_unload_unknown_is_404(server: Server) -> None:
    status, body = await server.post("/v1/unload_lora_adapter", {"lora_name": "ghost"})
    assert_error(status, body, 404, param="lora_name")


async def test_unknown_model_is_404_on_model(server: Server) -> None:
    status, body = await server.post(
        "/v1/images/generations", {"prompt": "x", "model": "ghost", "size": "32x32"}, token=None
    )
    assert_error(status, body, 404, param="model")


async def test_malformed_generation_is_400(server: Server) -> None:
    status, body = await server.post(
        "/v1/images/generations", {"prompt": "x", "n": 500, "size": "32x32"}, token=None
    )
    assert_error(status, body, 400, param="n")


async def test_models_and_adapters_listing(server: Server, assets: Assets) -> None:
    await server.load("pixel", assets.adapter_a)
    await server.image(model="pixel")
    _, models = await server.get("/v1/models")
    base_id = server.engine.config.model_id
    cards = {m["id"]: m for m in models["data"]}
    assert cards[base_id] == cards[base_id] | {"root": base_id, "parent": None}
    # Loaded from a path that is no published revision: its own name, no revision.
    assert cards["pixel"] == cards["pixel"] | {
        "object": "model",
        "root": "pixel",
        "parent": base_id,
        "adapter": None,
        "revision": None,
    }
    _, adapters = await server.get("/v1/adapters")
    (entry,) = adapters["data"]
    assert entry["id"] == "pixel" and entry["tier"] == "gpu" and entry["hits"] == 1
    assert len(entry["sha256"]) == 64 and entry["size_bytes"] > 0 and entry["pinned"] is False


async def test_a_published_revisions_card_names_it_without_a_path(
    start_server: Callable[..., Awaitable[Server]], assets: Assets, tmp_path: Path
) -> None:
    """What vLLM's clients see (`id`, `object`, `root`, `parent`) and what the operator reads
    back (`root`: the adapter, `revision`): no path on the pod, for an adapter and for a
    rollout's alias of one of its revisions; the operator's parser takes both as its own."""
    sha = "ab" * 32
    revision = tmp_path / "team-a" / "pixel" / "revisions" / sha
    shutil.copytree(assets.adapter_a, revision)  # a directory, as the operator publishes it
    server = await start_server(adapter_root=tmp_path / "team-a")
    alias = f"pixel_{sha[:12]}"
    for name in ("pixel", alias):
        await server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(revision)})
    _, models = await server.get("/v1/models")
    base_id = server.engine.config.model_id
    cards = {m["id"]: m for m in models["data"]}
    for name in ("pixel", alias):
        assert cards[name] == cards[name] | {
            "id": name,
            "object": "model",
            "root": "pixel",
            "parent": base_id,
            "adapter": "pixel",
            "revision": sha,
        }
    assert str(tmp_path) not in json.dumps(models)
    assert models_api.render(models_api.parse(models)) == models  # one definition, both ends
    report = planning.parse_models(models)
    assert report.managed() == {"pixel": sha, alias: sha}
    assert report.revisions() == {("pixel", sha)}


async def test_health_ready_metrics(server: Server, assets: Assets) -> None:
    assert (await server.get("/health"))[0] == 200
    assert (await server.get("/ready"))[0] == 200
    await server.load("pixel", assets.adapter_a)
    await server.image(model="pixel")
    async with server.session.get(server.url("/metrics")) as resp:
        text = await resp.text()
    assert resp.status == 200
    assert 'lora_adapter_loads_total{result="ok",tier="gpu"} 1.0' in text
    assert 'lora_adapter_lookups_total{result="miss"} 1.0' in text
    assert "lora_generation_seconds_count 1.0" in text
    assert 'lora_adapters{tier="gpu"} 1.0' in text


async def test_unknown_route_is_json_404(server: Server) -> None:
    status, body = await server.get("/v1/nothing")
    assert_error(status, body, 404)


async def test_request_level_path_registers_and_respects_roots(
    server: Server, assets: Assets, bad_adapters: list[BadAdapter]
) -> None:
    image = await server.image(lora={"name": "inline", "local_path": str(assets.adapter_a)})
    loaded = await server.image(model="inline")
    assert (image == loaded).all()
    escape = next(b for b in bad_adapters if b.name == "symlink-out")
    status, body = await server.post(
        "/v1/images/generations",
        {"prompt": "x", "size": "32x32", "lora": {"name": "esc", "local_path": str(escape.path)}},
        token=None,
    )
    assert_error(status, body, 403, param="lora.local_path")


async def test_resolver_registers_names_found_on_the_adapter_root(
    start_server: Any, assets: Assets, tmp_path: Any
) -> None:
    root = tmp_path / "volume"
    publish(root, "pixel", assets.adapter_a)
    server = await start_server(adapter_root=root, allowed_roots=(assets.root,))
    image = await server.image(model="pixel")
    _, adapters = await server.get("/v1/adapters")
    assert [(a["id"], a["origin"]) for a in adapters["data"]] == [("pixel", "resolver")]
    await server.load("direct", assets.adapter_a)
    assert (await server.image(model="direct") == image).all()


async def test_the_operators_load_of_a_name_a_request_resolved_first_succeeds(
    start_server: Any, assets: Assets, tmp_path: Any
) -> None:
    """A request may resolve the name between the operator's read of `/v1/models` and its load
    (which then comes without load_inplace): the load takes the name over. Sent again, as a
    retry whose answer was lost, it answers 200 and reads nothing."""
    root = tmp_path / "volume"
    publish(root, "pixel", assets.adapter_a)
    server = await start_server(adapter_root=root, allowed_roots=(assets.root,))
    image = await server.image(model="pixel")
    body = {"lora_name": "pixel", "lora_path": str(root / "pixel" / "current"), "scale": 0.5}
    for _ in range(2):
        status, answer = await server.post("/v1/load_lora_adapter", body)
        assert status == 200, answer
    _, adapters = await server.get("/v1/adapters")
    assert [(a["id"], a["origin"]) for a in adapters["data"]] == [("pixel", "api")]
    assert server.metric("lora_adapter_load_seconds_count", tier="cpu") == 2
    assert not (await server.image(model="pixel") == image).all()  # now at the load's scale
    status, answer = await server.post("/v1/load_lora_adapter", body | {"scale": 1.0})
    assert status == 400 and "load_inplace" in answer["error"]["message"], answer


async def test_full_queue_answers_429_with_retry_after(start_server: Any) -> None:
    import asyncio

    server = await start_server(max_queue=1, max_batch_size=1)
    body = {"prompt": "x", "size": "32x32", "num_inference_steps": 4}

    async def send() -> tuple[int, Any]:
        async with server.session.post(server.url("/v1/images/generations"), json=body) as resp:
            return resp.status, resp.headers.get("Retry-After")

    results = await asyncio.gather(*(send() for _ in range(6)))
    statuses = [s for s, _ in results]
    assert 200 in statuses and 429 in statuses
    assert all(retry == "1" for s, retry in results if s == 429)
