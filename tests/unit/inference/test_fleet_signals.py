"""What the server tells a fleet, over real HTTP on 127.0.0.1.

The operator reads capacity and per-adapter hits from `/v1/models`; the router reads the served
model, capacity and the queue from `/v1/adapters`; schedulers built for vLLM read residency and
the queue from `/metrics` in vLLM's names, with `vllm:lora_requests_info` kept to one series.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from lora_inference.metrics import Metrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.polling import until
from tests.unit.inference.conftest import Assets, Server

SLOW = {"num_inference_steps": 40, "seed": 1}  # a batch long enough to queue requests behind


async def scrape(server: Server) -> dict[str, list[Sample]]:
    async with server.session.get(server.url("/metrics")) as resp:
        assert resp.status == 200
        text = await resp.text()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def lora_info(server: Server) -> Sample:
    """The `vllm:lora_requests_info` series, checked to be the only one and valued at the scrape."""
    before = time.time()
    families = await scrape(server)
    after = time.time()
    (sample,) = families["vllm:lora_requests_info"]
    assert set(sample.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert before <= sample.value <= after
    return sample


async def adapters(server: Server) -> dict[str, Any]:
    status, body = await server.get("/v1/adapters")
    assert status == 200, body
    listing: dict[str, Any] = body
    return listing


async def test_models_report_capacity_and_hits_per_adapter(server: Server, assets: Assets) -> None:
    await server.load("pixel", assets.adapter_a)
    await server.load("idle", assets.adapter_b)
    for seed in (1, 2):
        await server.image(model="pixel", seed=seed)
    _, models = await server.get("/v1/models")
    assert (models["max_loras"], models["max_cpu_loras"]) == (2, 4)
    cards = {m["id"]: m for m in models["data"]}
    base = cards.pop(server.engine.config.model_id)
    assert "hits" not in base  # the base model's card stays vLLM's
    assert {name: card["hits"] for name, card in cards.items()} == {"pixel": 2, "idle": 0}
    listed = {a["id"]: a["hits"] for a in (await adapters(server))["data"]}
    assert listed == {"pixel": 2, "idle": 0}  # one counter, two answers


async def test_adapters_report_model_capacity_and_an_idle_queue(start_server: Any) -> None:
    server = await start_server(served_model_name="tiny-sd", max_loras=3, max_cpu_loras=5)
    body = await adapters(server)
    _, models = await server.get("/v1/models")
    base = next(m["id"] for m in models["data"] if m["parent"] is None)
    assert {k: v for k, v in body.items() if k != "data"} == {
        "object": "list",
        "model": base,
        "max_loras": 3,
        "max_cpu_loras": 5,
        "num_requests_waiting": 0,
        "num_requests_running": 0,
        "api_version": 1,
    }
    assert base == "tiny-sd"


async def test_queue_counts_waiting_and_running(start_server: Any) -> None:
    server = await start_server(max_batch_size=1)
    model = server.engine.config.model_id
    blocker = asyncio.create_task(server.image(**SLOW))
    await until("one running", lambda: _counts(server, (0, 1)), timeout=30)
    queued = [asyncio.create_task(server.image(seed=s)) for s in (2, 3)]
    await until("two waiting, one running", lambda: _counts(server, (2, 1)), timeout=30)
    families = await scrape(server)
    for name, expected in (("vllm:num_requests_waiting", 2), ("vllm:num_requests_running", 1)):
        assert [(s.labels, s.value) for s in families[name]] == [({"model_name": model}, expected)]
    await asyncio.gather(blocker, *queued)
    await server.engine.idle()
    assert await _counts(server, (0, 0))
    families = await scrape(server)
    assert families["vllm:num_requests_waiting"][0].value == 0
    assert families["vllm:num_requests_running"][0].value == 0


async def _counts(server: Server, expected: tuple[int, int]) -> bool:
    body = await adapters(server)
    return (body["num_requests_waiting"], body["num_requests_running"]) == expected


async def test_lora_requests_info_names_resident_and_awaited_adapters(
    start_server: Any, assets: Assets
) -> None:
    server = await start_server(max_batch_size=1)  # max_loras 2
    info = await lora_info(server)
    idle = {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert info.labels == idle
    for name in ("a", "b", "c"):
        await server.load(name, assets.adapter_a if name != "b" else assets.adapter_b)
    await server.image(model="a")
    await server.image(model="b")
    info = await lora_info(server)
    assert (info.labels["running_lora_adapters"], info.labels["waiting_lora_adapters"]) == (
        "a,b",
        "",
    )

    blocker = asyncio.create_task(server.image(**SLOW))
    await until("one running", lambda: _counts(server, (0, 1)), timeout=30)
    waiting = asyncio.create_task(server.image(model="c"))

    async def c_waits() -> Sample | None:
        sample = await lora_info(server)  # one series at every scrape, through every change
        return sample if sample.labels["waiting_lora_adapters"] == "c" else None

    info = await until("c waiting", c_waits, timeout=30)
    assert info.labels["running_lora_adapters"] == "a,b"  # c is not in a slot yet
    await asyncio.gather(blocker, waiting)
    await server.engine.idle()
    info = await lora_info(server)
    # c took the slot of the adapter used least recently.
    assert (info.labels["running_lora_adapters"], info.labels["waiting_lora_adapters"]) == (
        "b,c",
        "",
    )
    await server.post("/v1/unload_lora_adapter", {"lora_name": "b"})
    assert (await lora_info(server)).labels["running_lora_adapters"] == "c"


def test_set_lora_info_replaces_its_one_series() -> None:
    metrics = Metrics()

    def series() -> list[tuple[dict[str, str], float]]:
        (family,) = [f for f in metrics.registry.collect() if f.name == "vllm:lora_requests_info"]
        return [(s.labels, s.value) for s in family.samples]

    assert series() == []
    metrics.set_lora_info(4, running={"b", "a"}, waiting=(), at=100.0)
    labels = {"max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": ""}
    assert series() == [(labels, 100.0)]
    metrics.set_lora_info(4, running=["a", "b"], waiting=(), at=101.0)  # refreshed, same labels
    assert series() == [(labels, 101.0)]
    metrics.set_lora_info(4, running=["a"], waiting=["c", "b"], at=102.0)
    labels = {"max_lora": "4", "running_lora_adapters": "a", "waiting_lora_adapters": "b,c"}
    assert series() == [(labels, 102.0)]


async def test_requests_are_counted_by_the_model_they_named(server: Server, assets: Assets) -> None:
    """`lora_model_requests_total`: the dashboards' requests per adapter, over /metrics."""
    await server.load("a", assets.adapter_a)
    await asyncio.gather(server.image(model="a"), server.image(model="a"), server.image())
    await server.image(lora={"name": "a", "scale": 0.5})
    counted = {
        s.labels["model"]: s.value
        for s in (await scrape(server))["lora_model_requests"]
        if s.name == "lora_model_requests_total"
    }
    assert counted == {"a": 3.0, server.engine.config.model_id: 1.0}
