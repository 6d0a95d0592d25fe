"""Random LoRA adapters for a given pipeline, for tests, demos and benchmarks.

Two on-disk formats, the ones the server accepts:
- `peft`: a directory with `adapter_config.json` and `pytorch_lora_weights.safetensors` whose keys
  are diffusers/peft style (`unet.<module>.lora_A.weight`), as diffusers' training scripts write;
- `kohya`: one `.safetensors` file with `lora_unet_*` / `lora_te_*` keys and `.alpha` tensors, as
  most civitai and A1111 files are (SD 1.5 / SDXL only: diffusers converts those families).

This module writes files; it never loads them into a pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FORMATS = ("peft", "kohya")

# Attention projections are what LoRA trainers target by default.
_DENOISER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
_TEXT_ENCODER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
_KOHYA_PREFIXES = {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}


def _linear_targets(module: torch.nn.Module, suffixes: tuple[str, ...]) -> list[tuple[str, Any]]:
    """Linear layers whose names end with one of `suffixes`, seen through any LoRA wrappers."""
    found = []
    for name, sub in module.named_modules():
        if ".lora_" in name or not isinstance(sub, torch.nn.Linear):
            continue
        name = name.removesuffix(".base_layer")  # a layer that already carries adapters
        if any(name.endswith(s) for s in suffixes):
            found.append((name, sub))
    return found


def _denoiser_name(pipe: Any) -> str:
    return "unet" if getattr(pipe, "unet", None) is not None else "transformer"


def build_random_lora(
    pipe: Any,
    *,
    rank: int = 4,
    seed: int = 0,
    text_encoder: bool = False,
    strength: float = 0.2,
) -> dict[str, torch.Tensor]:
    """A random LoRA state dict in diffusers/peft key format for `pipe` (pure: touches no files).

    `lora_B` is random rather than zero (as a freshly initialised trainer would leave it) so the
    adapter visibly changes the output.
    """
    generator = torch.Generator().manual_seed(seed)
    components = [(_denoiser_name(pipe), _DENOISER_TARGETS)]
    if text_encoder:
        components += [
            (name, _TEXT_ENCODER_TARGETS)
            for name in ("text_encoder", "text_encoder_2")
            if isinstance(getattr(pipe, name, None), torch.nn.Module)
            # T5 encoders (SD3 text_encoder_3, Flux text_encoder_2) are never LoRA targets.
            and "T5" not in type(getattr(pipe, name)).__name__
        ]
    state: dict[str, torch.Tensor] = {}
    for component, suffixes in components:
        for name, linear in _linear_targets(getattr(pipe, component), suffixes):
            down = torch.randn(rank, linear.in_features, generator=generator) * strength
            up = torch.randn(linear.out_features, rank, generator=generator) * strength
            state[f"{component}.{name}.lora_A.weight"] = down.contiguous()
            state[f"{component}.{name}.lora_B.weight"] = up.contiguous()
    return state


def to_kohya(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rename a diffusers-format LoRA into kohya/A1111 keys, with alpha == rank (scale 1)."""
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        component, rest = key.split(".", 1)
        module, kind = rest.rsplit(".lora_", 1)
        if component not in _KOHYA_PREFIXES:
            raise ValueError(f"kohya format has no name for component {component!r}")
        stem = f"{_KOHYA_PREFIXES[component]}_{module.replace('.', '_')}"
        converted[f"{stem}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = tensor
        converted[f"{stem}.alpha"] = torch.tensor(float(rank))
    return converted


def write_random_adapter(
    out: Path,
    pipe: Any,
    *,
    base_model: str,
    rank: int = 4,
    seed: int = 0,
    fmt: str = "peft",
    text_encoder: bool = False,
    strength: float = 0.2,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random adapter for `pipe` to `out` (a directory for peft, a file for kohya)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    state = {
        k: v.to(dtype)
        for k, v in build_random_lora(
            pipe, rank=rank, seed=seed, text_encoder=text_encoder, strength=strength
        ).items()
    }
    if fmt == "kohya":
        if _denoiser_name(pipe) != "unet":
            raise ValueError("kohya format is only written for UNet pipelines (sd15, sdxl)")
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(to_kohya(state, rank), str(out), metadata={"ss_network_dim": str(rank)})
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "pytorch_lora_weights.safetensors"))
    targets = sorted(
        {
            t
            for k in state
            for t in (*_DENOISER_TARGETS, *_TEXT_ENCODER_TARGETS)
            if k.split(".lora_")[0].endswith(t)
        }
    )
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": targets,
        "base_model_name_or_path": base_model,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
