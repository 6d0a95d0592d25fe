"""The diffusers pipeline and everything that touches it (with `formats`, which converts adapter
files with diffusers' converters, the only modules that import diffusers): the server's real
`backend.Backend`, which the CLI loads (`load_backend`) and passes to the app.

Adapter state in a diffusers pipeline is global and not thread-safe, so a `DiffusionBackend` is
driven by exactly one thread (the engine's pipeline worker), apart from `parse_adapter` and
`compose` (the reader's pool), which read files and build stacks and touch no pipeline state.
Its methods are blocking. Rules from
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
import inspect
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline
from PIL import Image

from lora_inference import calibration, costs, errors, formats, merging, parsing, stacking
from lora_inference.adapters import validation
from lora_inference.backend import BatchOutcome, ImageJob, LayerKey, ParsedAdapter, StackMember
from lora_inference.config import ServerConfig
from lora_inference.costs import MergePolicy
from lora_inference.slot_packing import LayerWeights
from lora_inference.slots import Slots

__all__ = ["Calibration", "DiffusionBackend", "default_device", "load_backend", "resolve_dtype"]

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


def load_backend(config: ServerConfig) -> DiffusionBackend:
    """The pipeline `config` serves, loaded (blocking: the app runs it on a thread)."""
    return DiffusionBackend.load(
        config.model,
        device=config.device,
        dtype=resolve_dtype(config.dtype, config.device),
        slots=config.max_loras,
        max_rank=config.max_lora_rank,
    )


class DiffusionBackend:
    """A loaded pipeline, its LoRA slots, and the layer table adapters are checked against (a
    `backend.Backend`)."""

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
        # Slot -> the whole-matrix layers of the merged-only adapter it names (`place`).
        self._full: dict[str, Mapping[LayerKey, merging.FullLayer]] = {}
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
        return parsing.parse_adapter(self, path, name=name, max_rank=max_rank)

    def compose(self, members: Sequence[StackMember], *, name: str, param: str) -> ParsedAdapter:
        """One adapter equal to `members` at their scales (`stacking.compose`), packed into a
        slot row (any thread: touches no pipeline state)."""
        layers = stacking.compose(
            [
                stacking.Member(
                    name=m.name,
                    sha256=m.parsed.sha256,
                    scale=m.scale,
                    layers=m.parsed.layers,
                    blocks=m.blocks,
                )
                for m in members
            ],
            param=param,
        )
        return ParsedAdapter.of_stack(
            members,
            layers,
            self.pack(layers, name=name),
            size_bytes=sum(w.down.nbytes + w.up.nbytes for w in layers.values()),  # in memory
            rank=max((w.rank for w in layers.values()), default=0),
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
        """Copy `adapter` into `slot` (see slots.Slots.place); a merged-only adapter's whole
        matrices stay on the CPU, named by the slot, for the calls that merge them."""
        self._full.pop(slot, None)
        self.slots.place(slot, adapter.layers, adapter.packed)
        if adapter.full:
            self._full[slot] = adapter.full

    def clear(self, slot: str) -> None:
        self._full.pop(slot, None)
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
        runs every image's branch in one gathered pass per layer (`slots.Slots.call`). A
        merged-only adapter is merged whole whatever `merge` says, and only in a batch of its
        own (the scheduler never plans another: a RuntimeError here is a bug).
        """
        kinds = set(slots)
        if len(kinds) > 1 and kinds & self._full.keys():
            raise RuntimeError("a merged-only adapter was batched with other images")
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
            full = self._full.get(slot, {})
            keys = self.merge_plan(slot, call, costs.policy_for(merge, merged_only=bool(full)))
            with (
                self.slots.call(per_image, scales, merged=keys),
                self.slots.base.merged_full(full, scales[slot]),
            ):
                images = generate(jobs)
            merged = len(keys) + len(full)
            return BatchOutcome(images, "merged" if merged else "adapter", merged)
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
