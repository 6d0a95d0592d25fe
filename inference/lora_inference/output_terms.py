"""What an adapter adds on a layer's output axis besides its branch B A x: lora_B's bias, and
DoRA's magnitude rescale (peft's form), per slot, for `slots.Slots`.

- A bias (peft's lora_bias) is scaled like B and added per image at its scale, from one small row
  per slot (every layer's fan_out).
- DoRA rescales each output row of `W' = W + s c B A` to a trained magnitude m:
  `y = m / |W'|_row * (W x + s c B A x) + b`. The row norms depend on each image's scale s, but
  only through three vectors fixed when the adapter is placed: `|W'|^2 = |W|^2 + 2 s <W, cBA> +
  s^2 |cBA|^2` per row. So a call computes every image's gain `g = m / |W'|` from them, and the
  hook adds `(g - 1) (W x) + g (s c B A x)` to the base output, which is what peft's DoRA layer
  adds. Images without DoRA on a layer get g = 1 exactly: their output is what it was.

Layers with either term always run as a branch, never merged (the base layer may have no bias
to merge into; DoRA's gain is not a weight delta at a fixed scale). The DoRA vectors are kept in
float32 (float64 for a float64 model) whatever the model's dtype: row norms of squares overflow
half precision. Pipeline thread only, like `slots`; imports torch only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from lora_inference.backend import LayerKey


class Weights(Protocol):
    """The parts of `slot_packing.LayerWeights` used here."""

    @property
    def bias(self) -> torch.Tensor | None: ...
    @property
    def magnitude(self) -> torch.Tensor | None: ...
    @property
    def down(self) -> torch.Tensor: ...
    @property
    def up(self) -> torch.Tensor: ...
    @property
    def scaling(self) -> float: ...


class OutputTerms:
    """Per slot row, the biases and DoRA vectors of its adapter."""

    def __init__(
        self,
        rooms: Mapping[LayerKey, tuple[int, int]],
        modules: Mapping[LayerKey, Any],
        *,
        count: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """`rooms`: per layer, (offset in a bias row, fan_out)."""
        self._rooms = rooms
        self._modules = modules
        self._count = count
        self._device = device
        elements = sum(fan_out for _, fan_out in rooms.values())
        self._bias_rows = torch.zeros(count + 1, elements, device=device, dtype=dtype)
        self._wide = torch.float64 if dtype == torch.float64 else torch.float32
        # Per DoRA layer (allocated the first time a DoRA adapter targets it):
        # [slots+1, 4, fan_out] holding has, m, <W, cBA>, |cBA|^2, and |W|^2 per row.
        self._dora: dict[LayerKey, torch.Tensor] = {}
        self._norms: dict[LayerKey, torch.Tensor] = {}
        self._held: dict[int, frozenset[LayerKey]] = {}

    def check(self, key: LayerKey, weights: Weights) -> None:
        """ValueError if the layer's bias or magnitude do not fit it (any thread)."""
        fan_out = self._rooms[key][1]
        for what, vector in (("bias", weights.bias), ("magnitude", weights.magnitude)):
            if vector is not None and vector.numel() != fan_out:
                raise ValueError(
                    f"{key[0]}.{key[1]}: {what} {tuple(vector.shape)} does not fit a layer of "
                    f"{fan_out} out"
                )

    def place(self, index: int, layers: Mapping[LayerKey, Weights]) -> frozenset[LayerKey]:
        """Write row `index`'s terms from `layers`; return the layers that have any."""
        self.clear(index)
        held = []
        for key, weights in layers.items():
            if weights.bias is None and weights.magnitude is None:
                continue
            self.check(key, weights)
            offset, fan_out = self._rooms[key]
            if weights.bias is not None:
                scaled = weights.bias.to(torch.float64).reshape(-1) * weights.scaling
                self._bias_rows[index, offset : offset + fan_out].copy_(scaled)
            if weights.magnitude is not None:
                self._place_dora(index, key, weights)
            held.append(key)
        self._held[index] = frozenset(held)
        return self._held[index]

    def _place_dora(self, index: int, key: LayerKey, weights: Weights) -> None:
        fan_out = self._rooms[key][1]
        weight = self._modules[key].weight.detach().to(self._wide).reshape(fan_out, -1)
        if key not in self._dora:
            self._dora[key] = torch.zeros(
                self._count + 1, 4, fan_out, device=self._device, dtype=self._wide
            )
            self._norms[key] = weight.pow(2).sum(1)
        down = weights.down.to(self._device, self._wide).reshape(weights.down.shape[0], -1)
        up = weights.up.to(self._device, self._wide).reshape(fan_out, -1) * weights.scaling
        delta = up @ down
        magnitude = weights.magnitude
        if magnitude is None:
            raise ValueError(f"{key[0]}.{key[1]} has no DoRA magnitude")
        rows = self._dora[key][index]
        rows[0].fill_(1.0)
        rows[1].copy_(magnitude.reshape(-1))
        rows[2].copy_((weight * delta).sum(1))
        rows[3].copy_(delta.pow(2).sum(1))

    def clear(self, index: int) -> None:
        for key in self._held.pop(index, frozenset()):
            offset, fan_out = self._rooms[key]
            self._bias_rows[index, offset : offset + fan_out].zero_()
            if key in self._dora:
                self._dora[key][index].zero_()

    def bias_delta(self, index: int, key: LayerKey, scale: float) -> torch.Tensor:
        offset, fan_out = self._rooms[key]
        return self._bias_rows[index, offset : offset + fan_out] * scale

    def gain(self, index: int, key: LayerKey, scale: float) -> torch.Tensor:
        """DoRA's per-row gain m / |W + s c B A| of row `index` at `scale` (1 without DoRA)."""
        return self._gain(key, torch.tensor([index]), torch.tensor([float(scale)]))[0]

    def _gain(self, key: LayerKey, index: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        vectors = self._dora[key][index.to(self._device)]  # [rows, 4, fan_out]
        has, m, cross, square = vectors.unbind(1)
        s = scales.to(self._device, self._wide).view(-1, 1)
        norm = (self._norms[key] + 2 * s * cross + s * s * square).sqrt()
        # Rows without DoRA: exactly 1 (their norm may be anything, even 0).
        return torch.where(has > 0, m / torch.where(has > 0, norm, 1.0), 1.0)

    def apply(
        self,
        key: LayerKey,
        output: torch.Tensor,
        branch: torch.Tensor,
        index: torch.Tensor,
        scales: torch.Tensor,
        *,
        conv: bool,
    ) -> torch.Tensor:
        """The layer's output with `branch` and the terms of each row's slot added.

        `index` and `scales`: per row of `output` (one entry for a call of one slot).
        """
        rows = int(output.shape[0]) if index.numel() > 1 else 1

        def shaped(vector: torch.Tensor) -> torch.Tensor:
            if conv:
                return vector.view(rows, -1, 1, 1)
            return vector.view(rows, *(1 for _ in output.shape[1:-1]), -1)

        result = output
        if key in self._dora:
            gain = shaped(self._gain(key, index, scales)).to(output.dtype)
            bias = self._modules[key].bias
            base = output if bias is None else output - (bias.view(-1, 1, 1) if conv else bias)
            result = output + (gain - 1) * base + gain * branch
        else:
            result = output + branch
        offset, fan_out = self._rooms[key]
        biases = self._bias_rows[index.to(self._device), offset : offset + fan_out]
        if bool(biases.any()):
            result = result + shaped(biases * scales.to(biases).view(-1, 1)).to(output.dtype)
        return result
