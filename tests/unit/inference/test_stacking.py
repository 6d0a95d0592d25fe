"""Stacked adapters: several adapters in one request, built into one adapter equal to their sum.

The arithmetic is checked on tensors against the deltas it must sum; the server is checked on the
tiny pipeline against diffusers' own `set_adapters` with several adapters, and for what a user
relies on: the order of the list changes nothing, a member at scale 0 is as if absent, a stack is
built once and rebuilt when a member is reloaded, unknown members and bad lists are named.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lora_inference import errors, stacking
from lora_inference.slot_packing import LayerWeights
from lora_inference.stackkeys import stack_name, stack_sha256
from lora_volume import errors as volume_errors
from lora_volume import files, stacks

from tests.unit.inference.conftest import Assets, Reference, Server

# One 8-bit level: float rounding differs between a stacked branch and several branches.
LEVEL = 1


def _weights(
    rank: int, inner: int, outer: int, *, seed: int, alpha: float, conv: bool = False
) -> LayerWeights:
    g = torch.Generator().manual_seed(seed)
    kernel = (3, 3) if conv else ()
    down = torch.randn((rank, inner, *kernel), generator=g)
    up = torch.randn((outer, rank, *((1, 1) if conv else ())), generator=g)
    return LayerWeights(down=down, up=up, alpha=alpha, rslora=False)


def _delta(w: LayerWeights, scale: float) -> torch.Tensor:
    """The weight change a layer's LoRA branch makes, as a matrix (convs flattened)."""
    return scale * w.scaling * (w.up.flatten(1) @ w.down.flatten(1))


def test_a_stack_is_the_sum_of_its_members_deltas_in_every_layer() -> None:
    linear, conv = ("unet", "q"), ("unet", "conv")
    a = {
        linear: _weights(4, 8, 6, seed=1, alpha=4),
        conv: _weights(2, 3, 5, seed=2, alpha=1, conv=True),
    }
    b = {linear: _weights(2, 8, 6, seed=3, alpha=8)}  # another rank and alpha; no conv layer
    stacked = stacking.compose(
        [stacking.Member("b", "0", -0.5, b), stacking.Member("a", "0", 0.8, a)]
    )
    expected_linear = _delta(a[linear], 0.8) + _delta(b[linear], -0.5)
    assert torch.allclose(_delta(stacked[linear], 1.0), expected_linear, atol=1e-5)
    assert torch.allclose(_delta(stacked[conv], 1.0), _delta(a[conv], 0.8), atol=1e-5)
    assert (stacked[linear].rank, stacked[linear].scaling, stacked[conv].rank) == (6, 1.0, 2)


def test_the_order_of_the_members_changes_no_bit_and_scale_zero_leaves_a_member_out() -> None:
    key = ("unet", "q")
    a = stacking.Member("a", "0", 0.7, {key: _weights(4, 8, 6, seed=1, alpha=4)})
    b = stacking.Member("b", "0", 0.3, {key: _weights(2, 8, 6, seed=2, alpha=2)})
    forward, backward = stacking.compose([a, b]), stacking.compose([b, a])
    assert torch.equal(forward[key].down, backward[key].down)
    assert torch.equal(forward[key].up, backward[key].up)
    silent = stacking.Member("b", "0", 0.0, b.layers)
    assert stacking.compose([a, silent])[key].rank == 4
    assert stacking.compose([silent]) == {}


def test_members_that_target_one_layer_with_other_shapes_cannot_stack() -> None:
    key = ("unet", "down_blocks.0.conv")
    a = stacking.Member("a", "0", 1.0, {key: _weights(4, 3, 5, seed=1, alpha=4, conv=True)})
    b = stacking.Member("b", "0", 1.0, {key: _weights(4, 7, 5, seed=2, alpha=4, conv=True)})
    with pytest.raises(errors.IncompatibleAdapter) as e:
        stacking.compose([a, b])
    assert e.value.status == 422
    assert "a, b" in e.value.message and "unet.down_blocks.0.conv" in e.value.message


def test_a_stacks_identity_ignores_order_and_follows_revisions_scales_and_blocks() -> None:
    one = stack_sha256([("a", "1" * 64, 0.5, ()), ("b", "2" * 64, 1.0, ())])
    assert one == stack_sha256([("b", "2" * 64, 1.0, ()), ("a", "1" * 64, 0.5, ())])
    assert one != stack_sha256([("a", "3" * 64, 0.5, ()), ("b", "2" * 64, 1.0, ())])
    assert one != stack_sha256([("a", "1" * 64, 0.6, ()), ("b", "2" * 64, 1.0, ())])
    assert one != stack_sha256([("a", "1" * 64, 0.5, (("up", 0.0),)), ("b", "2" * 64, 1.0, ())])
    assert stack_name([("b", 1.0, ()), ("a", 0.5, ())]) == "a*0.5+b*1"
    assert stack_name([("a", 0.8, (("down", 0.5), ("up", 0.0)))]) == "a*0.8[down=0.5,up=0]"


# ---- on the server


async def test_a_stack_draws_what_diffusers_draws_with_both_adapters_set(
    server: Server, assets: Assets, reference: Reference
) -> None:
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)
    ours = await server.image(lora=[{"name": "a", "scale": 0.7}, {"name": "b", "scale": 0.5}])
    theirs = reference(stack=[(assets.adapter_a, 0.7), (assets.adapter_b, 0.5)])
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= LEVEL
    assert not np.array_equal(ours, await server.image(lora={"name": "a", "scale": 0.7}))


async def test_block_weights_draw_what_diffusers_per_block_scales_draw(
    server: Server, assets: Assets, reference: Reference
) -> None:
    """`lora.blocks` (A1111's and ComfyUI's "LoRA block weights") against diffusers'
    `set_adapters` with per-block scales on a UNet and its text encoder, at 4 and 8 steps."""
    await server.load("b", assets.adapter_b)  # UNet and text encoder layers
    blocks = {"down": 0.5, "mid": 0.0, "up": 1.5, "text_encoder": 0.7}
    theirs_scale = {"unet": {"down": 0.5, "mid": 0.0, "up": 1.5}, "text_encoder": 0.7}
    for steps in (4, 8):
        ours = await server.image(lora={"name": "b", "blocks": blocks}, num_inference_steps=steps)
        theirs = reference(assets.adapter_b, theirs_scale, steps=steps)
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= LEVEL, steps
        plain = await server.image(model="b", num_inference_steps=steps)
        assert np.abs(ours.astype(int) - plain.astype(int)).max() > LEVEL, steps
    # All groups at 1 draw the adapter itself; a scale multiplies every group's value.
    ones = dict.fromkeys(("down", "mid", "up", "text_encoder"), 1.0)
    same = await server.image(lora={"name": "b", "blocks": ones})
    assert np.abs(same.astype(int) - (await server.image(model="b")).astype(int)).max() <= LEVEL
    halved = await server.image(lora={"name": "b", "scale": 0.5, "blocks": ones})
    at_half = await server.image(lora={"name": "b", "scale": 0.5})
    assert np.abs(halved.astype(int) - at_half.astype(int)).max() <= LEVEL


async def test_block_weights_in_a_stack_and_their_refusals(server: Server, assets: Assets) -> None:
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)
    up_off = [{"name": "a", "scale": 0.7, "blocks": {"up": 0}}, {"name": "b", "scale": 0.5}]
    first = await server.image(lora=up_off)
    assert np.array_equal(await server.image(lora=list(reversed(up_off))), first)
    assert not np.array_equal(
        first, await server.image(lora=[{"name": "a", "scale": 0.7}, {"name": "b", "scale": 0.5}])
    )
    for lora, words in (
        ({"name": "a", "blocks": {"middle": 1}}, "unknown block group(s) in 'lora.blocks': middle"),
        ({"name": "a", "blocks": {"up": "x"}}, "lora.blocks.up"),
        ({"name": "a", "blocks": []}, "'lora.blocks' must be an object"),
        ({"name": "a", "local_path": "/x", "blocks": {"up": 0}}, "load it first"),
    ):
        status, body = await server.post(
            "/v1/images/generations", {"prompt": "x", "lora": lora}, token=None
        )
        assert status == 400 and words in body["error"]["message"], (lora, body)


async def test_a_member_at_scale_zero_is_as_if_absent_and_order_changes_nothing(
    server: Server, assets: Assets
) -> None:
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)
    alone = await server.image(lora={"name": "a", "scale": 0.8})
    with_b_silent = await server.image(
        lora=[{"name": "a", "scale": 0.8}, {"name": "b", "scale": 0}]
    )
    assert np.abs(with_b_silent.astype(int) - alone.astype(int)).max() <= LEVEL
    forward = await server.image(lora=[{"name": "a", "scale": 0.8}, {"name": "b", "scale": 0.4}])
    backward = await server.image(lora=[{"name": "b", "scale": 0.4}, {"name": "a", "scale": 0.8}])
    assert np.array_equal(forward, backward)


async def test_a_stack_is_built_once_and_rebuilt_when_a_member_is_reloaded(
    server: Server, assets: Assets
) -> None:
    await server.load("a", assets.adapter_a, scale=0.5)  # a member without a scale: its default
    await server.load("b", assets.adapter_b)
    stack = [{"name": "a"}, {"name": "b", "scale": 0.5}]
    first = await server.image(lora=stack)
    built = server.metric("lora_adapter_loads_total", tier="cpu", result="ok")
    assert np.array_equal(await server.image(lora=stack), first)
    assert server.metric("lora_adapter_loads_total", tier="cpu", result="ok") == built
    # `a` now holds b's weights: the stack is built again from them.
    await server.load("a", assets.adapter_b, scale=0.5, load_inplace=True)
    assert not np.array_equal(await server.image(lora=stack), first)


async def test_an_unknown_member_is_a_404_naming_it(server: Server, assets: Assets) -> None:
    await server.load("a", assets.adapter_a)
    status, body = await server.post(
        "/v1/images/generations",
        {"prompt": "x", "lora": [{"name": "a"}, {"name": "nope"}]},
        token=None,
    )
    assert status == 404, body
    assert body["error"]["param"] == "lora[1].name" and "'nope'" in body["error"]["message"]


async def test_a_list_of_one_is_the_object_form(server: Server, assets: Assets) -> None:
    await server.load("a", assets.adapter_a)
    listed = await server.image(lora=[{"name": "a", "scale": 0.6}])
    assert np.array_equal(listed, await server.image(lora={"name": "a", "scale": 0.6}))


# ---- a composition on the volume (a LoRAAdapter with spec.compose), loaded by path


def _composed_revision(
    directory: Path,
    members: list[tuple[str, Path, float]],
    *,
    sha: str | None = None,
    blocks: dict[str, stacks.Blocks] | None = None,
) -> Path:
    """Lay out a composed revision as the operator stages it: manifest and members' weights
    (`blocks`: by member name, the block weights its entry carries)."""
    entries = []
    for name, adapter, scale in members:
        weights = files.find_weights_file(adapter)
        entry = stacks.StackEntry(
            name=name,
            sha256=sha or hashlib.sha256(weights.read_bytes()).hexdigest(),
            scale=scale,
            blocks=(blocks or {}).get(name, ()),
        )
        (directory / entry.file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(weights, directory / entry.file)
        entries.append(entry)
    (directory / stacks.STACK_FILE).write_bytes(stacks.manifest_bytes(entries))
    return directory


async def test_a_composed_revision_serves_what_the_same_stack_in_a_request_draws(
    server: Server, assets: Assets
) -> None:
    duo = _composed_revision(
        assets.root / "duo", [("a", assets.adapter_a, 0.7), ("b", assets.adapter_b, 0.5)]
    )
    await server.load("duo", duo, scale=1.0)
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)
    named = await server.image(model="duo")
    asked = await server.image(lora=[{"name": "b", "scale": 0.5}, {"name": "a", "scale": 0.7}])
    assert np.array_equal(named, asked)
    _, models = await server.get("/v1/models")
    card = next(c for c in models["data"] if c["id"] == "duo")
    manifest = (duo / stacks.STACK_FILE).read_bytes()
    assert card["sha256"] == hashlib.sha256(manifest).hexdigest()


async def test_a_composition_of_one_member_with_block_weights_draws_what_the_request_draws(
    server: Server, assets: Assets
) -> None:
    """`spec.compose: [{name: b, scale: 0.8, blocks: {down: 0.5, up: 0}}]` (one member is
    enough for a block-weighted variant) serves what `lora.blocks` in a request draws."""
    weights = {"down": 0.5, "up": 0.0, "text_encoder": 1.5}
    variant = _composed_revision(
        assets.root / "b-blocks",
        [("b", assets.adapter_b, 0.8)],
        blocks={"b": stacks.ordered_blocks(weights)},
    )
    manifest = stacks.parse_manifest((variant / stacks.STACK_FILE).read_bytes(), where="t")
    assert manifest[0].blocks == (("text_encoder", 1.5), ("down", 0.5), ("up", 0.0))
    await server.load("b-blocks", variant, scale=1.0)
    await server.load("b", assets.adapter_b)
    for steps in (4, 20):
        named = await server.image(model="b-blocks", num_inference_steps=steps)
        asked = await server.image(
            lora={"name": "b", "scale": 0.8, "blocks": weights}, num_inference_steps=steps
        )
        assert np.array_equal(named, asked), steps
        plain = await server.image(lora={"name": "b", "scale": 0.8}, num_inference_steps=steps)
        assert not np.array_equal(named, plain), steps  # the blocks changed the image


def test_a_manifest_without_blocks_keeps_its_bytes_and_bad_blocks_are_refused() -> None:
    """Compositions staged before block weights keep their revision (the manifest's sha256)."""
    entry = stacks.StackEntry(name="a", sha256="a" * 64, scale=0.5)
    assert b"blocks" not in stacks.manifest_bytes([entry])
    weighted = dataclasses.replace(entry, blocks=(("up", 0.0),))
    data = stacks.manifest_bytes([weighted])
    assert stacks.parse_manifest(data, where="m") == (weighted,)
    assert stacks.manifest_bytes([weighted]) != stacks.manifest_bytes([entry])
    for bad in ({"middle": 1}, {"up": 11}, {"up": True}, ["up"]):
        raw = json.loads(data)
        raw["members"][0]["blocks"] = bad
        with pytest.raises(volume_errors.InvalidAdapter, match="has blocks that are not"):
            stacks.parse_manifest(json.dumps(raw).encode(), where="m")


@pytest.mark.parametrize(
    ("write", "says"),
    [
        pytest.param(
            lambda d, a: _composed_revision(d, [("a", a, 1.0), ("b", a, 1.0)], sha="0" * 64),
            "names 00000",
            id="member-changed",
        ),
        pytest.param(
            lambda d, a: (d / stacks.STACK_FILE).write_text('{"members": []}'),
            "1 to 4 adapters",
            id="no-member",
        ),
        pytest.param(
            lambda d, a: (d / stacks.STACK_FILE).write_text("{"), "not JSON", id="not-json"
        ),
    ],
)
async def test_a_broken_composed_revision_is_refused_and_changes_nothing(
    server: Server, assets: Assets, tmp_path: Path, write: Any, says: str
) -> None:
    broken = assets.root / f"broken-{tmp_path.name}"
    broken.mkdir()
    write(broken, assets.adapter_a)
    base = await server.image()
    status, body = await server.post(
        "/v1/load_lora_adapter", {"lora_name": "duo", "lora_path": str(broken)}
    )
    assert status == 422, body
    assert says in body["error"]["message"]
    assert np.array_equal(await server.image(), base)
    _, models = await server.get("/v1/models")
    assert [c["id"] for c in models["data"] if c["parent"] is not None] == []
