"""The diffusers pipeline and everything that touches it (with `formats`, which converts adapter
files with diffusers' converters, the only modules that import diffusers).

Adapter state in a diffusers pipeline is global and not thread-safe, so a `DiffusionBackend` is
driven by exactly one thread (the engine's pipeline worker), apart from `parse_adapter`, which
reads files and touches no pipeline state. Its methods are blocking. Rules from
docs/architecture.md enforced here:

- an adapter is read, converted and checked against the model's layer table before the pipeline
  sees it (shapes, ranks, NaN and Inf); its per-layer setup (rank, alpha, rsLoRA) is worked out
  then, with diffusers' and peft's own configuration code, so entering the pipeline is a copy
  into a slot (`slots.Slots`), never a diffusers load;
- before each batch exactly the batch's adapters are set on their layers, at their scales, and
  read back; scales go through each layer's scaling, never `cross_attention_kwargs`, whose
  in-place multiply/divide is stateful;
- a merged call restores the merged weights from pristine copies, never by subtracting.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import torch
from diffusers import DiffusionPipeline
from lora_volume import files
from PIL import Image

from lora_inference import calibration, costs, errors, formats
from lora_inference.adapters import validation
from lora_inference.costs import MergePolicy
from lora_inference.slots import LayerKey, LayerWeights, Slots

log = logging.getLogger(__name__)

_DENOISERS = formats.DENOISERS
# Sampling defaults per family, as the model cards recommend; requests may override them.
_SAMPLING_DEFAULTS = {
    "StableDiffusionPipeline": (30, 7.5),
    "StableDiffusionXLPipeline": (30, 5.0),
    "StableDiffusion3Pipeline": (28, 7.0),
    "FluxPipeline": (28, 3.5),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

BatchPath = Literal["base", "adapter", "merged", "mixed"]


@dataclass(frozen=True)
class ParsedAdapter:
    """An adapter read from disk, checked and converted: what the CPU tier caches."""

    sha256: str
    size_bytes: int
    rank: int
    weights_file: Path
    # Per targeted layer: the weights under peft's module names, with the setup peft would give
    # them (stacks are built from these).
    layers: Mapping[LayerKey, LayerWeights]
    # The same, packed into one slot row (`slots.Slots.pack`): entering a slot is one copy of it.
    packed: torch.Tensor
    format: str = "lora"  # lora_volume.formats.Format.key of the file
    trigger_words: tuple[str, ...] = ()  # what the file's metadata says to put in a prompt


@dataclass(frozen=True)
class ImageJob:
    """One request's share of a batch."""

    prompt: str
    negative_prompt: str | None
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class BatchOutcome:
    images: list[Image.Image]
    path: BatchPath
    merged_layers: int


@dataclass(frozen=True)
class Calibration:
    """What the cost model (`costs.plan_merge`) needs about this pipeline on this device."""

    rates: costs.Rates
    rows: Mapping[LayerKey, costs.LayerRows]


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class DiffusionBackend:
    """A loaded pipeline, its LoRA slots, and the layer table adapters are checked against."""

    def __init__(
        self, pipe: Any, *, device: str, dtype: torch.dtype, slots: int = 16, max_rank: int = 64
    ) -> None:
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.family = type(pipe).__name__
        self.components = tuple(
            c
            for c in getattr(pipe, "_lora_loadable_modules", ())
            if getattr(pipe, c, None) is not None
        )
        self.shapes = _layer_shapes(pipe, self.components)
        self.slots = Slots(
            {c: getattr(pipe, c) for c in self.components}, count=slots, max_rank=max_rank
        )
        self.calibration: Calibration | None = None
        self._call_params = set(inspect.signature(pipe.__call__).parameters)
        self.vae_scale = int(getattr(pipe, "vae_scale_factor", 8))
        denoiser = self._denoiser()
        sample = getattr(denoiser.config, "sample_size", 64)
        sample = sample[0] if isinstance(sample, list | tuple) else sample
        # Flux and SD3 patchify latents; their sample_size is already in latent pixels.
        self.default_size = int(sample) * self.vae_scale
        self.default_steps, self.default_guidance = _SAMPLING_DEFAULTS.get(self.family, (30, 7.0))

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        device: str,
        dtype: torch.dtype,
        slots: int = 16,
        max_rank: int = 64,
    ) -> DiffusionBackend:
        pipe = DiffusionPipeline.from_pretrained(str(model_dir), dtype=dtype)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval()  # dropout would make generation nondeterministic
        if not hasattr(pipe, "load_lora_weights"):
            raise ValueError(f"{type(pipe).__name__} does not support LoRA adapters")
        return cls(pipe, device=device, dtype=dtype, slots=slots, max_rank=max_rank)

    # -- reading adapters (any thread: touches no pipeline state) ----------------------------

    def parse_adapter(self, path: Path, *, name: str, max_rank: int) -> ParsedAdapter:
        """Read, hash, check and convert an adapter without touching the pipeline.

        Raises the volume's UnsupportedFormat (pickle) and InvalidAdapter (corrupt file, not a
        LoRA), and IncompatibleAdapter (unreadable tensors, NaN or Inf weights, wrong shapes or
        rank for this model).
        """
        weights = files.find_weights_file(path)
        data = weights.read_bytes()
        header = files.parse_safetensors_header(data, len(data), name=weights.name)
        try:
            tensors = safetensors.torch.load(data)
        except Exception as e:  # safetensors raises its own error types
            raise errors.IncompatibleAdapter(
                f"{weights.name} cannot be read as safetensors: {e}", param="lora_path"
            ) from e
        # safetensors returns the tensors in no fixed order, and diffusers breaks ties between
        # equally common ranks and alphas by the order it meets them: sorted, a file always
        # gets the same setup.
        tensors = dict(sorted(tensors.items()))
        fmt = files.check_lora_keys(list(tensors), name=name)
        _check_finite(tensors, name=name, why="holds NaN or Inf values")
        # LyCORIS factors (and SD 3 kohya pairs) become exact pairs in float64, each module's
        # scale folded in, before any rounding to the model's dtype.
        folded = formats.folds_scale(self.pipe, tensors, fmt)
        if folded:
            tensors = formats.to_folded_pairs(tensors, fmt, name=name)
        # Weights take the model's dtype; scalars (alphas) keep theirs, as diffusers reads them.
        cast = {
            k: v.to(self.dtype)
            for k, v in tensors.items()
            if v.is_floating_point() and v.dim() > 0 and v.dtype != self.dtype
        }
        _check_finite(cast, name=name, why=f"overflows {str(self.dtype).removeprefix('torch.')}")
        tensors.update(cast)
        parts, alphas = formats.convert(self.pipe, tensors, fmt, name=name)
        formats.fit_conv_pairs(parts, self.shapes)
        # Biases and DoRA magnitudes are checked with their layer (`slots.Slots.pack`).
        shapes = {
            c: {k: tuple(v.shape) for k, v in part.items() if formats.is_pair_key(k)}
            for c, part in parts.items()
        }
        try:
            summary = validation.check_adapter_fits(
                shapes, self.shapes, max_rank=max_rank, name=name
            )
        except errors.IncompatibleAdapter as e:
            raise formats.explain_rank(e, fmt) from e
        metadata = files.lora_metadata(header, name=name)
        layers: dict[LayerKey, LayerWeights] = {}
        for component, part in parts.items():
            layers.update(formats.layer_weights(self.pipe, component, part, alphas, metadata, name))
        if folded:
            layers = formats.at_scaling_one(layers)
        return ParsedAdapter(
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            rank=summary.rank,
            weights_file=weights,
            layers=layers,
            packed=self.pack(layers, name=name),
            format=fmt.key,
            trigger_words=files.trigger_words(header),
        )

    def pack(self, layers: Mapping[LayerKey, LayerWeights], *, name: str) -> torch.Tensor:
        """`layers` packed into one slot row (any thread); IncompatibleAdapter if they do not
        fit the slots (a rank above --max-lora-rank, a layer the slots lack)."""
        try:
            return self.slots.pack(layers)
        except ValueError as e:
            raise errors.IncompatibleAdapter(f"adapter {name!r}: {e}", param="lora_path") from e

    # -- the pipeline (pipeline thread only) ----------------------------------------------------

    def place(self, slot: str, adapter: ParsedAdapter) -> None:
        """Copy `adapter` into `slot` (see slots.Slots.place)."""
        self.slots.place(slot, adapter.layers, adapter.packed)

    def clear(self, slot: str) -> None:
        self.slots.clear(slot)

    def resident_keys(self) -> set[str]:
        return self.slots.held()

    def run_batch(
        self,
        jobs: Sequence[ImageJob],
        slots: Sequence[str | None],
        scales: Mapping[str, float],
        *,
        width: int,
        height: int,
        steps: int,
        guidance_scale: float,
        merge: MergePolicy = "auto",
    ) -> BatchOutcome:
        """One pipeline call for `jobs`, each through its own slot (None: the base model).

        A batch of one slot runs its branch directly, with the layers where the cost model says
        so (`merge`) merged for the call; a batch that mixes slots, or a slot and the base model,
        runs every image's branch in one gathered pass per layer (`slots.Slots.call`).
        """
        kinds = set(slots)
        per_image = [slot for job, slot in zip(jobs, slots, strict=True) for _ in job.seeds]
        generate = functools.partial(
            self._generate, width=width, height=height, steps=steps, guidance_scale=guidance_scale
        )
        if kinds == {None}:
            return BatchOutcome(generate(jobs), "base", 0)
        if len(kinds) == 1:
            slot = next(s for s in kinds if s is not None)
            call = costs.Call(
                images=len(per_image),
                steps=steps,
                latent_area=(width / self.vae_scale) * (height / self.vae_scale),
                guided=guidance_scale > 1.0,
            )
            keys = self.merge_plan(slot, call, merge)
            with self.slots.call(per_image, scales, merged=keys):
                images = generate(jobs)
            return BatchOutcome(images, "merged" if keys else "adapter", len(keys))
        with self.slots.call(per_image, scales):
            return BatchOutcome(generate(jobs), "mixed", 0)

    def merge_plan(self, slot: str, call: costs.Call, policy: MergePolicy) -> list[LayerKey]:
        """The layers of `slot` to merge for `call` (pure given the calibration)."""
        footprint = self.slots.footprint(slot)
        if policy == "never":
            return []
        if policy == "always":
            return list(footprint)
        calibration = self.calibration
        if calibration is None:
            raise RuntimeError("merge policy auto needs calibrate() first")
        keys = list(footprint)
        loads = []
        for component, module in keys:
            shape = self.shapes[component][module]
            loads.append(
                costs.LayerLoad(
                    fan_in=shape.in_features * math.prod(shape.kernel or (1,)),
                    fan_out=shape.out_features,
                    rank=footprint[(component, module)],
                    rows=calibration.rows.get((component, module)),
                )
            )
        decisions = costs.plan_merge(loads, call, calibration.rates)
        return [key for key, merge in zip(keys, decisions, strict=True) if merge]

    def _generate(
        self,
        jobs: Sequence[ImageJob],
        *,
        width: int,
        height: int,
        steps: int,
        guidance_scale: float,
    ) -> list[Image.Image]:
        prompts = [job.prompt for job in jobs for _ in job.seeds]
        generators = [
            torch.Generator(device="cpu").manual_seed(seed) for job in jobs for seed in job.seeds
        ]
        kwargs: dict[str, Any] = {
            "prompt": prompts,
            "generator": generators,
            "num_inference_steps": steps,
            "guidance_scale": guidance_scale,
            "height": height,
            "width": width,
            "output_type": "pil",
        }
        negatives = [job.negative_prompt or "" for job in jobs for _ in job.seeds]
        if any(negatives) and "negative_prompt" in self._call_params:
            kwargs["negative_prompt"] = negatives
        with torch.inference_mode():
            result = self.pipe(**kwargs)
        return list(result.images)

    # -- calibration (pipeline thread, once, before any adapter) --------------------------------

    def calibrate(self) -> Calibration:
        """Measure what the merge decisions need; cached, so backends sharing it agree.

        Rows per layer come from three calls of one image and one step with every Linear and
        Conv2d of the adaptable components counting the rows it sees (guided at two sizes,
        unguided at one); the device's rates from timing a LoRA branch and a merge on layers of
        two sizes. A few tenths of a second on a CPU with a full-size model.
        """
        if self.calibration is None:
            started = time.perf_counter()
            self.calibration = Calibration(
                rates=calibration.measure_rates(self.device, self.dtype),
                rows=calibration.measure_rows(
                    self.pipe, self.components, self.shapes, vae_scale=self.vae_scale
                ),
            )
            log.info(
                "calibrated the merge cost model in %.2f s: %s",
                time.perf_counter() - started,
                self.calibration.rates,
            )
        return self.calibration

    # -- introspection --------------------------------------------------------------------------

    def parameter_count(self) -> int:
        return sum(p.numel() for c in self.components for p in getattr(self.pipe, c).parameters())

    def _denoiser(self) -> Any:
        for name in _DENOISERS:
            denoiser = getattr(self.pipe, name, None)
            if denoiser is not None:
                return denoiser
        raise ValueError(f"{self.family} has neither a unet nor a transformer")


def _check_finite(tensors: Mapping[str, torch.Tensor], *, name: str, why: str) -> None:
    """Refuse weights that would turn every image using them into NaN (pure).

    A float64 sum is NaN or infinite exactly when some element is: no sum of float32 values can
    overflow float64. One reduction per tensor instead of a boolean copy of it.
    """
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        if tensor.dtype == torch.float64:
            finite = bool(torch.isfinite(tensor).all())
        else:
            finite = bool(torch.isfinite(tensor.sum(dtype=torch.float64)))
        if not finite:
            raise errors.IncompatibleAdapter(
                f"adapter {name!r}: tensor {key!r} {why}; such weights would ruin every image "
                "that uses the adapter. Re-export it from a healthy checkpoint",
                param="lora_path",
            )


def _layer_shapes(
    pipe: Any, components: Sequence[str]
) -> dict[str, dict[str, validation.LayerShape]]:
    shapes: dict[str, dict[str, validation.LayerShape]] = {}
    for component in components:
        table: dict[str, validation.LayerShape] = {}
        for name, module in getattr(pipe, component).named_modules():
            if isinstance(module, torch.nn.Linear):
                table[name] = validation.LayerShape(module.in_features, module.out_features)
            elif isinstance(module, torch.nn.Conv2d):
                table[name] = validation.LayerShape(
                    module.in_channels, module.out_channels, tuple(module.kernel_size)
                )
        shapes[component] = table
    return shapes
