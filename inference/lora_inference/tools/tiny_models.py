"""Tiny random diffusion pipelines built fully offline, for tests, demos and benchmarks.

Each builder returns a diffusers pipeline with the real architecture of its family (SD 1.5,
SDXL, SD 3.5, Flux) shrunk to a few thousand parameters, with tokenizer files generated here
instead of downloaded. `write_tiny_model` saves it with `save_pretrained`, so the server loads
it exactly as it would load a real model directory.

This module builds models; it never serves them.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("sd15", "sdxl", "sd3", "flux")

# CLIP's tokenizer needs a vocabulary and merges; a byte-level vocabulary with no merges
# tokenizes any prompt and keeps the files tiny.
_CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins for bytes that byte-level BPE tokenizers use (GPT-2 scheme)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def write_clip_tokenizer(directory: Path) -> int:
    """Write a CLIP tokenizer into `directory`; return its vocabulary size."""
    directory.mkdir(parents=True, exist_ok=True)
    alphabet = _byte_level_alphabet()
    tokens = [*_CLIP_SPECIALS, *alphabet, *(c + "</w>" for c in alphabet)]
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    # model_max_length keeps pipelines from padding prompts to an enormous length.
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": 77,
        "bos_token": _CLIP_SPECIALS[0],
        "eos_token": _CLIP_SPECIALS[1],
        "unk_token": _CLIP_SPECIALS[1],
        "pad_token": _CLIP_SPECIALS[1],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return len(tokens)


def clip_tokenizer(directory: Path) -> tuple[Any, int]:
    from transformers import CLIPTokenizer

    size = write_clip_tokenizer(directory)
    return CLIPTokenizer.from_pretrained(str(directory)), size


def _t5_tokenizer() -> Any:
    """A word-level T5 stand-in: `<pad>`, `</s>`, `<unk>` plus a few hundred words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(97)), *_byte_level_alphabet()[:94]]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=77,
    )


def clip_text_model(vocab_size: int, *, hidden: int = 32, projection: int | None = None) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=hidden,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        projection_dim=projection or hidden,
        hidden_act="gelu",
    )
    if projection is None:
        return CLIPTextModel(config)
    return CLIPTextModelWithProjection(config)


def _t5_encoder(vocab_size: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config)


def _vae(*, latent_channels: int = 4, flow: bool = False) -> Any:
    from diffusers import AutoencoderKL

    extra: dict[str, Any] = {}
    if flow:
        extra = {
            "use_quant_conv": False,
            "use_post_quant_conv": False,
            "shift_factor": 0.0609,
            "scaling_factor": 1.5035,
        }
    return AutoencoderKL(
        block_out_channels=(4, 8),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=latent_channels,
        norm_num_groups=2,
        sample_size=32,
        **extra,
    )


def _tiny_unet(**family: Any) -> Any:
    """A two-level UNet; `family` adds what SD 1.5 and SDXL differ in."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        **family,
    )


def sd15_scheduler() -> Any:
    """SD 1.5's DDIM settings."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _build_sd15(workdir: Path) -> Any:
    from diffusers import StableDiffusionPipeline

    tokenizer, vocab = clip_tokenizer(workdir / "tokenizer")
    unet = _tiny_unet(cross_attention_dim=32, attention_head_dim=4)
    return StableDiffusionPipeline(
        unet=unet,
        vae=_vae(),
        text_encoder=clip_text_model(vocab),
        tokenizer=tokenizer,
        scheduler=sd15_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def sdxl_scheduler() -> Any:
    """SDXL base's scheduler settings."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing="leading",
        steps_offset=1,
    )


def _build_sdxl(workdir: Path) -> Any:
    from diffusers import StableDiffusionXLPipeline

    tokenizer, vocab = clip_tokenizer(workdir / "tokenizer")
    tokenizer_2, _ = clip_tokenizer(workdir / "tokenizer_2")
    unet = _tiny_unet(
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        # 6 micro-conditioning ids of 8 dims each, plus text_encoder_2's 32-dim projection.
        projection_class_embeddings_input_dim=80,
        cross_attention_dim=64,
    )
    return StableDiffusionXLPipeline(
        unet=unet,
        vae=_vae(),
        text_encoder=clip_text_model(vocab),
        text_encoder_2=clip_text_model(vocab, projection=32),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        scheduler=sdxl_scheduler(),
    )


def _build_sd3(workdir: Path) -> Any:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    tokenizer, vocab = clip_tokenizer(workdir / "tokenizer")
    tokenizer_2, _ = clip_tokenizer(workdir / "tokenizer_2")
    tokenizer_3 = _t5_tokenizer()
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        vae=_vae(flow=True),
        text_encoder=clip_text_model(vocab, projection=32),
        text_encoder_2=clip_text_model(vocab, projection=32),
        text_encoder_3=_t5_encoder(len(tokenizer_3)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=tokenizer_3,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def _build_flux(workdir: Path) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    tokenizer, vocab = clip_tokenizer(workdir / "tokenizer")
    tokenizer_2 = _t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    return FluxPipeline(
        transformer=transformer,
        vae=_vae(latent_channels=1, flow=True),
        text_encoder=clip_text_model(vocab),
        text_encoder_2=_t5_encoder(len(tokenizer_2)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


_BUILDERS: dict[str, Callable[[Path], Any]] = {
    "sd15": _build_sd15,
    "sdxl": _build_sdxl,
    "sd3": _build_sd3,
    "flux": _build_flux,
}


def build_tiny_pipeline(arch: str, *, seed: int = 0) -> Any:
    """A tiny random pipeline of family `arch`, in eval mode (dropout would break determinism)."""
    if arch not in _BUILDERS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as scratch:
        pipe = _BUILDERS[arch](Path(scratch))
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def write_tiny_model(directory: Path, arch: str, *, seed: int = 0) -> Path:
    """Build a tiny pipeline and save it to `directory` as a diffusers model folder."""
    pipe = build_tiny_pipeline(arch, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(directory), safe_serialization=True)
    return directory
