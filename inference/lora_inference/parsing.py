"""Reading an adapter file (any thread: touches no pipeline state): hashed, checked and converted
into what the CPU tier caches (`backend.ParsedAdapter`), before the pipeline ever sees it.

The file is read once, hashed as it arrives on a thread beside this one, and its tensors are
views of the bytes read (`weightsfile`). Low-rank modules become per-layer pairs with the setup
diffusers and peft would give them (`formats`, `lycoris`), packed straight into one slot row in
the model's dtype (`slots.Slots.pack`); a plain LoRA file in the model's dtype is never copied
before that, nor widened to float64 (LyCORIS factors are multiplied out in float64, exactly). A
merged-only file's whole-matrix modules become per-layer deltas (`merge_only`). NaN, Inf, shapes,
ranks and names are checked here, so a file the pipeline would fail on is a 422 before any state
changes.

Of the pipeline it reads only what `Model` declares (`pipeline.DiffusionBackend` is one), so it
never imports the pipeline module, which calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from lora_volume import files
from lora_volume.formats import Format

from lora_inference import errors, formats, merge_only, merging, weightsfile
from lora_inference.adapters import validation
from lora_inference.backend import LayerKey, ParsedAdapter
from lora_inference.slot_packing import LayerWeights
from lora_inference.slots import Slots


class Model(Protocol):
    """What reading an adapter needs of the pipeline it is for, none of it state a read
    changes: the pipeline (its components and configs, for diffusers' converters), its layer
    table, its dtype, its slots (whether host copies are page-locked) and their packing."""

    @property
    def pipe(self) -> Any: ...
    @property
    def shapes(self) -> validation.ModelShapes: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def slots(self) -> Slots: ...
    def pack(self, layers: Mapping[LayerKey, LayerWeights], *, name: str) -> torch.Tensor: ...


def parse_adapter(model: Model, path: Path, *, name: str, max_rank: int) -> ParsedAdapter:
    """`DiffusionBackend.parse_adapter`: read, hash, check and convert the adapter at `path`."""
    weights = files.find_weights_file(path)
    # One pass over the bytes: hashed as they are read, on a thread of its own (`weightsfile`).
    read = weightsfile.read(weights)
    header = files.parse_safetensors_header(read.data, read.size, name=weights.name)
    # Views of the bytes read, sorted by name: diffusers breaks ties between equally common
    # ranks and alphas by the order it meets them, so a file always gets the same setup.
    tensors = read.tensors(header)
    fmt = files.check_lora_keys(list(tensors), name=name)
    _check_finite(tensors, name=name, why="holds NaN or Inf values")
    full: dict[LayerKey, merging.FullLayer] = {}
    if fmt.merged_only:  # whole-matrix modules: deltas for the merged path, in float64
        tensors, modules = merge_only.split(tensors)
        full = merge_only.parse(
            model.pipe, modules, fmt, model.shapes, dtype=model.dtype, name=name
        )
    metadata = files.lora_metadata(header, name=name)
    layers, rank = _pairs(model, tensors, fmt, metadata, name=name, max_rank=max_rank)
    if layers.keys() & full.keys():
        raise errors.IncompatibleAdapter(
            f"adapter {name!r} changes {sorted(layers.keys() & full.keys())[0]} twice, as "
            "a pair and as a whole matrix; re-export it with one module per layer",
            param="lora_path",
        )
    return ParsedAdapter(
        sha256=read.sha256(),
        size_bytes=read.size,
        rank=rank,
        weights_file=weights,
        layers=layers,
        packed=model.pack(layers, name=name),
        format=fmt.key,
        trigger_words=files.trigger_words(header),
        full=merging.pinned(full, pin=model.slots.pinned),
    )


def _pairs(
    model: Model,
    tensors: dict[str, torch.Tensor],
    fmt: Format,
    metadata: Mapping[str, Any] | None,
    *,
    name: str,
    max_rank: int,
) -> tuple[dict[LayerKey, LayerWeights], int]:
    """The low-rank layers of a file's `tensors`, converted and checked, and their rank
    (none, rank 0, for a merged-only file of whole-matrix modules alone)."""
    if not tensors:
        return {}, 0
    # LyCORIS factors (and SD 3 kohya pairs) become exact pairs in float64, each module's
    # scale folded in, before any rounding to the model's dtype.
    folded = formats.folds_scale(model.pipe, tensors, fmt)
    if folded:
        tensors = formats.to_folded_pairs(tensors, fmt, name=name)
    # Weights take the model's dtype; scalars (alphas) keep theirs, as diffusers reads them.
    cast = {
        k: v.to(model.dtype)
        for k, v in tensors.items()
        if v.is_floating_point() and v.dim() > 0 and v.dtype != model.dtype
    }
    _check_finite(cast, name=name, why=f"overflows {str(model.dtype).removeprefix('torch.')}")
    tensors.update(cast)
    parts, alphas = formats.convert(model.pipe, tensors, fmt, name=name)
    formats.fit_conv_pairs(parts, model.shapes)
    # Biases and DoRA magnitudes are checked with their layer (`slots.Slots.pack`).
    shapes = {
        c: {k: tuple(v.shape) for k, v in part.items() if formats.is_pair_key(k)}
        for c, part in parts.items()
    }
    try:
        summary = validation.check_adapter_fits(shapes, model.shapes, max_rank=max_rank, name=name)
    except errors.IncompatibleAdapter as e:
        raise formats.explain_rank(e, fmt) from e
    layers: dict[LayerKey, LayerWeights] = {}
    for component, part in parts.items():
        layers.update(formats.layer_weights(model.pipe, component, part, alphas, metadata, name))
    if folded:
        layers = formats.at_scaling_one(layers)
    return layers, summary.rank


def _check_finite(tensors: Mapping[str, torch.Tensor], *, name: str, why: str) -> None:
    """Refuse weights that would turn every image using them into NaN (pure).

    A tensor's smallest and largest elements are both finite exactly when all of its elements
    are (NaN wins both): one reduction per tensor in its own dtype, with no boolean copy of it
    and no conversion to float64.
    """
    for key, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if tensor.element_size() == 1:  # float8: no reductions of its own
            tensor = tensor.float()
        low, high = torch.aminmax(tensor)
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            raise errors.IncompatibleAdapter(
                f"adapter {name!r}: tensor {key!r} {why}; such weights would ruin every image "
                "that uses the adapter. Re-export it from a healthy checkpoint",
                param="lora_path",
            )
