"""The diffusers pipeline and everything that touches it: the only module that imports diffusers.

Adapter state in a diffusers pipeline is global and not thread-safe, so a `DiffusionBackend` is
driven by exactly one thread (the engine's pipeline worker). Its methods are blocking. Three rules
from docs/architecture.md are enforced here:

- an adapter is checked against the model's layer shapes before `load_lora_weights` runs, and a
  load that fails anyway is rolled back on every component;
- before each batch the active adapter and its weight are set on every LoRA layer of every
  component and read back (peft leaves a previous text-encoder adapter active otherwise);
- scales are set with peft's `set_scale` per layer, never through `cross_attention_kwargs`, whose
  in-place multiply/divide is stateful.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from diffusers import DiffusionPipeline
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
)
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from PIL import Image

from lora_inference import errors
from lora_inference.adapters import files, validation

log = logging.getLogger(__name__)

_DENOISERS = ("unet", "transformer")
_BASE = "__base__"  # peft's name for "no adapter" in per-sample routing
# Sampling defaults per family, as the model cards recommend; requests may override them.
_SAMPLING_DEFAULTS = {
    "StableDiffusionPipeline": (30, 7.5),
    "StableDiffusionXLPipeline": (30, 5.0),
    "StableDiffusion3Pipeline": (28, 7.0),
    "FluxPipeline": (28, 3.5),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ParsedAdapter:
    """An adapter read from disk and checked: what the CPU tier caches."""

    tensors: dict[str, torch.Tensor]  # as in the file (diffusers converts them on each load)
    sha256: str
    size_bytes: int
    rank: int
    components: tuple[str, ...]  # the pipeline components it adapts
    # diffusers' own LoRA metadata (alpha, rank pattern) lives in the file header and is lost
    # when a state dict is passed in memory; such adapters are loaded from their file instead.
    needs_file: bool
    weights_file: Path
    # The same tensors under peft's names, by component: what an in-place swap copies.
    peft_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # Per layer (component, module) -> (rank, alpha, scaling, rslora) as peft set them up on the
    # adapter's first fresh load; an in-place swap restores them. Empty until that load.
    profile: dict[tuple[str, str], tuple[int, float, float, bool]] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageJob:
    """One request's share of a batch."""

    prompt: str
    negative_prompt: str | None
    seeds: tuple[int, ...]


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class DiffusionBackend:
    """A loaded pipeline plus the shape table its adapters are checked against."""

    def __init__(self, pipe: Any, *, device: str, dtype: torch.dtype) -> None:
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
        self._base_fingerprint = self._fingerprint()
        self._resident: dict[str, ParsedAdapter] = {}  # pipeline adapter name -> what it holds
        self._call_params = set(inspect.signature(pipe.__call__).parameters)
        vae_scale = int(getattr(pipe, "vae_scale_factor", 8))
        denoiser = self._denoiser()
        sample = getattr(denoiser.config, "sample_size", 64)
        sample = sample[0] if isinstance(sample, list | tuple) else sample
        # Flux and SD3 patchify latents; their sample_size is already in latent pixels.
        self.default_size = int(sample) * vae_scale
        self.default_steps, self.default_guidance = _SAMPLING_DEFAULTS.get(self.family, (30, 7.0))

    @classmethod
    def load(cls, model_dir: Path, *, device: str, dtype: torch.dtype) -> DiffusionBackend:
        pipe = DiffusionPipeline.from_pretrained(str(model_dir), dtype=dtype)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval()  # dropout would make generation nondeterministic
        if not hasattr(pipe, "load_lora_weights"):
            raise ValueError(f"{type(pipe).__name__} does not support LoRA adapters")
        return cls(pipe, device=device, dtype=dtype)

    # -- reading adapters (any thread: touches no pipeline state) ----------------------------

    def parse_adapter(self, path: Path, *, name: str, max_rank: int) -> ParsedAdapter:
        """Read, hash and check an adapter without touching the pipeline.

        Raises UnsupportedFormat (pickle), IncompatibleAdapter (corrupt file, not a LoRA, wrong
        shapes or rank for this model).
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
        files.check_lora_keys(list(tensors), name=name)
        # Weights take the model's dtype; scalars (alphas) keep theirs, as diffusers reads them.
        tensors = {
            k: v.to(self.dtype) if v.is_floating_point() and v.dim() > 0 else v
            for k, v in tensors.items()
        }
        peft_state = self._peft_state(tensors, name)
        shapes = {c: {k: tuple(v.shape) for k, v in part.items()} for c, part in peft_state.items()}
        summary = validation.check_adapter_fits(shapes, self.shapes, max_rank=max_rank, name=name)
        return ParsedAdapter(
            tensors=tensors,
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            rank=summary.rank,
            components=summary.components,
            needs_file="lora_adapter_metadata" in header.metadata,
            weights_file=weights,
            peft_state=peft_state,
        )

    def _peft_state(
        self, tensors: dict[str, torch.Tensor], name: str
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Convert keys the way diffusers will when loading, grouped by component."""
        try:
            converted = type(self.pipe).lora_state_dict(dict(tensors))
        except Exception as e:  # diffusers' converters raise ValueError, KeyError, ...
            raise errors.IncompatibleAdapter(
                f"adapter {name!r} is in a LoRA format {self.family} cannot read: {e}",
                param="lora_path",
            ) from e
        state = converted[0] if isinstance(converted, tuple) else converted
        by_component: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            component, _, rest = key.partition(".")
            if not rest:
                raise errors.IncompatibleAdapter(
                    f"adapter {name!r}: key {key!r} names no pipeline component", param="lora_path"
                )
            by_component.setdefault(component, {})[rest] = tensor
        state_by_component: dict[str, dict[str, torch.Tensor]] = {}
        for component, part in by_component.items():
            if component in _DENOISERS:
                if not any("lora_A" in k for k in part):
                    part = convert_unet_state_dict_to_peft(part)
            else:
                part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
            state_by_component[component] = part
        return state_by_component

    # -- mutating the pipeline (pipeline thread only) ------------------------------------------

    def add_adapter(self, key: str, adapter: ParsedAdapter) -> None:
        """Load `adapter` under `key`; on any failure leave the pipeline exactly as it was."""
        source: Any
        if adapter.needs_file:
            source = str(adapter.weights_file.parent)
            kwargs = {"weight_name": adapter.weights_file.name}
        else:
            source = self._device_copy(adapter)
            kwargs = {}
        try:
            with torch.no_grad():
                self.pipe.load_lora_weights(
                    source, adapter_name=key, low_cpu_mem_usage=True, **kwargs
                )
            self._check_landed(key, adapter)
            self._check_base_unchanged()
        except Exception as e:
            self.remove_adapter(key)
            if isinstance(e, errors.InferenceError):
                raise
            raise errors.IncompatibleAdapter(
                f"the pipeline refused the adapter: {e}", param="lora_path"
            ) from e
        self._resident[key] = adapter
        if not adapter.profile:
            adapter.profile.update(self._profile(key))

    def _profile(self, name: str) -> dict[tuple[str, str], tuple[int, float, float, bool]]:
        profile = {}
        for component in self.components:
            for module_name, module in getattr(self.pipe, component).named_modules():
                if isinstance(module, LoraLayer) and name in module.lora_A:
                    profile[(component, module_name)] = (
                        module.r[name],
                        module.lora_alpha[name],
                        module.scaling[name],
                        bool(module.use_rslora.get(name, False)),
                    )
        return profile

    def fits(self, name: str, adapter: ParsedAdapter) -> bool:
        """Whether `adapter` targets exactly the layers resident adapter `name` holds."""
        current = self._resident.get(name)
        return (
            current is not None
            and bool(adapter.profile)
            and adapter.profile.keys() == current.profile.keys()
        )

    def replace(self, name: str, adapter: ParsedAdapter) -> bool:
        """Copy `adapter` into the layers of resident adapter `name`, in place; False if it can't.

        Copying weights into layers that exist is several times cheaper than creating layers,
        and the pipeline keeps the same layers. It applies when `adapter` has been loaded afresh
        once (its per-layer rank and alpha, as peft set them up, are then known) and targets
        exactly the layers `name` holds, with the same shapes. On False nothing changed.
        """
        if not self.fits(name, adapter):
            return False
        copies = []
        for (component, module_name), setup in adapter.profile.items():
            layer = getattr(self.pipe, component).get_submodule(module_name)
            part = adapter.peft_state.get(component, {})
            down = part.get(f"{module_name}.lora_A.weight")
            up = part.get(f"{module_name}.lora_B.weight")
            if down is None or up is None:
                return False
            if (
                down.shape != layer.lora_A[name].weight.shape
                or up.shape != layer.lora_B[name].weight.shape
            ):
                return False
            copies.append((layer, down, up, setup))
        with torch.no_grad():
            for layer, down, up, (rank, alpha, scaling, rslora) in copies:
                layer.lora_A[name].weight.copy_(down)
                layer.lora_B[name].weight.copy_(up)
                layer.r[name] = rank
                layer.lora_alpha[name] = alpha
                layer.scaling[name] = scaling
                layer.use_rslora[name] = rslora
        self._resident[name] = adapter
        return True

    def _device_copy(self, adapter: ParsedAdapter) -> dict[str, torch.Tensor]:
        """Fresh tensors for the pipeline: with low_cpu_mem_usage peft adopts the tensors it is
        given as parameters, and a later in-place swap writes into them, so the cached ones must
        never be handed over."""
        return {k: v.to(self.device, copy=True) for k, v in adapter.tensors.items()}

    def _check_base_unchanged(self) -> None:
        if self._fingerprint() != self._base_fingerprint:
            raise errors.IncompatibleAdapter(
                "loading it changed the shapes of the base model's layers (a LoRA wider than "
                "the layer it targets); it was removed",
                param="lora_path",
            )

    def _check_landed(self, key: str, adapter: ParsedAdapter) -> None:
        """The adapter reached exactly the components it targets.

        peft may inject zero-initialised layers for `key` into a component that already holds
        other adapters even when this adapter has no weights for it; those are removed, so an
        adapter's footprint is what its file says.
        """
        for component in self.components:
            model = getattr(self.pipe, component)
            layers = [
                m
                for m in model.modules()
                if isinstance(m, BaseTunerLayer) and key in getattr(m, "lora_A", {})
            ]
            if component in adapter.components and not layers:
                raise errors.IncompatibleAdapter(
                    f"the pipeline loaded no layers of the adapter into {component}",
                    param="lora_path",
                )
            if component not in adapter.components:
                for layer in layers:
                    layer.delete_adapter(key)
                peft_config = getattr(model, "peft_config", None)
                if layers and isinstance(peft_config, dict):
                    peft_config.pop(key, None)

    def remove_adapter(self, key: str) -> None:
        """Delete `key` from every component; a name a component lacks is fine."""
        self._resident.pop(key, None)
        for component in self.components:
            model = getattr(self.pipe, component)
            for module in model.modules():
                if (
                    isinstance(module, BaseTunerLayer)
                    and key in module._all_available_adapter_names()
                ):
                    module.delete_adapter(key)
            peft_config = getattr(model, "peft_config", None)
            if isinstance(peft_config, dict):
                peft_config.pop(key, None)

    def resident_keys(self) -> set[str]:
        keys: set[str] = set()
        for layer in self._lora_layers():
            keys.update(layer.lora_A.keys())
        return keys

    def activate(self, scales: Mapping[str, float]) -> None:
        """Make exactly the adapters in `scales` active, each at its scale, and check it.

        Every LoRA layer of every component is set: enabled with the batch's adapters it holds, or
        disabled when it holds none of them. An empty mapping means the base model.
        """
        for layer in self._lora_layers():
            present = [key for key in scales if key in layer.lora_A]
            if present:
                layer.enable_adapters(True)
                layer.set_adapter(present, inference_mode=True)
                for key in present:
                    layer.set_scale(key, scales[key])
            else:
                layer.enable_adapters(False)
        self._check_active(scales)

    def _check_active(self, scales: Mapping[str, float]) -> None:
        seen: set[str] = set()
        for layer in self._lora_layers():
            present = [key for key in scales if key in layer.lora_A]
            seen.update(present)
            if not present:
                ok = bool(layer.disable_adapters)
            else:
                ok = not layer.disable_adapters and list(layer.active_adapters) == present
                for key in present:
                    expected = scales[key] * layer.lora_alpha[key] / layer.r[key]
                    ok = ok and abs(layer.scaling[key] - expected) <= 1e-9 * max(1.0, abs(expected))
            if not ok:
                raise RuntimeError(f"LoRA layer state did not take: wanted {dict(scales)}")
        missing = set(scales) - seen
        if missing:
            raise RuntimeError(f"adapters {sorted(missing)} are not resident in the pipeline")

    def generate(
        self,
        jobs: Sequence[ImageJob],
        *,
        width: int,
        height: int,
        steps: int,
        guidance_scale: float,
        routing: Sequence[str | None] | None = None,
    ) -> list[Image.Image]:
        """Run one pipeline call for `jobs`.

        `routing` (one adapter key or None per job) sends each image through its own adapter
        within one batch, using peft's per-sample adapter routing; without it every image uses the
        active adapters.
        """
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
        per_image = None
        if routing is not None:
            per_image = [
                key or _BASE for job, key in zip(jobs, routing, strict=True) for _ in job.seeds
            ]
        with torch.inference_mode(), self._routed(per_image):
            result = self.pipe(**kwargs)
        return list(result.images)

    @contextlib.contextmanager
    def _routed(self, per_image: list[str] | None) -> Iterator[None]:
        """Pass `adapter_names` to every LoRA layer for the duration of one call.

        Classifier-free guidance runs the denoiser on [unconditional, conditional] halves, so a
        layer sees the batch repeated k times; the names are repeated to match.
        """
        if per_image is None:
            yield
            return
        images = len(per_image)

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x = args[0] if args else next(iter(kwargs.values()))
            rows = int(x.shape[0])
            if rows % images:
                raise RuntimeError(f"a LoRA layer saw {rows} rows for a batch of {images} images")
            kwargs["adapter_names"] = per_image * (rows // images)
            return args, kwargs

        handles = [
            layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in self._lora_layers()
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- introspection --------------------------------------------------------------------------

    def parameter_count(self) -> int:
        return sum(p.numel() for c in self.components for p in getattr(self.pipe, c).parameters())

    def _denoiser(self) -> Any:
        return getattr(self.pipe, self._denoiser_component)

    @property
    def _denoiser_component(self) -> str:
        for name in _DENOISERS:
            if getattr(self.pipe, name, None) is not None:
                return name
        raise ValueError(f"{self.family} has neither a unet nor a transformer")

    def _lora_layers(self) -> list[Any]:
        return [
            module
            for c in self.components
            for module in getattr(self.pipe, c).modules()
            if isinstance(module, BaseTunerLayer) and hasattr(module, "lora_A")
        ]

    def _fingerprint(self) -> str:
        """Names and shapes of the base (non-LoRA) parameters: catches base-widening loads."""
        digest = hashlib.sha256()
        for c in self.components:
            for name, p in getattr(self.pipe, c).named_parameters():
                if "lora_" in name:
                    continue
                digest.update(f"{c}.{name.replace('.base_layer', '')}:{tuple(p.shape)};".encode())
        return digest.hexdigest()


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
