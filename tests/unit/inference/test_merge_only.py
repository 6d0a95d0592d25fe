"""Merged-only formats (LoKr with a full w2, LyCORIS full `.diff` / `.diff_b`): served merged into
the base weights for batches of that adapter alone.

Files are built on the tiny pipelines with each layer's delta computed from the format's
definition in float64 (`tests/support/formats.py`): the merged weights must differ from the
base by that delta to 1e-10 and be restored bit for bit; an image drawn through the server's
merged path must be within one 8-bit level of the delta merged by hand into a fresh pipeline,
whatever `--merge` says; the base model's image after it must be bit-identical to before; and a
stream that mixes the adapter with a plain LoRA and the base model must never batch them
together, each image matching the one drawn alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from lora_inference import errors
from lora_inference.backend import ImageJob
from lora_inference.pipeline import DiffusionBackend
from lora_inference.tools.tiny_models import build_tiny_pipeline
from lora_volume import formats

from tests.support.formats import (
    Made,
    Tensors,
    dora,
    flux_lycoris,
    full_diff,
    lokr_full,
    plain,
    sd3_kohya,
    sd_dora,
    sd_full,
    sd_lokr_full,
    sd_lokr_mixed,
    write,
)
from tests.unit.inference.conftest import Assets, BatchShape, Server

# test_formats' float64 pipelines (a fixture, requested by name) and its merged reference image
from tests.unit.inference.test_formats import (  # noqa: F401
    _merged_reference_image,
    float64_backends,
)

CASES: dict[str, tuple[str, Callable[[Any], Made], str]] = {
    "sd15-lokr-full": ("sd15", sd_lokr_full, "lokr_full"),
    "sd15-lokr-mixed": ("sd15", sd_lokr_mixed, "lokr_full"),
    "sd15-diff": ("sd15", sd_full, "full"),
    "sdxl-lokr-full": ("sdxl", sd_lokr_full, "lokr_full"),
    "sdxl-diff": ("sdxl", sd_full, "full"),
    "flux-kohya-lokr-full": (
        "flux",
        flux_lycoris(lambda w, g: lokr_full(w, g, a=4, c=2, target=0.5)),
        "lokr_full",
    ),
    "flux-kohya-diff": ("flux", flux_lycoris(lambda w, g: full_diff(w, g, target=0.5)), "full"),
    "sd15-kohya-dora": ("sd15", sd_dora, "dora_kohya"),
    "sdxl-kohya-dora": ("sdxl", sd_dora, "dora_kohya"),
    "flux-kohya-dora": ("flux", flux_lycoris(dora(plain, axis=0, wobble=0.5)), "dora_kohya"),
    "sd3-kohya-dora": ("sd3", sd3_kohya(dora(plain, axis=0)), "dora_kohya"),
    "sd3-kohya-diff": ("sd3", sd3_kohya(lambda w, g: full_diff(w, g, target=0.5)), "full"),
}


def _float64(request: pytest.FixtureRequest) -> dict[str, DiffusionBackend]:
    backends: dict[str, DiffusionBackend] = request.getfixturevalue("float64_backends")
    return backends


@pytest.mark.parametrize("case", list(CASES))
def test_the_merged_weights_differ_from_the_base_by_exactly_the_format_s_delta(
    case: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    arch, make, key = CASES[case]
    backend = _float64(request)[arch]
    made = make(backend.pipe)
    parsed = backend.parse_adapter(
        write(tmp_path / "m.safetensors", made.tensors), name=case, max_rank=64
    )
    assert parsed.format == key and formats.merged_only(key)
    assert set(parsed.full) | set(parsed.layers) == set(made.reference)
    assert parsed.full, "a merged-only file has whole-matrix layers"
    modules = {k: getattr(backend.pipe, k[0]).get_submodule(k[1]) for k in made.reference}
    before = {
        k: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
        for k, m in modules.items()
    }
    backend.place("m", parsed)
    try:
        keys = list(parsed.layers)  # a mixed file's factored layers, merged from their slot
        with (
            backend.slots.call(["m"], {"m": 1.0}, merged=keys),
            backend.slots.base.merged_full(parsed.full, 1.0),
            torch.no_grad(),
        ):
            for layer, reference in made.reference.items():
                weight, bias = before[layer]
                change = modules[layer].weight - weight - reference
                worst = float(change.abs().max())
                assert worst < 1e-10, f"{layer}: {worst:.3g} off the format's definition"
                assert float(reference.abs().max()) > 1e-3  # a delta that is there to see
                if layer in made.bias_reference:
                    assert bias is not None
                    change = modules[layer].bias - bias - made.bias_reference[layer]
                    assert float(change.abs().max()) < 1e-10, f"{layer}: its bias is off"
    finally:
        backend.clear("m")
    for layer, (weight, bias) in before.items():  # restored from the pristine copies, exactly
        assert torch.equal(modules[layer].weight, weight)
        assert bias is None or torch.equal(modules[layer].bias, bias)


@pytest.mark.parametrize(
    "case",
    [
        "sd15-lokr-full",
        "sd15-lokr-mixed",
        "sd15-diff",
        "sd15-kohya-dora",
        "flux-kohya-lokr-full",
        "flux-kohya-dora",
        "sd3-kohya-diff",
    ],
)
def test_a_merged_only_adapter_draws_its_definition_merged_whatever_merge_says(
    case: str, tmp_path: Path
) -> None:
    arch, make, _ = CASES[case]
    pipe = build_tiny_pipeline(arch)
    backend = DiffusionBackend(pipe, device="cpu", dtype=torch.float32)
    made = make(pipe)
    size = backend.default_size
    shape: BatchShape = {"width": size, "height": size, "steps": 4, "guidance_scale": 4.0}
    job = ImageJob(prompt="a lighthouse", negative_prompt=None, seeds=(3,))
    base_before = np.asarray(backend.run_batch([job], [None], {}, **shape).images[0])
    weights_before = (
        {k: v.clone() for k, v in pipe.unet.state_dict().items()}
        if arch.startswith("sd1")
        else None
    )
    backend.place(
        "m",
        backend.parse_adapter(
            write(tmp_path / "m.safetensors", made.tensors), name="m", max_rank=64
        ),
    )
    theirs = _merged_reference_image(arch, made, 0.8, job, shape)
    for merge in ("never", "always"):
        outcome = backend.run_batch([job], ["m"], {"m": 0.8}, merge=merge, **shape)
        assert outcome.path == "merged" and outcome.merged_layers == len(made.reference)
        ours = np.asarray(outcome.images[0]).astype(int)
        assert int(np.abs(ours - theirs).max()) <= 1, merge
        assert int(np.abs(ours - base_before.astype(int)).max()) > 2  # there to be seen
    with pytest.raises(RuntimeError, match="merged-only"):
        backend.run_batch([job, job], ["m", None], {"m": 0.8}, **shape)
    backend.clear("m")
    base_after = np.asarray(backend.run_batch([job], [None], {}, **shape).images[0])
    assert np.array_equal(base_before, base_after)
    if weights_before is not None:
        assert all(torch.equal(v, weights_before[k]) for k, v in pipe.unet.state_dict().items())


def _merged_only_file(
    assets: Assets, directory: str, make: Callable[[Any], Made] = sd_full
) -> Path:
    pipe = DiffusionPipeline.from_pretrained(str(assets.model))
    return write(assets.root / directory / "m.safetensors", make(pipe).tensors)


@pytest.mark.parametrize(("make", "key"), [(sd_full, "full"), (sd_dora, "dora_kohya")])
async def test_a_stream_never_batches_a_merged_only_adapter_with_anything_else(
    make: Callable[[Any], Made],
    key: str,
    server: Server,
    assets: Assets,
    backend: DiffusionBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _merged_only_file(assets, f"stream-{key}", make)
    await server.load("m", path)
    await server.load("a", assets.adapter_a)
    base_before = await server.image()
    stream: list[dict[str, Any]] = [
        {"lora": {"name": name}} if name else {} for name in ("m", "a", None, "m", "a", None, "m")
    ]
    for seed, request in enumerate(stream):
        request["seed"] = 20 + seed
    solo = [await server.image(**request) for request in stream]

    batches: list[list[str | None]] = []
    run_batch = backend.run_batch

    def recording(jobs: Any, slots: Any, *args: Any, **kwargs: Any) -> Any:
        batches.append(list(slots))
        return run_batch(jobs, slots, *args, **kwargs)

    monkeypatch.setattr(backend, "run_batch", recording)
    together = await asyncio.gather(*(server.image(**request) for request in stream))
    monkeypatch.undo()

    engine = server.engine
    merged_slot = engine.residency.slot_of(engine.registry.get("m").key)
    for batch in batches:
        assert merged_slot not in batch or set(batch) == {merged_slot}, batches
    assert any(len(set(batch)) > 1 for batch in batches), batches  # the others did mix
    for request, alone, mixed in zip(stream, solo, together, strict=True):
        assert int(np.abs(alone.astype(int) - mixed.astype(int)).max()) <= 1, request
    assert np.array_equal(await server.image(), base_before)  # the base weights restored exactly

    status, listed = await server.get("/v1/adapters")
    assert status == 200
    cards = {card["id"]: card for card in listed["data"]}
    assert (cards["m"]["format"], cards["m"]["merged_only"]) == (key, True)
    assert cards["m"]["targets"] == ["text_encoder", "unet"]  # its whole-matrix layers count
    assert (cards["a"]["format"], cards["a"]["merged_only"]) == ("lora", False)


@pytest.mark.parametrize(
    "lora",
    [
        pytest.param([{"name": "m"}, {"name": "a", "scale": 0.5}], id="stack"),
        pytest.param({"name": "m", "blocks": {"up": 0.5}}, id="block-weights"),
    ],
)
async def test_a_merged_only_adapter_cannot_be_stacked_and_says_why(
    server: Server, assets: Assets, lora: Any
) -> None:
    path = _merged_only_file(assets, "stack-full")
    await server.load("m", path)
    await server.load("a", assets.adapter_a)
    status, body = await server.post(
        "/v1/images/generations", {"prompt": "x", "lora": lora}, token=None
    )
    assert status == 422, body
    message = body["error"]["message"]
    assert "m is served merged only (format full" in message and "use it alone" in message


def _malformed(pipe: Any) -> dict[str, Tensors]:
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"
    q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"  # no bias
    weight = pipe.unet.get_submodule("down_blocks.0.resnets.0.conv1").weight.detach()
    return {
        "norm-layer-diff": {f"{conv}.diff": torch.ones(weight.shape[0])},
        "bias-diff-alone": {f"{conv}.diff_b": torch.ones(weight.shape[0])},
        "diff-of-another-shape": {f"{conv}.diff": torch.ones(weight.shape[0], 5)},
        "bias-diff-of-another-length": {
            f"{conv}.diff": torch.zeros(weight.shape),
            f"{conv}.diff_b": torch.ones(3),
        },
        "bias-diff-on-a-layer-without-bias": {
            f"{q}.diff": torch.zeros(32, 32),
            f"{q}.diff_b": torch.ones(32),
        },
        "lokr-without-w1": {f"{conv}.lokr_w2": torch.ones(4, 4, 3, 3)},
        "lokr-of-another-shape": {
            f"{conv}.lokr_w1": torch.ones(2, 2),
            f"{conv}.lokr_w2": torch.ones(4, 4),
        },
        "unknown-layer": {"lora_unet_no_such_block.diff": torch.ones(4, 4)},
        "dora-scale-alone": {f"{q}.dora_scale": torch.ones(1, 32)},
        "dora-scale-of-another-shape": {
            f"{q}.lora_down.weight": torch.ones(2, 32),
            f"{q}.lora_up.weight": torch.ones(32, 2),
            f"{q}.dora_scale": torch.ones(3),
        },
        "dora-scale-of-other-input-channels": {
            f"{q}.lora_down.weight": torch.ones(2, 32),
            f"{q}.lora_up.weight": torch.ones(32, 2),
            f"{q}.dora_scale": torch.ones(1, 5),
        },
    }


MALFORMED = list(_malformed(build_tiny_pipeline("sd15")))


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_merged_only_file_is_a_422_naming_its_format(
    case: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    backend = _float64(request)["sd15"]
    path = write(tmp_path / "bad.safetensors", _malformed(backend.pipe)[case])
    with pytest.raises(errors.IncompatibleAdapter) as raised:
        backend.parse_adapter(path, name=case, max_rank=64)
    assert raised.value.status == 422
    labels = ("(full weight differences", "(LyCORIS LoKr with a full w2", "(kohya / LyCORIS DoRA")
    assert any(label in raised.value.message for label in labels), raised.value.message


def test_dora_per_input_channel_on_a_layer_the_family_splits_is_a_422(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Flux's fused qkv becomes three layers: a norm per input channel spans all three, which
    no one layer's merge can compute."""
    backend = _float64(request)["flux"]
    made = flux_lycoris(dora(plain, axis=1))(backend.pipe)
    with pytest.raises(errors.IncompatibleAdapter) as raised:
        backend.parse_adapter(
            write(tmp_path / "d.safetensors", made.tensors), name="d", max_rank=64
        )
    assert raised.value.status == 422
    assert "normalises per input channel across the 3 layers" in raised.value.message
