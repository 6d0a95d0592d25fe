"""Merging into the base weights for one call, and restoring them exactly afterwards.

Two kinds of merge change a layer's base weight for a call: a slot's low-rank delta
(`slots.Slots.call(merged=...)`, where the cost model says it pays) and a merged-only adapter's
whole-matrix delta (`FullLayer`: LoKr with a full w2, `.diff` files, kohya / LyCORIS DoRA's
rescale; always merged, for a batch of that adapter alone). Both go through one `BaseWeights`,
which keeps one pristine copy of each base parameter, taken the first time it is merged, and
copies every changed parameter back from it when the call ends, never recovering it by
subtracting (in half precision `W + d - d` is not `W`, and repeated calls would drift).

Runs on the pipeline thread only (apart from `FullLayer` and `pinned`, which touch no model).
Imports torch only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lora_inference.backend import LayerKey

# Takes a layer's parameter ("weight" or "bias") for the call: (the live one, its pristine copy).
Take = Callable[[LayerKey, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FullLayer:
    """One layer of a merged-only adapter, on the CPU (pinned for a GPU): its delta at scale 1,
    shaped as the layer's weight, and its bias delta when the file has one.

    With a `magnitude` (kohya / LyCORIS DoRA), `delta` is the adapter's ΔW and the layer's
    weight at scale 1 is `W' = magnitude x (W + ΔW) / |W + ΔW|`, the norm taken per output row
    (`axis` 0) or per input channel (`axis` 1), against the base weight W when it is merged;
    `magnitude` is shaped to broadcast along that axis.
    """

    delta: torch.Tensor
    bias: torch.Tensor | None = None
    magnitude: torch.Tensor | None = None
    axis: int = 0

    def merged(self, base: torch.Tensor, scale: float) -> torch.Tensor:
        """The layer's weight for a call at `scale` from its base weight `base` (any dtype; the
        result is in `base`'s): `W + scale x delta`, or with DoRA `W + scale x (W' - W)`."""
        delta = self.delta.to(base.device, base.dtype, non_blocking=True)
        if self.magnitude is None:
            return base + scale * delta
        adapted = base + delta
        dims = tuple(d for d in range(adapted.dim()) if d != self.axis)
        norm: torch.Tensor = torch.linalg.vector_norm(adapted, dim=dims, keepdim=True)
        magnitude = self.magnitude.to(base.device, base.dtype, non_blocking=True)
        return base + scale * (magnitude * adapted / norm - base)


def pinned(layers: Mapping[LayerKey, FullLayer], *, pin: bool) -> dict[LayerKey, FullLayer]:
    """`layers` in page-locked host memory when `pin` (a GPU: copies to it run asynchronously)."""
    if not pin:
        return dict(layers)
    return {
        key: FullLayer(
            layer.delta.pin_memory(),
            None if layer.bias is None else layer.bias.pin_memory(),
            None if layer.magnitude is None else layer.magnitude.pin_memory(),
            layer.axis,
        )
        for key, layer in layers.items()
    }


class BaseWeights:
    """The base layers' parameters, their pristine copies, and merges into them for a call."""

    def __init__(self, modules: Mapping[LayerKey, Any]) -> None:
        self._modules = modules
        self._pristine: dict[tuple[LayerKey, str], torch.Tensor] = {}

    def module(self, key: LayerKey) -> Any:
        return self._modules[key]

    @contextlib.contextmanager
    def restoring(self) -> Iterator[Take]:
        """A block in which parameters may be changed in place; each one taken with the
        yielded function is copied back from its pristine copy when the block ends."""
        taken: list[tuple[LayerKey, str]] = []

        def take(key: LayerKey, name: str) -> tuple[torch.Tensor, torch.Tensor]:
            live: torch.Tensor = getattr(self._modules[key], name)
            pristine = self._pristine.get((key, name))
            if pristine is None:
                pristine = self._pristine[(key, name)] = live.detach().clone()
            taken.append((key, name))
            return live, pristine

        try:
            yield take
        finally:
            with torch.no_grad():
                for key, name in taken:
                    getattr(self._modules[key], name).copy_(self._pristine[(key, name)])

    @contextlib.contextmanager
    def merged_full(self, layers: Mapping[LayerKey, FullLayer], scale: float) -> Iterator[None]:
        """`layers` at `scale` merged into their base layers for the block (`FullLayer.merged`;
        biases `b + scale x delta`), computed from the pristine weights in float32 at least
        and rounded once to the model's dtype."""
        with self.restoring() as take:
            with torch.no_grad():
                for key, layer in layers.items():
                    live, pristine = take(key, "weight")
                    work = torch.promote_types(live.dtype, torch.float32)
                    live.copy_(layer.merged(pristine.to(work), scale))
                    if layer.bias is not None:
                        live, pristine = take(key, "bias")
                        bias = layer.bias.to(live.device, work, non_blocking=True)
                        live.copy_(pristine.to(work) + scale * bias)
            yield
