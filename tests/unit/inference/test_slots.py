"""The slot buffers: packing, one-copy fills, the gathered pass, and merges that come back exactly.

Exactness is checked in float64 against each format's definition: a layer's output is its base
output plus, per image, `scale x (alpha / r) x B @ A @ x` of that image's adapter (nothing for a
base-model image), whatever the other images of the call use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from lora_inference import slot_packing
from lora_inference.backend import ImageJob, ParsedAdapter
from lora_inference.pipeline import DiffusionBackend
from lora_inference.slot_packing import LayerWeights
from lora_inference.slots import Slots

from tests.unit.inference.conftest import Assets, BatchShape

R_MAX = 8


@pytest.fixture
def parsed(backend: DiffusionBackend, assets: Assets) -> Iterator[list[ParsedAdapter]]:
    yield [
        backend.parse_adapter(path, name=path.name, max_rank=64)
        for path in (assets.adapter_a, assets.adapter_b, assets.kohya)
    ]
    for slot in backend.resident_keys():
        backend.clear(slot)


def probe(dtype: torch.dtype = torch.float64) -> tuple[Slots, torch.nn.ModuleDict]:
    """A Linear and a 3x3 Conv2d (padding 1, stride 2) with room for three slots of rank 8."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleDict(
        {
            "linear": torch.nn.Linear(16, 12, dtype=dtype),
            "conv": torch.nn.Conv2d(6, 5, 3, stride=2, padding=1, dtype=dtype),
        }
    )
    return Slots({"probe": layers}, count=3, max_rank=R_MAX), layers


def random_weights(module: torch.nn.Module, rank: int, alpha: float) -> LayerWeights:
    if isinstance(module, torch.nn.Conv2d):
        down = torch.randn(rank, module.in_channels, 3, 3, dtype=torch.float64)
        up = torch.randn(module.out_channels, rank, 1, 1, dtype=torch.float64)
    else:
        assert isinstance(module, torch.nn.Linear)
        down = torch.randn(rank, module.in_features, dtype=torch.float64)
        up = torch.randn(module.out_features, rank, dtype=torch.float64)
    return LayerWeights(down=down, up=up, alpha=alpha, rslora=False)


def by_definition(module: Any, x: torch.Tensor, weights: LayerWeights, scale: float) -> Any:
    """One image's layer output from the format's definition: W x + scale (alpha/r) B A x."""
    if isinstance(module, torch.nn.Conv2d):
        inner = torch.nn.functional.conv2d(x, weights.down, stride=2, padding=1)
        branch = torch.nn.functional.conv2d(inner, weights.up)
    else:
        branch = x @ weights.down.T @ weights.up.T
    return module(x) + scale * weights.scaling * branch


@pytest.mark.parametrize("repeats", [1, 2], ids=["unguided", "guided"])
def test_a_gathered_call_gives_every_image_its_own_adapter_exactly(repeats: int) -> None:
    """Ranks 2 and R_MAX (one below the maximum, one at it) and a base-model image in one call,
    on a Linear (3-d and 2-d inputs) and a Conv2d; the rows repeat under guidance."""
    slots, layers = probe()
    adapters = {}
    for slot, rank in (("a", 2), ("b", R_MAX)):
        adapters[slot] = {
            ("probe", name): random_weights(layers[name], rank, alpha=rank / 2)
            for name in ("linear", "conv")
        }
        slots.place(slot, adapters[slot])
    per_image = ["a", "b", None, "a"]
    scales = {"a": 1.5, "b": -0.5}
    inputs: dict[str, list[tuple[int, ...]]] = {
        "linear": [(repeats * 4, 7, 16), (repeats * 4, 16)],
        "conv": [(repeats * 4, 6, 9, 9)],
    }
    for name, shapes in inputs.items():
        module = layers[name]
        for shape in shapes:
            x = torch.randn(*shape, dtype=torch.float64)
            with slots.call(per_image, scales):
                got = module(x)
            for row in range(shape[0]):
                owner = per_image[row % 4]
                one = x[row : row + 1]
                want = (
                    module(one)
                    if owner is None
                    else by_definition(module, one, adapters[owner][("probe", name)], scales[owner])
                )
                torch.testing.assert_close(got[row : row + 1], want, rtol=0, atol=1e-10)
            assert torch.equal(got[2::4], module(x)[2::4])  # the base image, bit for bit


def test_a_call_of_one_adapter_merged_or_not_matches_the_definition() -> None:
    slots, layers = probe()
    weights = {("probe", n): random_weights(layers[n], 4, alpha=8) for n in ("linear", "conv")}
    slots.place("a", weights)
    x = {"linear": torch.randn(3, 5, 16, dtype=torch.float64)}
    x["conv"] = torch.randn(3, 6, 9, 9, dtype=torch.float64)
    want = {n: by_definition(layers[n], x[n], weights[("probe", n)], 0.7) for n in x}
    for merged in ([], list(weights)):
        with slots.call(["a"] * 3, {"a": 0.7}, merged=merged):
            for name in ("linear", "conv"):
                torch.testing.assert_close(layers[name](x[name]), want[name], rtol=0, atol=1e-10)


def test_the_packed_layout_round_trips_every_layer_and_a_refill_touches_no_other_slot(
    backend: DiffusionBackend, parsed: list[ParsedAdapter]
) -> None:
    slots = backend.slots
    a, b, k = parsed
    for adapter in parsed:
        ranks = {key: w.rank for key, w in adapter.layers.items()}
        rows = slot_packing.unpack(slots.layout, adapter.packed, ranks)
        for key, weights in adapter.layers.items():
            down, up = rows[key]
            assert torch.equal(down, weights.down.reshape(weights.rank, -1).to(slots.dtype))
            # B x scaling in the slots' dtype, one rounding, as peft scales its branch.
            scaled = weights.up.reshape(weights.up.shape[0], -1).to(slots.dtype) * weights.scaling
            assert torch.equal(up, scaled)
        # Everything else in the row is zero: a copy overwrites the previous occupant entirely.
        assert adapter.packed.count_nonzero() == sum(
            w.down.count_nonzero() + w.up.count_nonzero() for w in adapter.layers.values()
        )
    backend.place("kept", a)
    backend.place("moving", b)
    job = ImageJob(prompt="a red square", negative_prompt=None, seeds=(3,))
    shape: BatchShape = {"width": 32, "height": 32, "steps": 2, "guidance_scale": 5.0}

    def mixed() -> list[np.ndarray]:
        outcome = backend.run_batch(
            [job, job], ["kept", "moving"], {"kept": 1.0, "moving": 1.0}, **shape
        )
        return [np.asarray(image) for image in outcome.images]

    kept_before, moving_before = mixed()
    backend.place("moving", k)  # refilled between calls
    kept_after, moving_after = mixed()
    assert np.array_equal(kept_before, kept_after)
    assert not np.array_equal(moving_before, moving_after)
    assert backend.slots.footprint("moving") == {key: w.rank for key, w in k.layers.items()}


def test_a_rank_above_the_slots_or_a_shape_that_does_not_fit_is_refused_before_any_copy() -> None:
    slots, layers = probe()
    good = {("probe", "linear"): random_weights(layers["linear"], 4, alpha=4)}
    slots.place("a", good)
    x = torch.randn(2, 16, dtype=torch.float64)
    with slots.call(["a", "a"], {"a": 1.0}):
        before = layers["linear"](x)
    too_big = {("probe", "linear"): random_weights(layers["linear"], R_MAX + 1, alpha=1)}
    with pytest.raises(ValueError, match=rf"rank {R_MAX + 1} is above the slots' --max-lora-rank"):
        slots.pack(too_big)
    wrong = LayerWeights(torch.randn(4, 15), torch.randn(12, 4), alpha=4, rslora=False)
    with pytest.raises(ValueError, match="do not fit a layer of 16 in and 12 out"):
        slots.place("b", {("probe", "linear"): wrong})
    assert slots.held() == {"a"}
    with slots.call(["a", "a"], {"a": 1.0}):
        assert torch.equal(layers["linear"](x), before)


def test_an_adapter_packs_into_as_many_planes_as_its_rank_and_a_refill_clears_the_rest() -> None:
    """A rank-2 adapter is 2 of the row's R_MAX planes on the CPU; copied into the slot a rank-8
    adapter held, it leaves nothing of the old one's higher ranks behind."""
    slots, layers = probe()
    big = {("probe", n): random_weights(layers[n], R_MAX, alpha=4) for n in ("linear", "conv")}
    small = {("probe", n): random_weights(layers[n], 2, alpha=1) for n in ("linear", "conv")}
    packed = slots.pack(small)
    assert packed.numel() == 2 * slots.layout.plane_elements
    assert slots.pack(big).numel() == slots.layout.row_elements
    slots.place("s", big)
    slots.place("s", small, packed)
    x = torch.randn(2, 16, dtype=torch.float64)
    want = by_definition(layers["linear"], x, small[("probe", "linear")], 1.0)
    with slots.call(["s", None], {"s": 1.0}):  # mixed: the gathered pass runs at rank R_MAX
        got = layers["linear"](x)
    torch.testing.assert_close(got[:1], want[:1], rtol=0, atol=1e-10)


def test_attention_layers_come_first_so_an_attention_adapter_packs_into_a_prefix() -> None:
    """`to_q` (attention) leads each plane whatever the model's order, then Linear layers, then
    the 3x3 Conv2d: an adapter of `to_q` alone packs into the prefix of each plane that holds
    it. Copied into a slot a wider and deeper adapter held, and gathered in a call beside an
    adapter of the conv, it leaves nothing of the old occupant behind, in any layer."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleDict(
        {
            "conv": torch.nn.Conv2d(6, 5, 3, stride=2, padding=1, dtype=torch.float64),
            "linear": torch.nn.Linear(16, 12, dtype=torch.float64),
            "to_q": torch.nn.Linear(16, 12, dtype=torch.float64),
        }
    )
    slots = Slots({"probe": layers}, count=3, max_rank=R_MAX)
    rooms = slots.layout.rooms
    assert rooms[("probe", "to_q")].a_offset == 0
    assert rooms[("probe", "to_q")].b_offset < rooms[("probe", "linear")].a_offset
    assert rooms[("probe", "linear")].b_offset < rooms[("probe", "conv")].a_offset
    keys = {n: ("probe", n) for n in layers}
    wide = {keys[n]: random_weights(layers[n], R_MAX, alpha=4) for n in layers}
    narrow = {keys["to_q"]: random_weights(layers["to_q"], 2, alpha=1)}
    other = {keys[n]: random_weights(layers[n], 3, alpha=3) for n in ("conv", "linear")}
    packed = slots.pack(narrow)
    assert tuple(packed.shape) == (2, 16 + 12)  # to_q's room only
    slots.place("s", wide)
    slots.place("s", narrow, packed)
    slots.place("o", other)
    x = {"conv": torch.randn(2, 6, 9, 9, dtype=torch.float64)}
    x["linear"] = x["to_q"] = torch.randn(2, 16, dtype=torch.float64)
    with slots.call(["s", "o"], {"s": 1.0, "o": 1.0}):  # every layer runs the gathered pass
        got = {n: layers[n](x[n]) for n in layers}
    for name in layers:
        owned = narrow.get(keys[name])
        want = layers[name](x[name][:1])
        if owned is not None:
            want = by_definition(layers[name], x[name][:1], owned, 1.0)
        torch.testing.assert_close(got[name][:1], want, rtol=0, atol=1e-10)
    slots.place("s", wide)
    slots.clear("s")
    slots.place("t", narrow)  # takes the row "s" left: all zeros again
    base = layers["conv"](x["conv"][:1])
    with slots.call(["t", "o"], {"t": 1.0, "o": 1.0}):
        assert torch.equal(layers["conv"](x["conv"])[:1], base)


def test_slots_are_a_fixed_number_and_a_cleared_one_is_reused() -> None:
    slots, layers = probe()
    weights = {("probe", "linear"): random_weights(layers["linear"], 2, alpha=2)}
    for slot in ("a", "b", "c"):
        slots.place(slot, weights)
    with pytest.raises(RuntimeError, match="all 3 slots are taken"):
        slots.place("d", weights)
    slots.clear("b")
    slots.place("d", weights)
    assert slots.held() == {"a", "c", "d"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_merged_weights_come_back_bit_for_bit_where_subtracting_would_drift(
    dtype: torch.dtype,
) -> None:
    slots, layers = probe(dtype)
    key = ("probe", "linear")
    linear = layers["linear"]
    assert isinstance(linear, torch.nn.Linear)
    weights = random_weights(linear, 8, alpha=8)
    slots.place("s", {key: LayerWeights(weights.down.to(dtype), weights.up.to(dtype), 8, False)})
    weight = linear.weight
    before = weight.clone()
    subtracted = weight.clone()
    for scale in [1.0, 0.3, -2.0, 0.7] * 3:
        with slots.call(["s"], {"s": scale}, merged=[key]):
            assert not torch.equal(weight, before)
            delta = slots.delta("s", key, scale).to(dtype)
        subtracted += delta
        subtracted -= delta
        assert torch.equal(weight, before)
    if dtype == torch.float16:
        assert not torch.equal(subtracted, before)  # why restores copy instead


def test_a_call_that_fails_inside_a_merge_still_restores_and_ends_the_call() -> None:
    slots, layers = probe(torch.float32)
    key = ("probe", "linear")
    linear = layers["linear"]
    assert isinstance(linear, torch.nn.Linear)
    slots.place("s", {key: random_weights(linear, 4, alpha=4)})
    weight = linear.weight
    before = weight.clone()
    x = torch.randn(1, 16)
    plain = layers["linear"](x)
    failing = slots.call(["s"], {"s": 1.0}, merged=[key])
    with pytest.raises(RuntimeError, match="generation failed"), failing:
        raise RuntimeError("generation failed")
    assert torch.equal(weight, before)
    assert torch.equal(layers["linear"](x), plain)  # no branch outside a call
