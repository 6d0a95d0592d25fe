"""Every served adapter format gives, on every layer, exactly the delta its format defines.

Files are built here for each format on the tiny pipelines, named as their trainers name them
(kohya names for LyCORIS on SD 1.5 and SDXL, kohya Flux names, XLabs names), with a reference
delta per layer computed from the format's own definition in float64: LoCon's three convolutions,
LoHa's Hadamard product, LoKr's Kronecker product. The server's slots must hold that delta to
1e-10 (float64 pipelines), and an image drawn through them, in a batch mixed with a plain LoRA
and the base model, must be within one 8-bit level of the reference delta merged into a fresh
pipeline's weights. Refused formats and converter errors are 4xx errors that name the format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lora_inference import errors
from lora_inference.backend import ImageJob
from lora_inference.pipeline import DiffusionBackend
from lora_inference.tools.random_adapters import build_random_lora, to_kohya
from lora_inference.tools.tiny_models import build_tiny_pipeline
from lora_volume import errors as volume_errors

from tests.support.formats import (
    Made,
    Tensors,
    flux_lycoris,
    flux_xlabs,
    loha,
    lokr,
    peft_with_biases,
    plain,
    randn,
    sd3_kohya,
    sd_locon,
    sd_loha,
    sd_lokr,
    write,
)
from tests.unit.inference.conftest import BatchShape

FORMATS: dict[str, tuple[str, Callable[[Any], Made], str]] = {
    "sd15-locon": ("sd15", sd_locon, "locon"),
    "sd15-loha": ("sd15", sd_loha, "loha"),
    "sd15-lokr": ("sd15", sd_lokr, "lokr"),
    "sdxl-loha": ("sdxl", sd_loha, "loha"),
    "sdxl-lokr": ("sdxl", sd_lokr, "lokr"),
    "flux-kohya-loha": ("flux", flux_lycoris(loha), "loha"),
    "flux-kohya-lokr": ("flux", flux_lycoris(lambda w, g: lokr(w, g, a=4, c=2)), "lokr"),
    "flux-xlabs": ("flux", flux_xlabs, "xlabs"),
    "sd3-kohya": ("sd3", sd3_kohya(plain), "lora"),
    "sd3-kohya-loha": ("sd3", sd3_kohya(loha), "loha"),
    "sd15-peft-biases": ("sd15", peft_with_biases, "lora_bias"),
    "flux-peft-biases": ("flux", peft_with_biases, "lora_bias"),
}


@pytest.fixture(scope="module")
def float64_backends() -> dict[str, DiffusionBackend]:
    built: dict[str, DiffusionBackend] = {}
    for arch in ("sd15", "sdxl", "sd3", "flux"):
        pipe = build_tiny_pipeline(arch).to(torch.float64)
        built[arch] = DiffusionBackend(pipe, device="cpu", dtype=torch.float64)
    return built


@pytest.mark.parametrize("case", list(FORMATS))
def test_each_format_holds_exactly_the_delta_it_defines(
    case: str, float64_backends: dict[str, DiffusionBackend], tmp_path: Path
) -> None:
    arch, make, key = FORMATS[case]
    backend = float64_backends[arch]
    made = make(backend.pipe)
    parsed = backend.parse_adapter(
        write(tmp_path / "a.safetensors", made.tensors, made.metadata), name=case, max_rank=64
    )
    assert parsed.format == key
    backend.place("x", parsed)
    try:
        assert set(parsed.layers) == set(made.reference)
        for layer, reference in made.reference.items():
            served = backend.slots.delta("x", layer, 1.0)
            worst = float((served - reference).abs().max())
            assert worst < 1e-10, f"{layer}: {worst:.3g} off the format's definition"
            assert float(reference.abs().max()) > 1e-3  # a delta that is there to see
        for layer, reference in made.bias_reference.items():
            worst = float((backend.slots.bias_delta("x", layer, 1.0) - reference).abs().max())
            assert worst < 1e-10, f"{layer}: its bias is {worst:.3g} off"
    finally:
        backend.clear("x")


def _merged_reference_image(
    arch: str, made: Made, scale: float, job: ImageJob, shape: BatchShape
) -> np.ndarray:
    """The format's definition merged into a fresh pipeline's weights, in float64, then drawn."""
    pipe = build_tiny_pipeline(arch)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        for (component, path), delta in made.reference.items():
            weight = getattr(pipe, component).get_submodule(path).weight
            weight.copy_((weight.double() + scale * delta).to(weight.dtype))
        for (component, path), bias in made.bias_reference.items():
            module = getattr(pipe, component).get_submodule(path)
            base = module.bias.double() if module.bias is not None else 0.0
            module.bias = torch.nn.Parameter((base + scale * bias).to(module.weight.dtype))
    with torch.inference_mode():
        image = pipe(
            prompt=[job.prompt],
            generator=[torch.Generator().manual_seed(job.seeds[0])],
            num_inference_steps=shape["steps"],
            guidance_scale=shape["guidance_scale"],
            height=shape["height"],
            width=shape["width"],
        ).images[0]
    return np.asarray(image).astype(int)


@pytest.mark.parametrize(
    "case",
    [
        "sd15-locon",
        "sd15-loha",
        "sdxl-lokr",
        "flux-kohya-lokr",
        "sd3-kohya",
        "sd15-peft-biases",
        "flux-peft-biases",
    ],
)
def test_a_mixed_batch_draws_each_format_as_its_merged_definition(
    case: str, tmp_path: Path
) -> None:
    arch, make, _ = FORMATS[case]
    pipe = build_tiny_pipeline(arch)
    backend = DiffusionBackend(pipe, device="cpu", dtype=torch.float32)
    made = make(pipe)
    backend.place(
        "x",
        backend.parse_adapter(
            write(tmp_path / "x.safetensors", made.tensors, made.metadata), name="x", max_rank=64
        ),
    )
    plain_lora = (
        to_kohya(build_random_lora(pipe, seed=5), rank=4)
        if arch in ("sd15", "sdxl")
        else (build_random_lora(pipe, seed=5))
    )
    backend.place(
        "p",
        backend.parse_adapter(write(tmp_path / "p.safetensors", plain_lora), name="p", max_rank=64),
    )
    size = backend.default_size
    shape: BatchShape = {"width": size, "height": size, "steps": 4, "guidance_scale": 4.0}
    jobs = {
        s: ImageJob(prompt=f"a lighthouse {s}", negative_prompt=None, seeds=(3,))
        for s in ("x", "p", None)
    }
    order = ["p", "x", None]
    outcome = backend.run_batch([jobs[s] for s in order], order, {"x": 0.8, "p": 0.7}, **shape)
    assert outcome.path == "mixed"
    ours = np.asarray(outcome.images[1]).astype(int)
    theirs = _merged_reference_image(arch, made, 0.8, jobs["x"], shape)
    assert int(np.abs(ours - theirs).max()) <= 1
    base = np.asarray(outcome.images[2]).astype(int)
    assert np.abs(ours - base).mean() > 0.5  # the adapter is there to be seen
    # Alone, merged where it can be (layers with a bias keep their branch): the same image.
    alone = backend.run_batch([jobs["x"]], ["x"], {"x": 0.8}, merge="always", **shape)
    assert alone.path == "merged"
    assert int(np.abs(np.asarray(alone.images[0]).astype(int) - theirs).max()) <= 1


REFUSED = {
    "oft": ("lora_unet_x.oft_blocks", "OFT"),
    "glora": ("lora_unet_x.a1.weight", "GLoRA"),
    "ia3": ("lora_unet_x.on_input", "(IA)3"),
    "kohya-bias": ("lora_unet_x.lora_up.bias", "kohya-named LoRA with biases"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_format_is_a_422_that_names_it(
    case: str, float64_backends: dict[str, DiffusionBackend], tmp_path: Path
) -> None:
    tensor, label = REFUSED[case]
    made = sd_loha(float64_backends["sd15"].pipe)
    made.tensors[tensor] = torch.ones(4)
    path = write(tmp_path / "r.safetensors", made.tensors)
    with pytest.raises(volume_errors.InvalidAdapter) as raised:
        float64_backends["sd15"].parse_adapter(path, name=case, max_rank=64)
    served = errors.from_volume(raised.value)
    assert served.status == 422 and label in served.message


def _sd3_kohya_embedder(pipe: Any) -> Tensors:
    return {
        "lora_unet_x_embedder_proj.lora_down.weight": torch.ones(2, 16),
        "lora_unet_x_embedder_proj.lora_up.weight": torch.ones(32, 2),
        "lora_unet_x_embedder_proj.alpha": torch.tensor(2.0),
    }


def _flux_unknown_block(pipe: Any) -> Tensors:
    return {
        "lora_unet_double_blocks_0_img_nonsense.lora_down.weight": torch.ones(2, 32),
        "lora_unet_double_blocks_0_img_nonsense.lora_up.weight": torch.ones(32, 2),
    }


def _flux_kohya_with_t5_layers(pipe: Any) -> Tensors:
    """kohya Flux names with a T5 layer beside (lora_te3_): diffusers drops it with a log line."""
    tensors = flux_lycoris(loha)(pipe).tensors
    stem = "lora_te3_encoder_block_0_layer_0_SelfAttention_q"
    return {
        **tensors,
        f"{stem}.lora_down.weight": torch.ones(2, 32),
        f"{stem}.lora_up.weight": torch.ones(32, 2),
    }


def _sdxl_bad_sgm_block(pipe: Any) -> Tensors:
    return {
        "lora_unet_input_blocks_99_1_proj_in.lora_down.weight": torch.ones(2, 32),
        "lora_unet_input_blocks_99_1_proj_in.lora_up.weight": torch.ones(32, 2),
    }


def _loha_missing_factor(pipe: Any) -> Tensors:
    return {"lora_unet_x.hada_w1_a": torch.ones(4, 2), "lora_unet_x.hada_w1_b": torch.ones(2, 4)}


def _sd15_on_flux(pipe: Any) -> Tensors:
    return to_kohya(build_random_lora(build_tiny_pipeline("sd15"), seed=1), rank=4)


CONVERTER_ERRORS: dict[str, tuple[str, Callable[[Any], Tensors], str]] = {
    "sd3-kohya-embedder": ("sd3", _sd3_kohya_embedder, "names no layer of SD 3"),
    "flux-unknown-kohya-block": ("flux", _flux_unknown_block, "cannot read it"),
    "sdxl-unknown-sgm-block": ("sdxl", _sdxl_bad_sgm_block, ""),
    "flux-kohya-t5-layers": ("flux", _flux_kohya_with_t5_layers, "would silently drop 2"),
    "loha-missing-factor": ("sd15", _loha_missing_factor, "LoHa): module 'lora_unet_x' lacks"),
    "sd15-file-on-flux": ("flux", _sd15_on_flux, ""),
}


def test_a_loha_above_the_rank_limit_is_refused_saying_why_its_rank_is_higher(
    float64_backends: dict[str, DiffusionBackend], tmp_path: Path
) -> None:
    backend = float64_backends["sd15"]
    path = write(tmp_path / "l.safetensors", sd_loha(backend.pipe).tensors)
    with pytest.raises(errors.IncompatibleAdapter) as raised:
        backend.parse_adapter(path, name="l", max_rank=8)  # dim 3: exact rank 9
    assert raised.value.status == 422
    assert "rank 9" in raised.value.message and "r1 x r2 for LoHa" in raised.value.message


@pytest.mark.parametrize("case", list(CONVERTER_ERRORS))
def test_files_the_converters_cannot_read_are_4xx_never_500(case: str, tmp_path: Path) -> None:
    arch, make, words = CONVERTER_ERRORS[case]
    pipe = build_tiny_pipeline(arch)
    backend = DiffusionBackend(pipe, device="cpu", dtype=torch.float32)
    path = write(tmp_path / "c.safetensors", make(pipe))
    with pytest.raises(errors.DOMAIN_ERRORS) as raised:
        backend.parse_adapter(path, name=case, max_rank=64)
    error = raised.value
    served = errors.from_volume(error) if isinstance(error, volume_errors.VolumeError) else error
    assert isinstance(served, errors.InferenceError)
    assert 400 <= served.status < 500, served.message
    assert words in served.message


# -- DoRA (peft's form) --------------------------------------------------------------------------


def peft_dora(pipe: Any) -> tuple[Tensors, dict[str, str]]:
    """A DoRA file as peft and diffusers save it: pairs, and a magnitude per output row (for a
    conv, peft's (1, out, 1, 1)), near the rows' norms so the rescale is that of a trained one."""
    denoiser = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    model = getattr(pipe, denoiser)
    tensors = build_random_lora(pipe, seed=9, strength=0.3)
    if denoiser == "unet":
        conv = model.get_submodule("down_blocks.0.resnets.0.conv1")
        g = torch.Generator().manual_seed(10)
        tensors["unet.down_blocks.0.resnets.0.conv1.lora_A.weight"] = (
            randn(g, 4, conv.in_channels, 3, 3) * 0.2
        )
        tensors["unet.down_blocks.0.resnets.0.conv1.lora_B.weight"] = (
            randn(g, conv.out_channels, 4, 1, 1) * 0.2
        )
    g = torch.Generator().manual_seed(11)
    for key in [k for k in tensors if k.endswith("lora_A.weight")]:
        module = key.removesuffix(".lora_A.weight")
        weight = model.get_submodule(module.split(".", 1)[1]).weight.detach().double()
        up = tensors[f"{module}.lora_B.weight"].double()
        delta = up.reshape(up.shape[0], -1) @ tensors[key].double().reshape(up.shape[1], -1)
        norms = (weight.reshape(weight.shape[0], -1) + 0.5 * delta).norm(dim=1)
        magnitude = (norms * (1 + 0.5 * (2 * torch.rand(norms.shape, generator=g) - 1))).float()
        shape = (1, -1, 1, 1) if weight.dim() == 4 else (-1,)
        tensors[f"{module}.lora_magnitude_vector"] = magnitude.reshape(shape)
    config: dict[str, Any] = {"r": 4, "lora_alpha": 2, "use_dora": True}
    config["target_modules"] = sorted({k.split(".lora_")[0].split(".", 1)[1] for k in tensors})
    metadata = {
        "lora_adapter_metadata": json.dumps({f"{denoiser}.{k}": v for k, v in config.items()})
    }
    return tensors, metadata


def _dora_by_definition(
    module: Any, x: torch.Tensor, tensors: Tensors, stem: str, scale: float
) -> torch.Tensor:
    """peft's DoRA: W' = m / |W + s c B A|_row (W + s c B A), then the layer with W'."""
    weight = module.weight.double()
    up = tensors[f"{stem}.lora_B.weight"].double()
    down = tensors[f"{stem}.lora_A.weight"].double()
    adapted = weight.reshape(weight.shape[0], -1) + scale * 0.5 * (
        up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)
    )
    magnitude = tensors[f"{stem}.lora_magnitude_vector"].double().reshape(-1, 1)
    rescaled = (magnitude / adapted.norm(dim=1, keepdim=True) * adapted).reshape(weight.shape)
    bias = None if module.bias is None else module.bias.double()
    if isinstance(module, torch.nn.Conv2d):
        return torch.nn.functional.conv2d(
            x, rescaled, bias, module.stride, module.padding, module.dilation
        )
    return torch.nn.functional.linear(x, rescaled, bias)


@pytest.mark.parametrize("arch", ["sd15", "flux"])
def test_dora_layers_give_exactly_peft_s_definition_alone_and_beside_the_base_model(
    arch: str, float64_backends: dict[str, DiffusionBackend], tmp_path: Path
) -> None:
    backend = float64_backends[arch]
    tensors, metadata = peft_dora(backend.pipe)
    parsed = backend.parse_adapter(
        write(tmp_path / "d.safetensors", tensors, metadata), name="d", max_rank=64
    )
    assert parsed.format == "dora"
    denoiser = "unet" if arch == "sd15" else "transformer"
    backend.place("d", parsed)
    g = torch.Generator().manual_seed(0)
    try:
        for component, path in parsed.layers:
            module = getattr(backend.pipe, component).get_submodule(path)
            conv = isinstance(module, torch.nn.Conv2d)
            x = (
                randn(g, 2, module.in_channels, 6, 6)
                if conv
                else randn(g, 2, 3, module.in_features)
            )
            x = x.double()
            stem = f"{denoiser}.{path}"
            with torch.no_grad():
                base = module(x)
                for per_image, scale in ((["d", "d"], 0.7), (["d", None], -0.4)):
                    with backend.slots.call(per_image, {"d": scale}):
                        served = module(x)
                    wanted = _dora_by_definition(module, x, tensors, stem, scale)
                    worst = float((served[0] - wanted[0]).abs().max())
                    assert worst < 1e-10, f"{path} at {scale}: {worst:.3g} off"
                    if per_image[1] is None:  # the base model's image: untouched, bit for bit
                        assert torch.equal(served[1], base[1])
                    assert float((wanted[0] - base[0]).abs().max()) > 1e-3
    finally:
        backend.clear("d")


@pytest.mark.parametrize("arch", ["sd15", "flux"])
def test_a_dora_adapter_in_a_mixed_batch_draws_what_diffusers_draws(
    arch: str, tmp_path: Path
) -> None:
    pipe = build_tiny_pipeline(arch)
    tensors, metadata = peft_dora(pipe)
    directory = tmp_path / "dora"
    write(directory / "pytorch_lora_weights.safetensors", tensors, metadata)
    backend = DiffusionBackend(pipe, device="cpu", dtype=torch.float32)
    backend.place("d", backend.parse_adapter(directory, name="d", max_rank=64))
    plain_lora = build_random_lora(pipe, seed=5)
    backend.place(
        "p",
        backend.parse_adapter(write(tmp_path / "p.safetensors", plain_lora), name="p", max_rank=64),
    )
    size = backend.default_size
    shape: BatchShape = {"width": size, "height": size, "steps": 4, "guidance_scale": 4.0}
    job = ImageJob(prompt="a lighthouse", negative_prompt=None, seeds=(3,))
    order = ["p", "d", None]
    outcome = backend.run_batch([job] * 3, order, {"d": 0.8, "p": 0.7}, **shape)
    ours = np.asarray(outcome.images[1]).astype(int)

    oracle = build_tiny_pipeline(arch)
    oracle.set_progress_bar_config(disable=True)
    oracle.load_lora_weights(str(directory), adapter_name="oracle")
    oracle.set_adapters(["oracle"], [0.8])
    with torch.inference_mode():
        theirs = oracle(
            prompt=[job.prompt],
            generator=[torch.Generator().manual_seed(3)],
            num_inference_steps=4,
            guidance_scale=4.0,
            height=size,
            width=size,
        ).images[0]
    assert int(np.abs(ours - np.asarray(theirs).astype(int)).max()) <= 1
    assert np.abs(ours - np.asarray(outcome.images[2]).astype(int)).mean() > 0.5
