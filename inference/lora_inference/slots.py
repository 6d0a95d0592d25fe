"""The LoRA layers of one pipeline, driven directly: adapters live in slots and move by copying.

A slot is a peft adapter name that the engine owns for the life of the server. Putting an adapter
into a slot copies its A and B matrices into the slot's modules in each layer it targets (a layer's
small modules are allocated anew only where the rank changes) and sets that layer's alpha, so no
adapter goes through diffusers' `load_lora_weights` while the server runs. The per-layer setup
(rank, alpha, rsLoRA) comes with the weights (`LayerWeights`); the pipeline works it out when it
parses the file, with diffusers' and peft's own configuration code.

A base Linear or Conv2d is wrapped in peft's LoRA layer the first time any adapter targets it. While
no adapter is active on it, the wrapper calls the base layer alone, so its output is bit-identical.

Per batch, `activate` touches only the layers of the batch's slots and those the previous batch
left enabled: its cost does not grow with the number of resident adapters. peft's own
`set_adapter` and `enable_adapters` walk every adapter of a layer (to set `requires_grad`), which
is what made switching grow with residency, so layers are switched through `_switch` instead.

Runs on the pipeline thread only; nothing here is thread-safe. Imports peft, never diffusers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import LoraLayer, dispatch_default

LayerKey = tuple[str, str]  # (pipeline component, module path inside it)
# A peft LoRA layer (lora.Linear, lora.Conv2d, ...): an nn.Module mixing in LoraLayer, which peft
# does not express as one type.
PeftLayer = Any


@dataclass(frozen=True)
class LayerWeights:
    """One layer of an adapter: its two matrices and the setup peft would give them."""

    down: torch.Tensor  # lora_A weight
    up: torch.Tensor  # lora_B weight
    alpha: float
    rslora: bool

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scaling(self) -> float:
        """alpha / r (alpha / sqrt(r) with rsLoRA): peft's factor on the branch at scale 1."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class Group:
    """Images start..stop of a routed call (contiguous after sorting) use `slot`."""

    slot: str
    start: int
    stop: int


class Slots:
    """The LoRA layers of the components of one pipeline."""

    def __init__(self, components: Mapping[str, torch.nn.Module]) -> None:
        self._components = dict(components)
        self._layers: dict[LayerKey, PeftLayer] = {}  # every wrapped layer
        self._held: dict[str, dict[LayerKey, LayerWeights]] = {}  # slot -> what it holds
        self._enabled: dict[LayerKey, list[str]] = {}  # layers peft runs a LoRA branch on
        self._pristine: dict[LayerKey, torch.Tensor] = {}  # base weights, for restoring merges

    # -- placing -------------------------------------------------------------------------------

    def place(self, slot: str, layers: Mapping[LayerKey, LayerWeights]) -> None:
        """Copy an adapter into `slot`, replacing whatever it held.

        On any failure the slot is emptied everywhere (the engine then treats it as free); other
        slots and the base layers are untouched either way.
        """
        previous = self._held.pop(slot, {})
        # What the last activation set for this slot was set for its previous occupant.
        for key in previous:
            if slot in self._enabled.get(key, ()):
                del self._enabled[key]
                _switch(self._layers[key], None)
        try:
            with torch.no_grad():
                for key in previous.keys() - layers.keys():
                    self._drop(key, slot)
                for key, weights in layers.items():
                    self._put(key, slot, weights)
        except BaseException:
            self.clear(slot)
            raise
        self._held[slot] = dict(layers)

    def clear(self, slot: str) -> None:
        """Remove `slot` from every layer that has it."""
        self._held.pop(slot, None)
        for key, layer in self._layers.items():
            if slot in layer.lora_A:
                self._drop(key, slot)

    def held(self) -> set[str]:
        """Slots present in any layer, read from the layers themselves."""
        return {slot for layer in self._layers.values() for slot in layer.lora_A}

    def footprint(self, slot: str) -> Mapping[LayerKey, LayerWeights]:
        return self._held.get(slot, {})

    def _put(self, key: LayerKey, slot: str, weights: LayerWeights) -> None:
        layer = self._layers.get(key)
        if layer is None:
            layer = self._wrap(key, slot, weights)
        elif slot not in layer.lora_A:
            config = _config(weights)
            layer.update_layer(slot, weights.rank, lora_alpha=config.lora_alpha, config=config)
        elif layer.r[slot] != weights.rank:
            # Only the two matrices change shape: fresh storage for the copy below, without the
            # random initialisation new modules would get (a few hundred ms on a full-size UNet).
            _resize(layer.lora_A[slot], weights.down.shape)
            _resize(layer.lora_B[slot], weights.up.shape)
        layer.lora_A[slot].weight.copy_(weights.down)
        layer.lora_B[slot].weight.copy_(weights.up)
        layer.r[slot] = weights.rank
        layer.lora_alpha[slot] = weights.alpha
        layer.use_rslora[slot] = weights.rslora
        layer.scaling[slot] = weights.scaling
        # update_layer re-activates the layer's previous active list; keep this layer as the
        # last activation left it (a new slot is never active until activated).
        _switch(layer, self._enabled.get(key))

    def _wrap(self, key: LayerKey, slot: str, weights: LayerWeights) -> PeftLayer:
        component, path = key
        model = self._components[component]
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = getattr(parent, child)
        config = _config(weights)
        wrapped = dispatch_default(
            base, slot, config=config, r=weights.rank, lora_alpha=config.lora_alpha
        )
        if not isinstance(wrapped, LoraLayer):
            raise TypeError(
                f"peft has no LoRA layer for {component}.{path} ({type(base).__name__})"
            )
        setattr(parent, child, wrapped)
        self._layers[key] = wrapped
        return wrapped

    def _drop(self, key: LayerKey, slot: str) -> None:
        layer = self._layers[key]
        active = self._enabled.get(key)
        if active is not None and slot in active:
            # peft's delete_adapter would otherwise activate whichever adapter sorts first.
            del self._enabled[key]
            _switch(layer, None)
        layer.delete_adapter(slot)

    # -- per batch -----------------------------------------------------------------------------

    def activate(
        self,
        scales: Mapping[str, float],
        *,
        routed: bool = False,
        merged: Collection[LayerKey] = (),
    ) -> int:
        """Set every layer for a call with exactly the slots in `scales`; return layers touched.

        Plain: peft runs the branch of each slot on its layers. Routed: peft runs none (the
        `routed` hooks add each image's own branch). Layers in `merged` run their base layer
        alone: the merged weight already holds the delta. Touched: the batch's layers and those the
        previous call left enabled, which are switched off; nothing else changes.
        """
        wanted: dict[LayerKey, list[str]] = {}
        for slot, scale in scales.items():
            held = self._held.get(slot)
            if held is None:
                raise RuntimeError(f"slot {slot} holds no adapter")
            for key, weights in held.items():
                self._layers[key].scaling[slot] = scale * weights.scaling
                wanted.setdefault(key, []).append(slot)
        enabled = {} if routed else {k: v for k, v in wanted.items() if k not in merged}
        touched = wanted.keys() | self._enabled.keys()
        for key in touched:
            _switch(self._layers[key], enabled.get(key))
        self._enabled = enabled
        self._check(touched, scales)
        return len(touched)

    def _check(self, touched: Collection[LayerKey], scales: Mapping[str, float]) -> None:
        """Read back what `activate` set (a wrong layer would silently change someone's image)."""
        for key in touched:
            layer = self._layers[key]
            active = self._enabled.get(key)
            ok = layer.disable_adapters == (active is None)
            ok = ok and (active is None or list(layer.active_adapters) == active)
            for slot, scale in scales.items():
                weights = self._held[slot].get(key)
                if weights is not None:
                    expected = scale * weights.scaling
                    ok = ok and abs(layer.scaling[slot] - expected) <= 1e-9 * max(
                        1.0, abs(expected)
                    )
            if not ok:
                raise RuntimeError(
                    f"LoRA layer {key} did not take the state wanted: {dict(scales)}"
                )

    def routed_layers(self, groups: Sequence[Group]) -> dict[LayerKey, list[Group]]:
        """Per layer that some slot of `groups` targets, the groups whose slot targets it."""
        per_layer: dict[LayerKey, list[Group]] = {}
        for group in groups:
            for key in self._held[group.slot]:
                per_layer.setdefault(key, []).append(group)
        return per_layer

    @contextlib.contextmanager
    def routed(
        self, groups: Sequence[Group], images: int, *, fused: Collection[LayerKey] = ()
    ) -> Iterator[None]:
        """Add each image's own LoRA branch in every layer of the groups' slots, for one call.

        Images of one slot are contiguous (`groups`), so a layer takes each slot's rows as strided
        views rather than gathering them. A layer sees the batch repeated k times (classifier-free
        guidance runs [unconditional, conditional] halves), so rows are viewed as (k, images, ...).
        Layers in `fused` (Linear ones only) run every image's branch in one pass instead of one
        per slot (`costs.plan_fuse` says where that pays).
        """
        per_layer = self.routed_layers(groups)
        for key in fused:
            base = self._layers[key].get_base_layer()
            if not isinstance(base, torch.nn.Linear):
                raise ValueError(f"only Linear layers fuse; {key} is a {type(base).__name__}")
        handles = []
        for key, mine in per_layer.items():
            hook = _fused_hook(mine, images) if key in fused else _routing_hook(mine, images)
            handles.append(self._layers[key].register_forward_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def merged(self, slot: str, keys: Collection[LayerKey]) -> Iterator[None]:
        """Add `slot`'s delta (at the scale `activate` set) to the base weights of `keys`.

        Afterwards every merged weight is copied back from its pristine copy, never recovered by
        subtracting: in half precision W + d - d is not W, and repeated calls would drift. The
        copy of a layer's base weight is taken the first time it is merged.
        """
        merged: list[LayerKey] = []
        try:
            with torch.no_grad():
                for key in keys:
                    layer = self._layers[key]
                    weight = layer.get_base_layer().weight
                    if key not in self._pristine:
                        self._pristine[key] = weight.detach().clone()
                    merged.append(key)
                    weight.add_(layer.get_delta_weight(slot).to(weight.dtype))
            yield
        finally:
            with torch.no_grad():
                for key in merged:
                    self._layers[key].get_base_layer().weight.copy_(self._pristine[key])


def _switch(layer: PeftLayer, active: list[str] | None) -> None:
    """Enable `layer` with exactly `active`, or disable it (None): peft's two fields, set directly.

    The setters peft offers walk every adapter of the layer; the forward reads only these two.
    """
    layer._disable_adapters = active is None
    layer._active_adapter = list(active or [])


def _resize(module: torch.nn.Module, shape: torch.Size) -> None:
    """Give a LoRA Linear or Conv2d (A or B half) an uninitialised weight of `shape`."""
    weight = module.get_parameter("weight")
    module.weight = torch.nn.Parameter(
        torch.empty(shape, dtype=weight.dtype, device=weight.device), requires_grad=False
    )
    if isinstance(module, torch.nn.Linear):
        module.out_features, module.in_features = int(shape[0]), int(shape[1])
    elif isinstance(module, torch.nn.Conv2d):
        module.out_channels, module.in_channels = int(shape[0]), int(shape[1])


def _config(weights: LayerWeights) -> LoraConfig:
    """A config for allocating one layer's modules; the weights are copied in right after."""
    alpha: Any = weights.alpha  # peft annotates int; diffusers passes kohya's float alphas too
    return LoraConfig(
        r=weights.rank,
        lora_alpha=alpha,
        use_rslora=weights.rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
    )


def _repeats(x: torch.Tensor, images: int) -> int:
    """How many times a layer's input repeats the batch (classifier-free guidance: twice)."""
    rows = int(x.shape[0])
    if rows % images:
        raise RuntimeError(f"a LoRA layer saw {rows} rows for a batch of {images} images")
    return rows // images


def _routing_hook(groups: list[Group], images: int) -> Any:
    def hook(
        module: PeftLayer, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
    ) -> torch.Tensor:
        x = args[0] if args else next(iter(kwargs.values()))
        repeats = _repeats(x, images)
        inputs = x.reshape(repeats, images, *x.shape[1:])
        outputs = output.view(repeats, images, *output.shape[1:])
        for group in groups:
            sub = inputs[:, group.start : group.stop].flatten(0, 1)
            branch = module.lora_B[group.slot](module.lora_A[group.slot](sub))
            branch = branch * module.scaling[group.slot]
            outputs[:, group.start : group.stop] += branch.view(repeats, -1, *branch.shape[1:]).to(
                output.dtype
            )
        return output

    return hook


def _fused_hook(groups: list[Group], images: int) -> Any:
    """One pass for every image of a Linear layer: batched matrix products over the images.

    Each image gets its slot's A and B (B times the slot's scaling), padded with zeros to the
    largest rank of the groups; an image of the base model gets zeros. They are built on the
    layer's first pass of the call and kept for the others.
    """
    per_image: list[tuple[torch.Tensor, torch.Tensor]] = []

    def weights(module: PeftLayer) -> tuple[torch.Tensor, torch.Tensor]:
        rank = max(int(module.r[g.slot]) for g in groups)
        first = module.lora_A[groups[0].slot].weight
        out_features = module.lora_B[groups[0].slot].weight.shape[0]
        down = first.new_zeros(images, rank, first.shape[1])
        up = first.new_zeros(images, out_features, rank)
        for g in groups:
            a = module.lora_A[g.slot].weight
            b = module.lora_B[g.slot].weight * module.scaling[g.slot]
            down[g.start : g.stop, : a.shape[0]] = a
            up[g.start : g.stop, :, : b.shape[1]] = b
        return down.transpose(1, 2), up.transpose(1, 2)

    def hook(
        module: PeftLayer, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
    ) -> torch.Tensor:
        x = args[0] if args else next(iter(kwargs.values()))
        repeats = _repeats(x, images)
        if not per_image:
            per_image.append(weights(module))
        down, up = per_image[0]
        # (repeats, images, tokens, in) -> (images, repeats x tokens, in): one copy
        by_image = x.reshape(repeats, images, -1, x.shape[-1]).transpose(0, 1)
        branch = torch.bmm(torch.bmm(by_image.reshape(images, -1, x.shape[-1]), down), up)
        outputs = output.view(repeats, images, -1, output.shape[-1])
        outputs += (
            branch.view(images, repeats, -1, branch.shape[-1]).transpose(0, 1).to(output.dtype)
        )
        return output

    return hook
