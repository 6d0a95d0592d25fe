"""GPU memory for a base model's weights and its LoRA slots, computed from the architectures
(docs/chart.md, "Sizing GPU memory"); nothing is downloaded or measured.

Each model is built on torch's meta device from its published configuration (no weights), its
parameters are counted, and the slot layout is planned by the server's own code
(lora_inference.slots.Slots, which plans lora_inference.slot_layout.SlotLayout over the Linear
and plain Conv2d layers of the components diffusers lets a LoRA load into): one slot of
rank r takes r x sum(fan_in + fan_out) elements. Run: `.venv/bin/python hack/sizing.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
from lora_inference.slots import Slots
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
)

BYTES = 2  # bf16 / fp16
GIB = 1024**3
SLOTS = (4, 8, 16)

CLIP_L: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
CLIP_G: dict[str, Any] = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "projection_dim": 1280,
    "hidden_act": "gelu",
}
T5_XXL: dict[str, Any] = {
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
}
SDXL_UNET: dict[str, Any] = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [320, 640, 1280],
    "layers_per_block": 2,
    "cross_attention_dim": 2048,
    "transformer_layers_per_block": [1, 2, 10],
    "attention_head_dim": [5, 10, 20],
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}
SD35_LARGE: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 38,
    "attention_head_dim": 64,
    "num_attention_heads": 38,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 2432,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 192,
    "qk_norm": "rms_norm",
}
FLUX_DEV: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}


@dataclass(frozen=True)
class Model:
    """A base model: its components by diffusers' names, which of them take LoRA slots, and a
    VAE's parameter count (small; not built)."""

    name: str
    build: Callable[[], Mapping[str, Any]]
    adapted: tuple[str, ...]
    vae_params: int = 84_000_000  # SDXL's and SD 3.5's / FLUX's 16-channel VAE: 83.7M and 83.8M


def _clip(config: Mapping[str, Any], projection: bool) -> torch.nn.Module:
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(CLIPTextConfig(**config))


MODELS = (
    Model(
        "SDXL base 1.0",
        lambda: {
            "unet": UNet2DConditionModel(**SDXL_UNET),
            "text_encoder": _clip(CLIP_L, False),
            "text_encoder_2": _clip(CLIP_G, True),
        },
        ("unet", "text_encoder", "text_encoder_2"),
    ),
    Model(
        "SD 3.5 Large",
        lambda: {
            "transformer": SD3Transformer2DModel(**SD35_LARGE),
            "text_encoder": _clip(CLIP_L, True),
            "text_encoder_2": _clip(CLIP_G, True),
            "text_encoder_3": T5EncoderModel(T5Config(**T5_XXL)),
        },
        ("transformer", "text_encoder", "text_encoder_2"),
    ),
    Model(
        "FLUX.1-dev",
        lambda: {
            "transformer": FluxTransformer2DModel(**FLUX_DEV),
            "text_encoder": _clip(CLIP_L, False),
            "text_encoder_2": T5EncoderModel(T5Config(**T5_XXL)),
        },
        ("transformer", "text_encoder"),
    ),
)


def plane_elements(components: Mapping[str, torch.nn.Module]) -> int:
    """sum(fan_in + fan_out) over the layers a slot has room for: the server's own Slots,
    built over the meta-device components (nothing is allocated)."""
    return Slots(components, count=1, max_rank=1).layout.plane_elements


def main() -> None:
    """The table of docs/chart.md: the slot buffer holds maxLoras + 1 rows (row 0 stays zeros,
    the slot of base-model images in a mixed batch), each of rank x plane_elements."""
    print(
        "| model | parameters | weights (GiB) | one slot, rank 64 (GiB) |"
        + "".join(f" {n} slots, rank 64 (GiB) |" for n in SLOTS)
        + " weights + 8 slots, rank 64 (GiB) |"
    )
    print("|---|---|---|---|" + "---|" * len(SLOTS) + "---|")
    for model in MODELS:
        with torch.device("meta"):
            components = model.build()
        counts = {c: sum(p.numel() for p in m.parameters()) for c, m in components.items()}
        params = model.vae_params + sum(counts.values())
        row = 64 * plane_elements({c: components[c] for c in model.adapted}) * BYTES / GIB
        weights = params * BYTES / GIB
        parts = " + ".join(f"{c} {n / 1e9:.2f}B" for c, n in counts.items())
        print(
            f"| {model.name} | {params / 1e9:.2f}B ({parts} + VAE) | {weights:.1f} | {row:.2f} |"
            + "".join(f" {(n + 1) * row:.1f} |" for n in SLOTS)
            + f" {weights + 9 * row:.1f} |"
        )


if __name__ == "__main__":
    main()
