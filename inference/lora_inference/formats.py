"""Adapter files of every served format, turned into per-layer low-rank pairs (down, up, alpha).

What `lora_volume.formats` names by tensor names, this module converts, on the CPU, touching no
pipeline state (any thread):

- LyCORIS formats become plain kohya pairs first, in float64, exactly (`lycoris`):
  LoCon's Tucker core folds into its down factor (a 1x1 conv followed by a k x k conv is one
  k x k conv); LoHa's Hadamard product of two low-rank factors is exactly a rank r1 x r2 pair
  (the row-wise Khatri-Rao product of the factors); LoKr's Kronecker product with a factored w2
  is exactly a pair of rank min(a, c) x r (kron(W1, U V) = kron(W1, U) kron(I, V), or
  kron(I, U) kron(W1, V)). Each pair carries the format's scale, alpha / dim, in its up
  factor and is served at scaling 1 (`at_scaling_one`), plain pairs of such files included.
  Kohya-named SD 3 files, which diffusers has no converter for, are folded the same way and
  renamed here (`_sd3_kohya_to_peft`), fused qkv layers split exactly.
  A pair wider than its layer is stored at the layer's full rank instead (still exact).
- Then diffusers' own converters rename the pairs per family (kohya, XLabs and ai-toolkit Flux,
  SGM block names), and diffusers' and peft's configuration code works out each layer's rank,
  alpha and rsLoRA, so the setup is what `load_lora_weights` gives (`convert`, `layer_weights`).
  Every error those converters raise becomes IncompatibleAdapter (422), with the format named:
  no file ends in a 500.

Imports torch, diffusers and peft; owns no state.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.utils.peft_utils import get_peft_kwargs
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
)
from lora_volume import formats
from peft import LoraConfig
from peft.utils.other import get_pattern_key

from lora_inference import errors, lycoris
from lora_inference.adapters import validation
from lora_inference.backend import LayerKey
from lora_inference.slot_packing import LayerWeights

DENOISERS = ("unet", "transformer")
# diffusers derives a text encoder's ranks from these modules only (_load_lora_into_text_encoder).
_TEXT_ENCODER_RANK_MODULES = (".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")
_KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_")

Tensors = dict[str, torch.Tensor]


def _bad(name: str, fmt: formats.Format, why: str) -> errors.IncompatibleAdapter:
    return errors.IncompatibleAdapter(f"adapter {name!r} ({fmt.label}): {why}", param="lora_path")


# -- LyCORIS -> LoRA pairs (exact) ----------------------------------------------------------------


def folds_scale(pipe: Any, tensors: Tensors, fmt: formats.Format) -> bool:
    """Whether the file's pairs are converted here, each module's scale folded into it
    (`to_folded_pairs`), rather than left to diffusers' alpha handling: LyCORIS files, and
    kohya-named files for SD 3, which diffusers has no converter for."""
    lycoris = (formats.LOCON, formats.LOHA, formats.LOKR, formats.LOKR_FULL, formats.FULL)
    return fmt in lycoris or _kohya_sd3(pipe, tensors)


def _kohya_sd3(pipe: Any, tensors: Mapping[str, torch.Tensor]) -> bool:
    return type(pipe).__name__ == "StableDiffusion3Pipeline" and any(
        k.startswith(_KOHYA_PREFIXES) for k in tensors
    )


to_folded_pairs = lycoris.to_folded_pairs


def explain_rank(
    error: errors.IncompatibleAdapter, fmt: formats.Format
) -> errors.IncompatibleAdapter:
    """`error`, saying why a LoHa's or LoKr's rank is higher than the file's dim when the rank
    is what was refused."""
    if "--max-lora-rank" not in error.message or fmt not in (formats.LOHA, formats.LOKR):
        return error
    return errors.IncompatibleAdapter(
        f"{error.message}. {fmt.label} is served at its exact rank, higher than its dim: "
        "r1 x r2 for LoHa, min(a, c) x r for LoKr (docs/adapters.md); raise --max-lora-rank "
        "to serve it",
        param=error.param,
    )


def at_scaling_one(layers: Mapping[LayerKey, LayerWeights]) -> dict[LayerKey, LayerWeights]:
    """`layers` of a file `to_folded_pairs` converted, at scaling 1: its pairs carry the
    format's scale already, and diffusers' alpha patterns, which can give a layer another
    layer's alpha, must not apply it again."""
    return {k: dataclasses.replace(w, alpha=float(w.rank), rslora=False) for k, w in layers.items()}


# -- diffusers' conversion, per family -------------------------------------------------------------


def convert(
    pipe: Any, tensors: Tensors, fmt: formats.Format, *, name: str
) -> tuple[dict[str, Tensors], dict[str, float]]:
    """Convert keys the way diffusers does when loading: peft names grouped by component,
    and the network alphas of kohya-style files. Every converter error is IncompatibleAdapter."""
    family = type(pipe).__name__
    if _kohya_sd3(pipe, tensors):
        tensors = _sd3_kohya_to_peft(pipe, tensors, fmt, name)
    if family == "FluxPipeline":
        dropped = _flux_kohya_dropped(tensors)
        if dropped:
            raise _bad(
                name,
                fmt,
                f"diffusers' Flux converter would silently drop {len(dropped)} of its tensors "
                f"(e.g. {dropped[0]!r}): T5, text projection and position-embedding layers are "
                "not served. Re-export the adapter without them",
            )
    try:
        return _convert(pipe, tensors, name)
    except errors.InferenceError:
        raise
    except Exception as e:  # diffusers' converters raise ValueError, KeyError, AssertionError...
        raise _bad(name, fmt, f"{family} cannot read it: {type(e).__name__}: {e}") from e


def _flux_kohya_dropped(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The tensors of a kohya-style Flux file that diffusers' converter filters out with no
    more than a log line (it keeps `lora_unet_`, `lora_te_` and `lora_te1_` layers, drops the
    rest, and keeps only `transformer.` keys of a file that mixes those in)."""
    if not any(".lora_down.weight" in k for k in tensors):
        return []
    if any(k.startswith("lora_transformer_") for k in tensors):
        return []  # the "mixture" layout, converted whole or refused by the converter itself
    if any(k.startswith("transformer.") for k in tensors):
        return [k for k in tensors if not k.startswith("transformer.")]
    dropped = []
    for key in tensors:
        renamed = key.replace("diffusion_model.", "lora_unet_").replace(
            "text_encoders.clip_l.transformer.", "lora_te_"
        )
        kept = renamed.startswith(("lora_unet_", "lora_te_", "lora_te1_"))
        if not kept or any(p in renamed for p in ("position_embedding", "text_projection")):
            dropped.append(key)
    return dropped


# sd-scripts' names for an SD 3 MMDiT block's layers -> diffusers' (a fused qkv splits in three).
_SD3_BLOCK = {
    "x_block_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "x_block_attn_proj": ("attn.to_out.0",),
    "x_block_attn2_qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
    "x_block_attn2_proj": ("attn2.to_out.0",),
    "x_block_mlp_fc1": ("ff.net.0.proj",),
    "x_block_mlp_fc2": ("ff.net.2",),
    "x_block_adaLN_modulation_1": ("norm1.linear",),
    "context_block_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "context_block_attn_proj": ("attn.to_add_out",),
    "context_block_mlp_fc1": ("ff_context.net.0.proj",),
    "context_block_mlp_fc2": ("ff_context.net.2",),
    "context_block_adaLN_modulation_1": ("norm1_context.linear",),
}
_SD3_TEXT = {"lora_te1_": "text_encoder", "lora_te2_": "text_encoder_2"}


def _sd3_kohya_to_peft(pipe: Any, tensors: Tensors, fmt: formats.Format, name: str) -> Tensors:
    """A kohya-named SD 3 file (pairs already folded) in peft's names, exactly: a fused qkv's up
    rows split in three (its down shared), and the last block's context modulation with its
    shift and scale halves swapped, as diffusers' checkpoint conversion swaps the weights."""
    last = int(pipe.transformer.config.num_layers) - 1
    text = {
        prefix: {m.replace(".", "_"): m for m, _ in getattr(pipe, c).named_modules()}
        for prefix, c in _SD3_TEXT.items()
        if getattr(pipe, c, None) is not None
    }
    out: Tensors = {}
    for key, tensor in tensors.items():
        stem, sep, half = key.partition(".lora_")
        if not sep or not stem.startswith(_KOHYA_PREFIXES):
            out[key] = tensor
            continue
        peft_half = "lora_A.weight" if half.startswith("down") else "lora_B.weight"
        block = re.fullmatch(r"lora_unet_joint_blocks_(\d+)_(\w+)", stem)
        if block is not None and block.group(2) in _SD3_BLOCK:
            index, part = int(block.group(1)), block.group(2)
            targets = _SD3_BLOCK[part]
            pieces: Sequence[torch.Tensor] = [tensor] * len(targets)
            if peft_half == "lora_B.weight":
                if part == "context_block_adaLN_modulation_1" and index == last:
                    shift, scale = tensor.chunk(2, dim=0)
                    tensor = torch.cat([scale, shift])
                pieces = tensor.chunk(len(targets), dim=0)
            for target, piece in zip(targets, pieces, strict=True):
                out[f"transformer.transformer_blocks.{index}.{target}.{peft_half}"] = piece
            continue
        prefix = next((p for p in text if stem.startswith(p)), None)
        module = text[prefix].get(stem.removeprefix(prefix)) if prefix else None
        if prefix is None or module is None:
            raise _bad(
                name,
                fmt,
                f"{stem!r} names no layer of SD 3 that kohya's sd-scripts trains (joint blocks' "
                "attention, MLP and modulation; the two CLIP text encoders)",
            )
        out[f"{_SD3_TEXT[prefix]}.{module}.{peft_half}"] = tensor
    return out


def _convert(pipe: Any, tensors: Tensors, name: str) -> tuple[dict[str, Tensors], dict[str, float]]:
    reader = type(pipe).lora_state_dict
    kwargs: dict[str, Any] = {"return_lora_metadata": True}
    if "return_alphas" in inspect.signature(reader).parameters:
        kwargs["return_alphas"] = True  # Flux returns them only when asked
    converted = reader(dict(tensors), **kwargs)
    # (state, alphas, metadata) for SD 1.5, SDXL and Flux; (state, metadata) for SD3.
    state = converted[0]
    alphas = converted[1] if len(converted) == 3 else None
    components = set(getattr(pipe, "_lora_loadable_modules", ()))
    by_component: dict[str, Tensors] = {}
    for key, tensor in state.items():
        component, _, rest = key.partition(".")
        if not rest or component not in components:
            raise errors.IncompatibleAdapter(
                f"adapter {name!r} does not fit this model: key {key!r} names no component of "
                f"{type(pipe).__name__} "
                f"({', '.join(sorted(components))}); is it for another model family?",
                param="lora_path",
            )
        by_component.setdefault(component, {})[rest] = tensor
    parts: dict[str, Tensors] = {}
    for component, part in by_component.items():
        if component in DENOISERS:
            if not any("lora_A" in k for k in part):
                part = convert_unet_state_dict_to_peft(part)
        else:
            part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
            # Recent transformers flatten CLIPTextModel; older files still say text_model.
            model = getattr(pipe, component, None)
            if model is not None and not hasattr(model, "text_model"):
                part = {k.removeprefix("text_model."): v for k, v in part.items()}
        parts[component] = part
    return parts, {k: float(v) for k, v in (alphas or {}).items()}


def _magnitude(part: Tensors, module: str) -> torch.Tensor | None:
    for key in (f"{module}.lora_magnitude_vector", f"{module}.lora_magnitude_vector.weight"):
        if key in part:
            return part[key].reshape(-1)
    return None


def is_pair_key(key: str) -> bool:
    """Whether a converted key is half of a pair (what `validation` checks), not a bias or a
    DoRA magnitude (checked with their layer when packed)."""
    return not key.endswith((".bias", ".lora_magnitude_vector", ".lora_magnitude_vector.weight"))


def fit_conv_pairs(parts: dict[str, Tensors], shapes: validation.ModelShapes) -> None:
    """Give flattened pairs on Conv2d layers (LoHa's and LoKr's) the conv shapes peft uses:
    down (r, in, kh, kw), up (out, r, 1, 1). In place; anything else is left for validation."""
    for component, part in parts.items():
        table = shapes.get(component, {})
        for key in list(part):
            module, sep, half = key.partition(".lora_")
            shape = table.get(module)
            if not sep or shape is None or shape.kernel is None or part[key].dim() != 2:
                continue
            tensor = part[key]
            if half.startswith("A") and tensor.shape[1] == shape.in_features * _area(shape):
                part[key] = tensor.reshape(tensor.shape[0], shape.in_features, *shape.kernel)
            elif half.startswith("B"):
                part[key] = tensor.reshape(*tensor.shape, 1, 1)


def _area(shape: validation.LayerShape) -> int:
    area = 1
    for side in shape.kernel or ():
        area *= side
    return area


def layer_weights(
    pipe: Any,
    component: str,
    part: Tensors,
    alphas: Mapping[str, float],
    metadata: Mapping[str, Any] | None,
    name: str,
) -> dict[LayerKey, LayerWeights]:
    """Each layer's weights with the rank, alpha and rsLoRA a diffusers load would give it.

    The LoraConfig comes from diffusers' own `get_peft_kwargs` (or the file's metadata), fed
    as diffusers' loaders feed it, and each layer's alpha from peft's own pattern matching,
    so quirks included the result is what `load_lora_weights` sets up (a test compares them
    for every family and format).
    """
    own = None
    if metadata is not None:
        prefix = f"{component}."
        own = {k.removeprefix(prefix): v for k, v in metadata.items() if k.startswith(prefix)}
    if component in DENOISERS:
        ranks = {f"^{k}": v.shape[1] for k, v in part.items() if "lora_B" in k and v.ndim > 1}
        network = {
            k.removeprefix(f"{component}."): v
            for k, v in alphas.items()
            if k.startswith(f"{component}.")
        }
    else:
        model = getattr(pipe, component)
        ranks = {}
        for module_name, _ in model.named_modules():
            key = f"{module_name}.lora_B.weight"
            if module_name.endswith(_TEXT_ENCODER_RANK_MODULES) and key in part:
                ranks[key] = part[key].shape[1]
        network = {
            k.removeprefix(f"{component}."): v
            for k, v in alphas.items()
            if k.split(".")[0] == component
        }
    try:
        kwargs = own or get_peft_kwargs(
            ranks, network or None, part, is_unet=component in DENOISERS
        )
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError, IndexError, KeyError) as e:
        raise errors.IncompatibleAdapter(
            f"adapter {name!r}: no LoRA configuration can be derived for {component}: {e}",
            param="lora_path",
        ) from e
    rank_pattern = config.rank_pattern or {}
    alpha_pattern = config.alpha_pattern or {}
    for key in part:
        module, sep, _ = key.rpartition(".lora_B.bias")
        if not sep:
            module, sep, _ = key.rpartition(".lora_magnitude_vector")
        if sep and f"{module}.lora_A.weight" not in part:
            raise errors.IncompatibleAdapter(
                f"adapter {name!r}: '{component}.{key}' has no LoRA pair", param="lora_path"
            )
    layers: dict[LayerKey, LayerWeights] = {}
    for key, down in part.items():
        module, sep, _ = key.partition(".lora_A.")
        if not sep:
            continue
        up = part.get(f"{module}.lora_B.weight")
        if up is None:
            raise errors.IncompatibleAdapter(
                f"adapter {name!r}: '{component}.{module}' has a down matrix and no up matrix",
                param="lora_path",
            )
        rank = rank_pattern.get(get_pattern_key(list(rank_pattern), module), config.r)
        if rank != down.shape[0]:
            raise errors.IncompatibleAdapter(
                f"adapter {name!r}: its configuration gives '{component}.{module}' rank "
                f"{rank}, but its weights have rank {down.shape[0]}",
                param="lora_path",
            )
        alpha = alpha_pattern.get(get_pattern_key(list(alpha_pattern), module), config.lora_alpha)
        layers[(component, module)] = LayerWeights(
            down=down,
            up=up,
            alpha=float(alpha),
            rslora=bool(config.use_rslora),
            bias=part.get(f"{module}.lora_B.bias"),
            magnitude=_magnitude(part, module),
        )
    return layers
