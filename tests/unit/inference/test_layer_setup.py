"""Each layer's setup, worked out when the file is parsed, is what diffusers' own load gives it.

The server never calls `load_lora_weights`: it copies an adapter into a slot with the rank, alpha
and rsLoRA flag it derived from the file. The oracle here is the real thing: the same file loaded
by diffusers into a fresh pipeline of the same family, for every format diffusers reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lora_inference.backend import ImageJob
from lora_inference.pipeline import DiffusionBackend
from lora_inference.tools.random_adapters import build_random_lora, to_kohya
from lora_inference.tools.tiny_models import build_tiny_pipeline
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file

from tests.unit.inference.conftest import BatchShape

Tensors = dict[str, torch.Tensor]


def peft_format(pipe: Any) -> tuple[Tensors, dict[str, Any] | None]:
    return build_random_lora(pipe, seed=1, text_encoder=True), None


def kohya(pipe: Any) -> tuple[Tensors, dict[str, Any] | None]:
    return to_kohya(build_random_lora(pipe, seed=2, text_encoder=True), rank=4), None


def kohya_mixed_alphas(pipe: Any) -> tuple[Tensors, dict[str, Any] | None]:
    """Alphas that differ between layers, in the text encoder and in the UNet.

    No two alphas are equally common: diffusers breaks such ties by the order it reads the keys
    in, which safetensors does not fix, so its own loads of a tied file differ from run to run.
    """
    tensors, _ = kohya(pipe)
    odd = ("layers_0_self_attn_q", "layers_0_self_attn_k", "layers_0_self_attn_v", "down_blocks")
    return {
        k: v * 0 + 2.0 if k.endswith(".alpha") and any(o in k for o in odd) else v
        for k, v in tensors.items()
    }, None


def mixed_ranks(pipe: Any) -> tuple[Tensors, dict[str, Any] | None]:
    low = build_random_lora(pipe, seed=3, rank=4, text_encoder=True)
    high = build_random_lora(pipe, seed=3, rank=8, text_encoder=True)
    some = sorted({k.split(".lora_")[0] for k in low})[::3]
    return {k: high[k] if k.split(".lora_")[0] in some else v for k, v in low.items()}, None


def diffusers_metadata(pipe: Any) -> tuple[Tensors, dict[str, Any] | None]:
    """diffusers' own format: the LoraConfig in the header, with an alpha pattern and rsLoRA."""
    tensors = build_random_lora(pipe, seed=4, text_encoder=True)
    metadata: dict[str, Any] = {}
    for component in ("unet", "text_encoder"):
        modules = sorted(
            {
                k.split(".lora_")[0].removeprefix(f"{component}.")
                for k in tensors
                if k.startswith(f"{component}.")
            }
        )
        metadata.update(
            {
                f"{component}.r": 4,
                f"{component}.lora_alpha": 8,
                f"{component}.alpha_pattern": {modules[0]: 2},
                f"{component}.use_rslora": component == "unet",
                f"{component}.target_modules": modules,
            }
        )
    return tensors, metadata


FORMATS: dict[str, Callable[[Any], tuple[Tensors, dict[str, Any] | None]]] = {
    "peft": peft_format,
    "kohya": kohya,
    "kohya-mixed-alphas": kohya_mixed_alphas,
    "mixed-ranks": mixed_ranks,
    "diffusers-metadata": diffusers_metadata,
}
CASES = [
    *(pytest.param("sd15", f, id=f"sd15-{f}") for f in FORMATS),
    *(pytest.param("sdxl", f, id=f"sdxl-{f}") for f in ("peft", "kohya", "kohya-mixed-alphas")),
    *(
        pytest.param(arch, f, id=f"{arch}-{f}")
        for arch in ("sd3", "flux")
        for f in ("peft", "mixed-ranks")
    ),
]


def write(directory: Path, tensors: Tensors, metadata: dict[str, Any] | None) -> Path:
    directory.mkdir(parents=True)
    header = {"format": "pt"}
    if metadata is not None:
        header["lora_adapter_metadata"] = json.dumps(metadata)
    save_file(tensors, str(directory / "pytorch_lora_weights.safetensors"), metadata=header)
    return directory


def setup_after_diffusers_load(
    pipe: Any, adapter: Path
) -> dict[tuple[str, str], tuple[int, float, bool]]:
    pipe.load_lora_weights(str(adapter), adapter_name="oracle")
    return {
        (component, name): (m.r["oracle"], float(m.lora_alpha["oracle"]), m.use_rslora["oracle"])
        for component in pipe._lora_loadable_modules
        if getattr(pipe, component, None) is not None
        for name, m in getattr(pipe, component).named_modules()
        if isinstance(m, LoraLayer) and "oracle" in m.lora_A
    }


@pytest.mark.parametrize(("arch", "fmt"), CASES)
def test_the_setup_worked_out_at_parse_time_is_what_diffusers_loads(
    arch: str, fmt: str, tmp_path: Path
) -> None:
    pipe = build_tiny_pipeline(arch)
    tensors, metadata = FORMATS[fmt](pipe)
    adapter = write(tmp_path / fmt, tensors, metadata)
    backend = DiffusionBackend(pipe, device="cpu", dtype=torch.float32)
    parsed = backend.parse_adapter(adapter, name=fmt, max_rank=64)
    ours = {key: (w.rank, w.alpha, w.rslora) for key, w in parsed.layers.items()}
    assert ours == setup_after_diffusers_load(build_tiny_pipeline(arch), adapter)


@pytest.mark.parametrize("arch", ["sd15", "sdxl", "sd3", "flux"])
def test_a_copied_adapter_draws_the_image_diffusers_draws(arch: str, tmp_path: Path) -> None:
    pipe = build_tiny_pipeline(arch)
    pipe.set_progress_bar_config(disable=True)
    tensors, metadata = kohya_mixed_alphas(pipe) if arch in ("sd15", "sdxl") else peft_format(pipe)
    adapter = write(tmp_path / "adapter", tensors, metadata)
    backend = DiffusionBackend(pipe, device="cpu", dtype=torch.float32)
    backend.place("slot", backend.parse_adapter(adapter, name="a", max_rank=64))
    job = ImageJob(prompt="a lighthouse", negative_prompt=None, seeds=(5,))
    shape: BatchShape = {"width": 32, "height": 32, "steps": 2, "guidance_scale": 4.0}
    ours = backend.run_batch([job], ["slot"], {"slot": 0.8}, merge="never", **shape).images[0]

    oracle = build_tiny_pipeline(arch)
    oracle.set_progress_bar_config(disable=True)
    oracle.load_lora_weights(str(adapter), adapter_name="oracle")
    oracle.set_adapters(["oracle"], [0.8])
    with torch.inference_mode():
        theirs = oracle(
            prompt=["a lighthouse"],
            generator=[torch.Generator().manual_seed(5)],
            num_inference_steps=2,
            guidance_scale=4.0,
            height=32,
            width=32,
        ).images[0]
    # Our slots fold alpha / r into B and sum in another order than peft: float rounding,
    # never more than one 8-bit level.
    assert np.abs(np.asarray(ours).astype(int) - np.asarray(theirs).astype(int)).max() <= 1


def test_a_file_whose_alphas_tie_always_gets_the_same_setup(tmp_path: Path) -> None:
    """Half the text-encoder layers at alpha 2, half at 4: diffusers' choice depends on the
    order it reads the keys in; the server reads them sorted, so every parse agrees."""
    pipe = build_tiny_pipeline("sd15")
    tensors, _ = kohya(pipe)
    tied = {
        k: v * 0 + 2.0 if k.endswith(".alpha") and "te1_encoder_layers_0" in k else v
        for k, v in tensors.items()
    }
    adapter = write(tmp_path / "tied", tied, None)
    backend = DiffusionBackend(pipe, device="cpu", dtype=torch.float32)
    setups = [
        {
            key: w.alpha
            for key, w in backend.parse_adapter(adapter, name="t", max_rank=8).layers.items()
        }
        for _ in range(4)
    ]
    assert all(setup == setups[0] for setup in setups)
