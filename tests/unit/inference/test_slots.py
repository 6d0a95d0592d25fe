"""LoRA slots on real peft layers: activation cost, and merges that always come back exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from lora_inference.costs import FusePolicy
from lora_inference.pipeline import DiffusionBackend, ImageJob, ParsedAdapter
from lora_inference.slots import Group, LayerWeights, Slots
from peft.tuners.lora import LoraLayer

from tests.unit.inference.conftest import Assets


@pytest.fixture
def parsed(backend: DiffusionBackend, assets: Assets) -> Iterator[list[ParsedAdapter]]:
    yield [
        backend.parse_adapter(path, name=path.name, max_rank=64)
        for path in (assets.adapter_a, assets.adapter_b, assets.kohya)
    ]
    for slot in backend.resident_keys():
        backend.clear(slot)


def enabled_layers(backend: DiffusionBackend) -> dict[str, list[str]]:
    """Every LoRA layer of the pipeline that runs a branch, with its active slots."""
    return {
        f"{component}.{name}": list(module.active_adapters)
        for component in backend.components
        for name, module in getattr(backend.pipe, component).named_modules()
        if isinstance(module, LoraLayer) and not module.disable_adapters
    }


def test_activation_touches_the_batch_and_the_previous_batch_whatever_is_resident(
    backend: DiffusionBackend, parsed: list[ParsedAdapter]
) -> None:
    a, b, _ = parsed
    backend.place("only", a)
    backend.slots.activate({})
    alone = backend.slots.activate({"only": 1.0})
    backend.clear("only")

    for i in range(12):  # twelve resident adapters, in three layouts
        backend.place(f"many{i}", parsed[i % 3])
    backend.slots.activate({})
    assert backend.slots.activate({"many0": 1.0}) == alone == len(a.layers)
    assert enabled_layers(backend) == {f"{c}.{m}": ["many0"] for c, m in a.layers}
    # The next batch switches off what the previous one left on, and nothing else.
    assert backend.slots.activate({"many1": 0.5}) == len(a.layers.keys() | b.layers.keys())
    assert enabled_layers(backend) == {f"{c}.{m}": ["many1"] for c, m in b.layers}
    # Routed: peft runs no branch; the routing hooks add each image's own.
    backend.slots.activate({"many0": 1.0, "many1": 1.0}, routed=True)
    assert enabled_layers(backend) == {}


def test_an_evicted_slot_takes_the_newcomers_layers_only(
    backend: DiffusionBackend, parsed: list[ParsedAdapter]
) -> None:
    a, b, _ = parsed
    backend.place("s", b)  # UNet and text encoder
    backend.slots.activate({"s": 1.0})
    backend.place("s", a)  # UNet only: the text-encoder layers must lose the slot
    holding = {
        f"{component}.{name}"
        for component in backend.components
        for name, module in getattr(backend.pipe, component).named_modules()
        if isinstance(module, LoraLayer) and "s" in module.lora_A
    }
    assert holding == {f"{c}.{m}" for c, m in a.layers}
    assert enabled_layers(backend) == {}  # the text encoder is not left running the old branch


def probe_layer(dtype: torch.dtype) -> tuple[Slots, Any, tuple[str, str]]:
    """One Linear holding one slot; returns the slots, the (wrapped) layer and its key."""
    torch.manual_seed(0)
    probe = torch.nn.ModuleDict({"layer": torch.nn.Linear(64, 64, dtype=dtype)})
    slots = Slots({"probe": probe})
    key = ("probe", "layer")
    down, up = torch.randn(8, 64, dtype=dtype), torch.randn(64, 8, dtype=dtype)
    slots.place("s", {key: LayerWeights(down=down, up=up, alpha=8, rslora=False)})
    return slots, probe["layer"], key


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_merged_weights_come_back_bit_for_bit_where_subtracting_would_drift(
    dtype: torch.dtype,
) -> None:
    slots, layer, key = probe_layer(dtype)
    weight = layer.get_base_layer().weight
    before = weight.clone()
    subtracted = weight.clone()
    for scale in [1.0, 0.3, -2.0, 0.7] * 3:
        slots.activate({"s": scale}, merged=[key])
        with slots.merged("s", [key]):
            assert not torch.equal(weight, before)
            delta = layer.get_delta_weight("s")
        subtracted += delta
        subtracted -= delta
        assert torch.equal(weight, before)
    if dtype == torch.float16:
        assert not torch.equal(subtracted, before)  # why restores copy instead


def test_a_call_that_fails_inside_a_merge_still_restores() -> None:
    slots, layer, key = probe_layer(torch.float32)
    weight = layer.get_base_layer().weight
    before = weight.clone()
    slots.activate({"s": 1.0}, merged=[key])
    with pytest.raises(RuntimeError, match="generation failed"), slots.merged("s", [key]):
        raise RuntimeError("generation failed")
    assert torch.equal(weight, before)


@pytest.mark.parametrize("repeats", [1, 2], ids=["unguided", "guided"])
def test_a_fused_pass_adds_each_images_branch_as_one_pass_per_adapter_does(repeats: int) -> None:
    """Adapters of ranks 2, 4 and 8 over images [a a b base c], 3-d and 2-d inputs alike."""
    torch.manual_seed(0)
    dtype = torch.float64
    probe = torch.nn.ModuleDict({"layer": torch.nn.Linear(16, 12, dtype=dtype)})
    slots = Slots({"probe": probe})
    key = ("probe", "layer")
    for slot, rank in (("a", 2), ("b", 4), ("c", 8)):
        down, up = torch.randn(rank, 16, dtype=dtype), torch.randn(12, rank, dtype=dtype)
        slots.place(slot, {key: LayerWeights(down=down, up=up, alpha=rank / 2, rslora=False)})
    groups = [Group("a", 0, 2), Group("b", 2, 3), Group("c", 4, 5)]
    slots.activate({"a": 1.0, "b": -0.5, "c": 2.0}, routed=True)
    layer = probe["layer"]
    for shape in [(repeats * 5, 7, 16), (repeats * 5, 16)]:
        x = torch.randn(*shape, dtype=dtype)
        with slots.routed(groups, 5):
            apart = layer(x)
        with slots.routed(groups, 5, fused=[key]):
            fused = layer(x)
            again = layer(x)  # the per-image matrices are built once per call
        base = layer(x)
        torch.testing.assert_close(fused, apart, rtol=0, atol=1e-12)
        torch.testing.assert_close(again, apart, rtol=0, atol=1e-12)
        by_image = base.view(repeats, 5, -1)
        changed = (apart.view(repeats, 5, -1) - by_image).abs().amax(dim=(0, 2))
        assert changed[3] == 0 and bool((changed[[0, 1, 2, 4]] > 0).all())  # image 3: the base


def test_a_mixed_call_fused_draws_the_images_it_draws_one_pass_per_adapter(
    backend: DiffusionBackend, parsed: list[ParsedAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three adapters (one with text-encoder layers, one kohya) and the base model in one call,
    with every Linear layer fused (`--fuse auto` as the plan says) and none (`--fuse never`)."""
    for slot, adapter in zip(("a", "b", "k"), parsed, strict=True):
        backend.place(slot, adapter)
    jobs = [ImageJob("a red square", None, (0,)) for _ in range(4)]  # one seed: only LoRA differs
    slots = ["a", "b", None, "k"]
    scales = {"a": 1.0, "b": 1.0, "k": 0.7}

    def every_linear(groups: list[Group], call: object) -> list[tuple[str, str]]:
        layers = backend.slots.routed_layers(groups)
        return [(c, m) for c, m in layers if backend.shapes[c][m].kernel is None]

    fused_layers: list[list[tuple[str, str]]] = []
    routed = backend.slots.routed

    def recording(groups: list[Group], images: int, *, fused: Any = ()) -> Any:
        fused_layers.append(list(fused))
        return routed(groups, images, fused=fused)

    monkeypatch.setattr(backend, "fuse_plan", every_linear)
    monkeypatch.setattr(backend.slots, "routed", recording)

    def images(fuse: FusePolicy) -> list[np.ndarray]:
        outcome = backend.run_batch(
            jobs, slots, scales, width=32, height=32, steps=2, guidance_scale=5.0, fuse=fuse
        )
        assert outcome.path == "mixed"
        return [np.asarray(image).astype(int) for image in outcome.images]

    apart, fused = images("never"), images("auto")
    assert fused_layers[0] == [] and len(fused_layers[1]) > 0
    for one, other in zip(apart, fused, strict=True):
        assert np.abs(one - other).max() <= 1  # batched float rounding at most
    for i, j in [(0, 1), (0, 2), (0, 3), (1, 3)]:
        assert np.abs(fused[i] - fused[j]).mean() > 1  # each image kept its own adapter


def test_only_linear_layers_fuse() -> None:
    probe = torch.nn.ModuleDict({"conv": torch.nn.Conv2d(4, 4, 3, padding=1)})
    slots = Slots({"probe": probe})
    key = ("probe", "conv")
    down, up = torch.randn(2, 4, 3, 3), torch.randn(4, 2, 1, 1)
    slots.place("a", {key: LayerWeights(down=down, up=up, alpha=2, rslora=False)})
    routed = slots.routed([Group("a", 0, 1)], 2, fused=[key])
    with pytest.raises(ValueError, match=r"only Linear layers fuse; .* is a Conv2d"), routed:
        pass
    assert not probe["conv"]._forward_hooks  # nothing left hooked
