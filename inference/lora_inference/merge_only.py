"""Modules of a merged-only adapter file, read as whole-matrix deltas per layer (any thread).

LoKr with a full w2 and full weight differences (`.diff`, `.diff_b`) change whole matrices: no
slot of `--max-lora-rank` holds them, so the server keeps each layer's delta at scale 1 on the
CPU and merges it into the base weight for a batch of that adapter alone
(`merging.BaseWeights.merged_full`). This module computes those deltas exactly, in float64,
from the format's definition:

- LoKr with a full w2: `delta = scale x kron(W1, W2)`, W1 full or factored (`lokr_w1_a @
  lokr_w1_b`); for a convolution W1 spans the channels and W2 carries the kernel. The scale is
  LyCORIS's: alpha / dim with dim the rank of the factored W1, and 1 when both factors are full
  (LyCORIS trains those at scale 1 whatever alpha it stores).
- `.diff`: the delta as stored; `.diff_b`: the bias's.

Names go the way a pair's would: each module is sent through the family's own converters
(`formats.convert`) as a probe pair of rank 1 whose down factor holds the module's number and
whose up factor numbers its output rows, so a fused layer split by the converter (Flux's qkv,
SD 3's), renamed (SGM blocks, BFL blocks) or reordered (SD 3's last modulation) tells exactly
which rows of the module each layer of the model takes. A module whose rows do not all land on
Linear or Conv2d layers of this model is a 422 naming it.

Imports torch and `formats` (which imports diffusers); owns no state, touches no pipeline state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lora_volume import formats as names

from lora_inference import errors, formats
from lora_inference.adapters import validation
from lora_inference.merging import FullLayer, LayerKey

Tensors = dict[str, torch.Tensor]

# Suffixes that make a module merged only, and those that may come with them.
_MARKS = (".diff", ".diff_b", ".lokr_w2")
_PARTS = (".diff", ".diff_b", ".lokr_w2", ".lokr_w1", ".lokr_w1_a", ".lokr_w1_b", ".alpha")


def split(tensors: Tensors) -> tuple[Tensors, dict[str, Tensors]]:
    """`tensors` without the merged-only modules, and those modules' tensors by module name."""
    stems = {key.rsplit(".", 1)[0] for key in tensors if key.endswith(_MARKS)}
    modules: dict[str, Tensors] = {}
    rest: Tensors = {}
    for key, tensor in tensors.items():
        stem, _, part = key.rpartition(".")
        if stem in stems and f".{part}" in _PARTS:
            modules.setdefault(stem, {})[part] = tensor
        else:
            rest[key] = tensor
    return rest, modules


def module_delta(parts: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One module's (weight delta, bias delta or None) at scale 1, in float64, shaped as its
    layer's weight (pure). Raises KeyError for a missing factor, ValueError for bad shapes."""
    f64 = {k: v.to(torch.float64) for k, v in parts.items()}
    if "lokr_w2" in f64:
        w2 = f64["lokr_w2"]
        dim = None
        if "lokr_w1" in f64:
            w1 = f64["lokr_w1"]
        else:
            w1, dim = f64["lokr_w1_a"] @ f64["lokr_w1_b"], f64["lokr_w1_b"].shape[0]
        if w1.dim() != 2 or w2.dim() not in (2, 4):
            raise ValueError(f"LoKr factors of shapes {tuple(w1.shape)} and {tuple(w2.shape)}")
        alpha = float(f64["alpha"]) if "alpha" in f64 else 0.0
        scale = alpha / dim if dim and alpha else 1.0
        w1 = w1.reshape(*w1.shape, *(1,) * (w2.dim() - 2))
        return scale * torch.kron(w1, w2), None
    if "diff" not in f64:
        raise ValueError("a bias difference (.diff_b) without its weight difference (.diff)")
    diff, bias = f64["diff"], f64.get("diff_b")
    if diff.dim() not in (2, 4):
        raise ValueError(
            f"a .diff of shape {tuple(diff.shape)}: only Linear and Conv2d layers' are served "
            "(a norm layer's is not)"
        )
    if bias is not None and bias.shape != diff.shape[:1]:
        raise ValueError(
            f"a .diff_b of shape {tuple(bias.shape)} beside a .diff of {diff.shape[0]} rows"
        )
    return diff, bias


def parse(
    pipe: Any,
    modules: Mapping[str, Tensors],
    fmt: names.Format,
    shapes: validation.ModelShapes,
    *,
    dtype: torch.dtype,
    name: str,
) -> dict[LayerKey, FullLayer]:
    """The per-layer deltas of `modules` (from `split`), in `dtype`: IncompatibleAdapter
    (422) for a module that is malformed or does not map onto this model's layers."""
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for stem, parts in sorted(modules.items()):
        try:
            deltas[stem] = module_delta(parts)
        except KeyError as e:
            raise _bad(name, fmt, f"module {stem!r} lacks its tensor {e}") from e
        except (RuntimeError, ValueError) as e:
            raise _bad(name, fmt, f"module {stem!r} is not a well-formed one: {e}") from e
    layers: dict[LayerKey, FullLayer] = {}
    for stem, targets in _targets(pipe, deltas, fmt, name).items():
        delta, bias = deltas[stem]
        flat = delta.reshape(delta.shape[0], -1)
        for key, rows in targets:
            layers[key] = _layer(pipe, key, shapes, flat[rows], bias, rows, stem, fmt, name, dtype)
    return layers


def _targets(
    pipe: Any,
    deltas: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]],
    fmt: names.Format,
    name: str,
) -> dict[str, list[tuple[LayerKey, torch.Tensor]]]:
    """Per module: the model's layers it lands on, each with the module's rows it takes."""
    stems = list(deltas)
    components = set(getattr(pipe, "_lora_loadable_modules", ()))
    probes: Tensors = {}
    for number, stem in enumerate(stems, start=1):
        delta = deltas[stem][0]
        kernel = (1,) * (delta.dim() - 2)
        peft = stem.split(".", 1)[0] in components
        down_name, up_name = ("lora_A", "lora_B") if peft else ("lora_down", "lora_up")
        probes[f"{stem}.{down_name}.weight"] = torch.full((1, *delta.shape[1:]), float(number))
        rows = torch.arange(1, delta.shape[0] + 1, dtype=torch.float32)
        probes[f"{stem}.{up_name}.weight"] = rows.reshape(-1, 1, *kernel)
    parts, _ = formats.convert(pipe, probes, fmt, name=name)
    found: dict[str, list[tuple[LayerKey, torch.Tensor]]] = {}
    for component, part in parts.items():
        for key, down in part.items():
            module, sep, _ = key.partition(".lora_A.")
            if not sep:
                continue
            stem = stems[round(float(down.reshape(-1)[0])) - 1]
            rows = part[f"{module}.lora_B.weight"].reshape(-1).round().long() - 1
            found.setdefault(stem, []).append(((component, module), rows))
    for stem in stems:
        taken = torch.cat([rows for _, rows in found.get(stem, [])] or [torch.empty(0).long()])
        if not torch.equal(taken.sort().values, torch.arange(deltas[stem][0].shape[0])):
            raise _bad(name, fmt, f"module {stem!r} does not map onto this model's layers")
    return found


def _layer(
    pipe: Any,
    key: LayerKey,
    shapes: validation.ModelShapes,
    delta: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
    stem: str,
    fmt: names.Format,
    name: str,
    dtype: torch.dtype,
) -> FullLayer:
    component, module = key
    shape = shapes.get(component, {}).get(module)
    if shape is None:
        raise _bad(
            name,
            fmt,
            f"module {stem!r} lands on {component}.{module}, which is not a Linear or Conv2d "
            "layer of this model (only those are served)",
        )
    kernel = tuple(shape.kernel or ())
    weight_shape = (shape.out_features, shape.in_features, *kernel)
    if delta.numel() != torch.Size(weight_shape).numel() or delta.shape[0] != weight_shape[0]:
        raise _bad(
            name,
            fmt,
            f"module {stem!r} gives {component}.{module} a delta of {tuple(delta.shape)}, but "
            f"that layer's weight is {weight_shape}; is it for another model?",
        )
    layer_bias = None
    if bias is not None:
        if getattr(pipe, component).get_submodule(module).bias is None:
            raise _bad(name, fmt, f"module {stem!r} changes the bias of a layer that has none")
        layer_bias = bias.reshape(-1)[rows].to(dtype)
    full = FullLayer(delta.reshape(weight_shape).to(dtype), layer_bias)
    for tensor in (full.delta, full.bias):
        if tensor is not None and not bool(torch.isfinite(tensor).all()):
            raise _bad(name, fmt, f"module {stem!r} overflows {str(dtype).removeprefix('torch.')}")
    return full


def _bad(name: str, fmt: names.Format, why: str) -> errors.IncompatibleAdapter:
    return errors.IncompatibleAdapter(f"adapter {name!r} ({fmt.label}): {why}", param="lora_path")
