"""Modules of a merged-only adapter file, read as whole-matrix deltas per layer (any thread).

LoKr with a full w2, full weight differences (`.diff`, `.diff_b`) and kohya / LyCORIS DoRA
(`dora_scale`) change whole matrices, or rescale them against the base weight: no slot of
`--max-lora-rank` holds them, so the server keeps each layer's delta at scale 1 on the CPU and
merges it into the base weight for a batch of that adapter alone
(`merging.BaseWeights.merged_full`). This module computes those deltas exactly, in float64,
from the format's definition:

- LoKr with a full w2: `delta = scale x kron(W1, W2)`, W1 full or factored (`lokr_w1_a @
  lokr_w1_b`); for a convolution W1 spans the channels and W2 carries the kernel. The scale is
  LyCORIS's: alpha / dim with dim the rank of the factored W1, and 1 when both factors are full
  (LyCORIS trains those at scale 1 whatever alpha it stores).
- `.diff`: the delta as stored; `.diff_b`: the bias's.
- DoRA (`dora_scale` beside any LyCORIS module or kohya pair): the module's delta ΔW
  (`lycoris.module_delta`) and the magnitude m; the weight at scale 1 is
  `W' = m x (W + ΔW) / |W + ΔW|`, the norm per input channel when m is (1, in, ...) (LyCORIS's
  default) or per output row when it is (out, 1, ...) (`wd_on_out`). It needs the base weight,
  so it is computed when merged (`merging.FullLayer.merged`); at scale s the weight is
  `W + s (W' - W)`, as A1111 and ComfyUI apply a strength.

Names go the way a pair's would: each module is sent through the family's own converters
(`formats.convert`) as a probe pair of rank 1 whose down factor holds the module's number and
whose up factor numbers its output rows, so a fused layer split by the converter (Flux's qkv,
SD 3's), renamed (SGM blocks, BFL blocks) or reordered (SD 3's last modulation) tells exactly
which rows of the module each layer of the model takes. A module whose rows do not all land on
Linear or Conv2d layers of this model is a 422 naming it.

Imports torch and `formats` (which imports diffusers); owns no state, touches no pipeline state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from lora_volume import formats as names

from lora_inference import errors, formats, lycoris
from lora_inference.adapters import validation
from lora_inference.backend import LayerKey
from lora_inference.merging import FullLayer

Tensors = dict[str, torch.Tensor]

# Suffixes that make a module merged only, and those that may come with them.
_MARKS = (".diff", ".diff_b", ".lokr_w2", ".dora_scale")
_PARTS = (*_MARKS, *lycoris.SUFFIXES)

# One module's weight delta, bias delta and DoRA magnitude (with its axis), in float64.
Module = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]


def split(tensors: Tensors) -> tuple[Tensors, dict[str, Tensors]]:
    """`tensors` without the merged-only modules, and those modules' tensors by module name."""
    stems = {key.removesuffix(m) for key in tensors for m in _MARKS if key.endswith(m)}
    modules: dict[str, Tensors] = {}
    rest: Tensors = {}
    for key, tensor in tensors.items():
        part = next((p for p in _PARTS if key.endswith(p) and key.removesuffix(p) in stems), None)
        if part is None:
            rest[key] = tensor
        else:
            modules.setdefault(key.removesuffix(part), {})[part.lstrip(".")] = tensor
    return rest, modules


def module_delta(parts: Mapping[str, torch.Tensor]) -> Module:
    """One module's weight delta at scale 1 (shaped as its layer's weight, or flattened to
    (fan_out, fan_in) for a DoRA one), bias delta, and DoRA magnitude with the axis its norm
    keeps (0: per output row, 1: per input channel), in float64 (pure). Raises KeyError for a
    missing tensor, ValueError or RuntimeError for shapes that do not fit."""
    f64 = {k: v.to(torch.float64) for k, v in parts.items()}
    magnitude = f64.pop("dora_scale", None)
    if magnitude is not None:
        delta, _, _, _ = module_delta({k: v for k, v in parts.items() if k != "dora_scale"})
        # (1, in, ...): per input channel; (out, 1, ...) or (out,): per output row.
        if magnitude.dim() >= 2 and magnitude.shape[0] == 1 < delta.shape[0]:
            return delta, None, magnitude, 1
        if magnitude.numel() == magnitude.shape[0] == delta.shape[0]:
            return delta, None, magnitude, 0
        raise ValueError(
            f"a dora_scale of shape {tuple(magnitude.shape)} beside a delta of "
            f"{tuple(delta.shape)}: neither one per output row nor one per input channel"
        )
    if "diff" not in f64 and "diff_b" not in f64 and "lokr_w2" not in f64:
        return lycoris.module_delta(parts), None, None, 0  # a DoRA module's low-rank delta
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
        return scale * torch.kron(w1, w2), None, None, 0
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
    return diff, bias, None, 0


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
    read: dict[str, Module] = {}
    for stem, parts in sorted(modules.items()):
        try:
            read[stem] = module_delta(parts)
        except KeyError as e:
            raise _bad(name, fmt, f"module {stem!r} lacks its tensor {e}") from e
        except (RuntimeError, ValueError) as e:
            raise _bad(name, fmt, f"module {stem!r} is not a well-formed one: {e}") from e
    layers: dict[LayerKey, FullLayer] = {}
    for stem, targets in _targets(pipe, {s: m[0] for s, m in read.items()}, fmt, name).items():
        delta, bias, magnitude, axis = read[stem]
        if magnitude is not None and axis == 1 and len(targets) > 1:
            raise _bad(
                name,
                fmt,
                f"module {stem!r} normalises per input channel across the {len(targets)} layers "
                f"{type(pipe).__name__} splits it into, which is not served; re-train it with "
                "the norm per output row (wd_on_out)",
            )
        flat = delta.reshape(delta.shape[0], -1)
        for key, rows in targets:
            where = f"module {stem!r} on {key[0]}.{key[1]}"
            weight_shape = _weight_shape(shapes, key, where, name, fmt)
            if flat[rows].numel() != math.prod(weight_shape):
                raise _bad(
                    name,
                    fmt,
                    f"{where}: a delta of {tuple(flat[rows].shape)}, but that layer's weight is "
                    f"{weight_shape}; is it for another model?",
                )
            layer = FullLayer(
                flat[rows].reshape(weight_shape).to(dtype),
                _bias(pipe, key, bias, rows, where, name, fmt, dtype),
                _magnitude(magnitude, axis, rows, weight_shape, where, name, fmt, dtype),
                axis,
            )
            for tensor in (layer.delta, layer.bias, layer.magnitude):
                if tensor is not None and not bool(torch.isfinite(tensor).all()):
                    raise _bad(name, fmt, f"{where} overflows {str(dtype).removeprefix('torch.')}")
            layers[key] = layer
    return layers


def _targets(
    pipe: Any, deltas: Mapping[str, torch.Tensor], fmt: names.Format, name: str
) -> dict[str, list[tuple[LayerKey, torch.Tensor]]]:
    """Per module: the model's layers it lands on, each with the module's rows it takes."""
    stems = list(deltas)
    components = set(getattr(pipe, "_lora_loadable_modules", ()))
    probes: Tensors = {}
    for number, stem in enumerate(stems, start=1):
        delta = deltas[stem]
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
        if not torch.equal(taken.sort().values, torch.arange(deltas[stem].shape[0])):
            raise _bad(name, fmt, f"module {stem!r} does not map onto this model's layers")
    return found


def _weight_shape(
    shapes: validation.ModelShapes, key: LayerKey, where: str, name: str, fmt: names.Format
) -> tuple[int, ...]:
    shape = shapes.get(key[0], {}).get(key[1])
    if shape is None:
        raise _bad(name, fmt, f"{where}: not a Linear or Conv2d layer (only those are served)")
    return (shape.out_features, shape.in_features, *(shape.kernel or ()))


def _bias(
    pipe: Any,
    key: LayerKey,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
    where: str,
    name: str,
    fmt: names.Format,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    if bias is None:
        return None
    if getattr(pipe, key[0]).get_submodule(key[1]).bias is None:
        raise _bad(name, fmt, f"{where}: it changes the bias of a layer that has none")
    return bias.reshape(-1)[rows].to(dtype)


def _magnitude(
    magnitude: torch.Tensor | None,
    axis: int,
    rows: torch.Tensor,
    weight_shape: tuple[int, ...],
    where: str,
    name: str,
    fmt: names.Format,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """A DoRA magnitude for one layer, shaped to broadcast along its axis."""
    if magnitude is None:
        return None
    ones = (1,) * (len(weight_shape) - 2)
    if axis == 0:
        return magnitude.reshape(-1)[rows].reshape(-1, 1, *ones).to(dtype)
    if magnitude.numel() != weight_shape[1]:
        raise _bad(
            name,
            fmt,
            f"{where}: a dora_scale of {magnitude.numel()} input channels on a layer of "
            f"{weight_shape[1]}",
        )
    return magnitude.reshape(1, -1, *ones).to(dtype)


def _bad(name: str, fmt: names.Format, why: str) -> errors.IncompatibleAdapter:
    return errors.IncompatibleAdapter(f"adapter {name!r} ({fmt.label}): {why}", param="lora_path")
