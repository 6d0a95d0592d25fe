"""Bit-exact properties of the real diffusers/peft code on a tiny pipeline (CPU, fixed seeds).

No image may ever be affected by another request's adapter, and a refused adapter leaves the
pipeline exactly as it was. Comparisons are on decoded PNG pixels and exact unless a test says
otherwise (batching changes float rounding, so exact tests keep requests in batches of one).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lora_inference import errors
from lora_inference.backend import ImageJob
from lora_inference.pipeline import DiffusionBackend

from tests.unit.inference.bad_adapters import BadAdapter
from tests.unit.inference.conftest import Assets, Reference, Server


async def test_scale_zero_equals_base(server: Server, assets: Assets) -> None:
    base = await server.image()
    await server.load("b", assets.adapter_b)
    assert np.array_equal(await server.image(lora={"name": "b", "scale": 0.0}), base)
    assert not np.array_equal(await server.image(lora={"name": "b", "scale": 1.0}), base)


async def test_scale_changes_the_image_and_negative_scales_work(
    server: Server, assets: Assets
) -> None:
    await server.load("a", assets.adapter_a)
    images = [await server.image(lora={"name": "a", "scale": s}) for s in (1.0, 0.5, -1.0)]
    assert not np.array_equal(images[0], images[1])
    assert not np.array_equal(images[0], images[2])
    # Scale is not sticky: asking for 1.0 again gives the first image back.
    assert np.array_equal(await server.image(lora={"name": "a", "scale": 1.0}), images[0])


async def test_load_scale_is_the_default_a_request_can_override(
    server: Server, assets: Assets
) -> None:
    """The load call's `scale` (the CRD's spec.scale) applies when a request names no scale."""
    explicit = {s: await _alone(server, assets, s) for s in (0.5, -1.0)}
    await server.load("a", assets.adapter_a, scale=0.5)
    assert np.array_equal(await server.image(model="a"), explicit[0.5])
    assert np.array_equal(await server.image(lora={"name": "a", "scale": -1.0}), explicit[-1.0])
    _, models = await server.get("/v1/models")
    card = next(c for c in models["data"] if c["id"] == "a")
    assert (card["scale"], card["pinned"], len(card["sha256"])) == (0.5, False, 64)
    # An in-place reload changes the default without changing the weights.
    await server.load("a", assets.adapter_a, scale=-1.0, load_inplace=True)
    assert np.array_equal(await server.image(model="a"), explicit[-1.0])


async def _alone(server: Server, assets: Assets, scale: float) -> np.ndarray:
    await server.load("ref", assets.adapter_a)
    image = await server.image(lora={"name": "ref", "scale": scale})
    status, body = await server.post("/v1/unload_lora_adapter", {"lora_name": "ref"})
    assert status == 200, body
    return image


async def test_after_unload_equals_base(server: Server, assets: Assets) -> None:
    base = await server.image()
    await server.load("b", assets.adapter_b)
    await server.image(model="b")
    status, _ = await server.post("/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200
    await server.engine.idle()
    assert server.engine.backend.resident_keys() == set()
    assert np.array_equal(await server.image(), base)


async def test_interleaved_requests_never_see_each_others_adapter(
    start_server: Any, assets: Assets
) -> None:
    """With one GPU slot every switch evicts; concurrent A, B and base requests stay exact."""
    server = await start_server(max_loras=1, max_batch_size=1)
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)  # has text-encoder layers, a does not
    reference = {
        "base": await server.image(),
        "a": await server.image(model="a"),
        "b": await server.image(model="b"),
    }
    order = ["a", "b", "base", "a", "base", "b", "b", "a", "a", "base"]
    results = await asyncio.gather(
        *(server.image(**({} if name == "base" else {"model": name})) for name in order)
    )
    for name, image in zip(order, results, strict=True):
        assert np.array_equal(image, reference[name]), name
    assert reference["a"].tolist() != reference["b"].tolist()
    assert server.metric("lora_adapter_evictions_total", tier="gpu") >= 3


async def test_batched_requests_match_unbatched_ones(start_server: Any, assets: Assets) -> None:
    server = await start_server(max_batch_size=4)
    await server.load("a", assets.adapter_a)
    alone = [await server.image(model="a", seed=s) for s in (1, 2, 3)]
    together = await asyncio.gather(*(server.image(model="a", seed=s) for s in (1, 2, 3)))
    for single, batched in zip(alone, together, strict=True):
        # Batching changes float rounding in the matmuls, never more than one 8-bit level.
        assert np.abs(single.astype(int) - batched.astype(int)).max() <= 1
    # Fewer pipeline calls than images: some batches held several.
    assert server.metric("lora_batch_images_count") < server.metric("lora_batch_images_sum")


async def test_refused_adapters_leave_base_and_others_bit_identical(
    server: Server, assets: Assets, bad_adapters: list[BadAdapter]
) -> None:
    await server.load("a", assets.adapter_a)
    base, with_a = await server.image(), await server.image(model="a")
    for bad in bad_adapters:
        status, _ = await server.post(
            "/v1/load_lora_adapter", {"lora_name": bad.name, "lora_path": str(bad.path)}
        )
        assert status == bad.status, bad.name
        assert np.array_equal(await server.image(), base), bad.name
        assert np.array_equal(await server.image(model="a"), with_a), bad.name


def test_a_copy_that_cannot_fit_leaves_the_pipeline_as_it_was(
    backend: DiffusionBackend, assets: Assets
) -> None:
    """Bypass our checks so one layer of an adapter does not fit its slot (the last one, after
    every UNet layer): it is refused before anything is copied, the slot is emptied, and the
    base model and the adapter in the other slot are bit-identical afterwards."""
    good = backend.parse_adapter(assets.adapter_b, name="good", max_rank=64)
    other = backend.parse_adapter(assets.adapter_a, name="other", max_rank=64)
    layers = dict(good.layers)
    last = list(layers)[-1]  # a text-encoder layer, after every UNet layer
    layers[last] = replace(layers[last], down=torch.randn(layers[last].rank, 48))
    backend.place("kept", other)
    job = ImageJob(prompt="a lighthouse", negative_prompt=None, seeds=(7,))

    def render(slot: str | None) -> np.ndarray:
        scales = {slot: 1.0} if slot else {}
        outcome = backend.run_batch(
            [job], [slot], scales, width=32, height=32, steps=2, guidance_scale=5.0, merge="never"
        )
        return np.asarray(outcome.images[0])

    before = render(None), render("kept")
    with pytest.raises(ValueError, match="do not fit a layer"):
        backend.slots.place("broken", layers)  # packed here, as parse_adapter packs
    assert backend.resident_keys() == {"kept"}
    assert np.array_equal(render(None), before[0])
    assert np.array_equal(render("kept"), before[1])
    backend.clear("kept")
    assert backend.resident_keys() == set()


def test_weights_that_overflow_the_served_dtype_are_refused(assets: Assets, tmp_path: Path) -> None:
    """Finite in the file, infinite once cast to float16: refused, naming the tensor."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(assets.adapter_a / "pytorch_lora_weights.safetensors"))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = 1e6  # beyond float16's 65504
    (tmp_path / "big").mkdir()
    save_file(tensors, str(tmp_path / "big" / "pytorch_lora_weights.safetensors"))
    half = DiffusionBackend.load(assets.model, device="cpu", dtype=torch.float16)
    with pytest.raises(errors.IncompatibleAdapter, match=f"{key}.*overflows float16"):
        half.parse_adapter(tmp_path / "big", name="big", max_rank=64)


async def test_kohya_adapter_loads_and_changes_output(server: Server, assets: Assets) -> None:
    base = await server.image()
    await server.load("kohya", assets.kohya)
    assert not np.array_equal(await server.image(model="kohya"), base)


async def test_inplace_swap_keeps_admitted_requests_on_old_weights(
    start_server: Any, assets: Assets
) -> None:
    server = await start_server(max_batch_size=1)
    await server.load("ref-a", assets.adapter_a)
    await server.load("ref-b", assets.adapter_b)
    old, new = await server.image(model="ref-a"), await server.image(model="ref-b")
    await server.load("s", assets.adapter_a)
    old_key = server.engine.registry.get("s").key

    blocker = asyncio.create_task(server.image(num_inference_steps=40, seed=1))
    early = [asyncio.create_task(server.image(model="s")) for _ in range(2)]
    while len(server.engine._queue) < 2:
        await asyncio.sleep(0.01)
    await server.load("s", assets.adapter_b, load_inplace=True)
    late = [asyncio.create_task(server.image(model="s")) for _ in range(2)]
    await blocker
    for image in await asyncio.gather(*early):
        assert np.array_equal(image, old)
    for image in await asyncio.gather(*late):
        assert np.array_equal(image, new)
    await server.engine.idle()
    assert old_key not in server.engine.residency.gpu  # collected once unused


async def test_failed_inplace_swap_keeps_the_old_adapter_serving(
    server: Server, assets: Assets, bad_adapters: list[BadAdapter]
) -> None:
    await server.load("s", assets.adapter_a)
    before = await server.image(model="s")
    wrong = next(b for b in bad_adapters if b.name == "wrong-shapes")
    status, _ = await server.post(
        "/v1/load_lora_adapter",
        {"lora_name": "s", "lora_path": str(wrong.path), "load_inplace": True},
    )
    assert status == 422
    assert np.array_equal(await server.image(model="s"), before)


async def test_pinned_adapters_stay_resident(start_server: Any, assets: Assets) -> None:
    server = await start_server(max_loras=2)
    await server.load("pinned", assets.adapter_a, pinned=True)
    for name, path in [("x", assets.adapter_b), ("y", assets.kohya)]:
        await server.load(name, path)
        await server.image(model=name)
    _, listing = await server.get("/v1/adapters")
    tiers = {a["id"]: a["tier"] for a in listing["data"]}
    assert tiers["pinned"] == "gpu" and tiers["y"] == "gpu" and tiers["x"] == "cpu"


async def test_pinning_more_than_the_slots_says_so(start_server: Any, assets: Assets) -> None:
    server = await start_server(max_loras=1)
    await server.load("p1", assets.adapter_a, pinned=True)
    status, body = await server.post(
        "/v1/load_lora_adapter",
        {"lora_name": "p2", "lora_path": str(assets.adapter_b), "pinned": True},
    )
    assert status == 400 and "pinned" in body["error"]["message"]
    await server.load("free", assets.adapter_b)
    status, body = await server.post(
        "/v1/images/generations", {"prompt": "x", "model": "free", "size": "32x32"}, token=None
    )
    assert (
        status == 400
        and "all 1 slots are pinned or in use (pinned: p1)" in body["error"]["message"]
    )


async def test_static_adapters_are_pinned_and_cannot_be_unloaded(
    start_server: Any, assets: Assets
) -> None:
    from lora_inference.config import StaticLora

    server = await start_server(static_loras=(StaticLora("fixed", assets.adapter_a),))
    _, listing = await server.get("/v1/adapters")
    assert (
        listing["data"][0] | {"id": "fixed", "pinned": True, "tier": "gpu", "origin": "static"}
        == listing["data"][0]
    )
    status, _ = await server.post("/v1/unload_lora_adapter", {"lora_name": "fixed"})
    assert status == 400


async def test_requests_whose_client_left_are_dropped(start_server: Any) -> None:
    server = await start_server(max_batch_size=1)
    blocker = asyncio.create_task(server.image(num_inference_steps=40, seed=2))
    while not server.engine._pipeline_lock.locked():  # the blocker is running
        await asyncio.sleep(0.005)
    body = {"prompt": "gone", "size": "32x32", "num_inference_steps": 2}
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.2):
            await server.session.post(server.url("/v1/images/generations"), json=body)
    await blocker
    await server.engine.idle()
    assert server.metric("lora_generation_requests_total", outcome="dropped") == 1


async def test_a_queue_full_of_departed_clients_still_takes_a_live_one(start_server: Any) -> None:
    """Abandoned requests are dropped before the queue is judged full: no 429 for a live client."""
    server = await start_server(max_batch_size=1, max_queue=2)
    blocker = asyncio.create_task(server.image(num_inference_steps=40, seed=2))
    while not server.engine._pipeline_lock.locked():  # the blocker is running
        await asyncio.sleep(0.005)
    body = {"prompt": "gone", "size": "32x32", "num_inference_steps": 2}
    url = server.url("/v1/images/generations")
    leaving = [asyncio.create_task(server.session.post(url, json=body)) for _ in range(2)]
    while len(server.engine._queue) < 2:  # the queue is full ...
        await asyncio.sleep(0.005)
    for request in leaving:  # ... and both clients leave
        request.cancel()
    await asyncio.gather(*leaving, return_exceptions=True)
    while not all(p.gone() for p in server.engine._queue):  # the server notices they left
        await asyncio.sleep(0.01)
    live = asyncio.create_task(server.image(seed=5))
    await blocker
    await live  # 200, not 429
    assert server.metric("lora_generation_requests_total", outcome="rejected") == 0
    assert server.metric("lora_generation_requests_total", outcome="dropped") == 2


async def test_one_batch_serves_several_adapters_without_leaking(
    start_server: Any, assets: Assets
) -> None:
    """A, B (text-encoder layers too), kohya and base in ONE pipeline call: each its own image."""
    server = await start_server(max_loras=3, max_batch_size=4)
    for name, path in [("a", assets.adapter_a), ("b", assets.adapter_b), ("k", assets.kohya)]:
        await server.load(name, path)
    requests: dict[str, dict[str, Any]] = {
        "a": {"model": "a"},
        "b": {"model": "b"},
        "k": {"lora": {"name": "k", "scale": 0.7}},
        "base": {},
    }
    alone = {name: await server.image(**body) for name, body in requests.items()}

    calls = server.metric("lora_generation_seconds_count")
    blocker = asyncio.create_task(server.image(num_inference_steps=40, seed=3))
    while not server.engine._pipeline_lock.locked():
        await asyncio.sleep(0.005)
    together = await asyncio.gather(*(server.image(**body) for body in requests.values()))
    await blocker
    assert server.metric("lora_generation_seconds_count") == calls + 2  # blocker + one batch

    for name, image in zip(requests, together, strict=True):
        # Same image as alone, up to batched float rounding ...
        assert np.abs(image.astype(int) - alone[name].astype(int)).max() <= 1, name
        # ... and far from every other adapter's image.
        for other in requests:
            if other != name:
                assert np.abs(image.astype(int) - alone[other].astype(int)).mean() > 1, (
                    name,
                    other,
                )


async def test_every_switch_is_a_copy_and_images_equal_diffusers_own(
    start_server: Any,
    assets: Assets,
    tmp_path: Path,
    reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adapters enter the pipeline by being copied into a slot, never through diffusers' load.

    `half` differs from `other` only in its alpha, `b` and `k` carry text-encoder layers in two
    file formats, `a` and `b` target different layers, `r8` and `r2` have other ranks; through
    one slot and through two, every image equals the one diffusers makes with
    `load_lora_weights` (unmerged, so bit for bit).
    """
    from lora_inference.tools.random_adapters import (
        build_random_lora,
        to_kohya,
        write_random_adapter,
    )
    from safetensors.torch import save_file

    roots = (assets.root, tmp_path)
    tight = await start_server(
        max_loras=1, max_cpu_loras=8, max_batch_size=1, allowed_roots=roots, merge="never"
    )

    def tripwire(*_: object, **__: object) -> None:
        raise AssertionError("an adapter went through diffusers' load_lora_weights")

    monkeypatch.setattr(tight.engine.backend.pipe, "load_lora_weights", tripwire)
    pipe = tight.engine.backend.pipe
    other = tmp_path / "other.safetensors"
    save_file(to_kohya(build_random_lora(pipe, seed=11), rank=4), str(other))
    half = tmp_path / "half-alpha.safetensors"
    halved = {
        k: (v * 0 + 2.0 if k.endswith(".alpha") else v)
        for k, v in to_kohya(build_random_lora(pipe, seed=12), rank=4).items()
    }
    save_file(halved, str(half))
    ranked = {
        f"r{rank}": write_random_adapter(
            tmp_path / f"r{rank}",
            pipe,
            base_model=assets.model.name,
            rank=rank,
            seed=rank,
            text_encoder=rank > 4,
        )
        for rank in (8, 2)
    }
    adapters = {
        "a": assets.adapter_a,
        "other": other,
        "half": half,
        "b": assets.adapter_b,
        "k": assets.kohya,
        **ranked,
    }
    expected = {name: reference(path) for name, path in adapters.items()}
    for name, path in adapters.items():
        await tight.load(name, path)
    sequence = ["a", "other", "a", "half", "other", "a", "half", "b", "k", "b", "k", "a", "b"]
    sequence += ["r8", "r2", "b", "r8", "a", "r2", "r8"]
    for name in sequence:
        assert np.array_equal(await tight.image(model=name), expected[name]), name
    assert len(tight.engine.backend.resident_keys()) == 1
    assert tight.metric("lora_adapter_loads_total", tier="gpu", result="ok") == tight.metric(
        "lora_adapter_lookups_total", result="miss"
    )

    two = await start_server(max_loras=2, max_batch_size=1, allowed_roots=roots, merge="never")
    for name, path in adapters.items():
        await two.load(name, path)
    for name in ["a", "b", "other", "a", "b", "other", "k", "half", "r8", "r2", "b", "r8"]:
        assert np.array_equal(await two.image(model=name), expected[name]), name


async def test_a_pinned_swap_the_pipeline_refuses_keeps_the_old_adapter(
    server: Server, assets: Assets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline refusing an adapter that passed every check (our own seam, forced here)."""
    await server.load("s", assets.adapter_a, pinned=True)
    before = await server.image(model="s")
    backend = server.engine.backend

    def refuse(*_: object) -> None:
        raise errors.IncompatibleAdapter("refused for the test", param="lora_path")

    monkeypatch.setattr(backend, "place", refuse)
    status, body = await server.post(
        "/v1/load_lora_adapter",
        {
            "lora_name": "s",
            "lora_path": str(assets.adapter_b),
            "load_inplace": True,
            "pinned": True,
        },
    )
    assert status == 422 and "refused for the test" in body["error"]["message"]
    monkeypatch.undo()
    assert server.engine.registry.get("s").path == assets.adapter_a.resolve()
    assert np.array_equal(await server.image(model="s"), before)
