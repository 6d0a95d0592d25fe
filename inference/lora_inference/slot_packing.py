"""An adapter packed for the slots, on the CPU: its layers written into the first r planes of a
slot's row (`slot_layout.SlotLayout`), each plane cut to the prefix its layers lie in.

The reader packs a first use here, on its thread, while batches run (`pack` touches no slot
buffer); the CPU tier keeps what it returns, and `slots.Slots.place` copies that into a slot.
Imports torch, never diffusers or peft.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from lora_inference.backend import LayerKey
from lora_inference.slot_layout import SlotLayout


@dataclass(frozen=True)
class LayerWeights:
    """One layer of an adapter: its two matrices and the setup peft would give them."""

    down: torch.Tensor  # lora_A weight: (rank, fan_in) or, for a Conv2d, (rank, in, kh, kw)
    up: torch.Tensor  # lora_B weight: (fan_out, rank) or (fan_out, rank, 1, 1)
    alpha: float
    rslora: bool
    # lora_B's bias (fan_out,), when the adapter trained one (peft's lora_bias): scaled like B.
    bias: torch.Tensor | None = None
    # DoRA's magnitude per output row (peft's lora_magnitude_vector), when it is one.
    magnitude: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scaling(self) -> float:
        """alpha / r (alpha / sqrt(r) with rsLoRA): peft's factor on the branch at scale 1."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def pack(
    layout: SlotLayout,
    layers: Mapping[LayerKey, LayerWeights],
    *,
    dtype: torch.dtype,
    pinned: bool,
    check: Callable[[LayerKey, LayerWeights], None],
) -> torch.Tensor:
    """`layers` as the first r planes of a slot row of `layout`, each cut to the prefix their
    rooms lie in: (r, extent) on the CPU in `dtype` (r: their largest rank), pinned when the
    slots are on a GPU. `check` refuses a layer's bias or magnitude that does not fit it.

    Raises ValueError for a layer the layout lacks, a rank above its maximum, or matrices whose
    shapes do not fit the layer; the caller refuses such an adapter.
    """
    r_max = layout.max_rank
    rank = max((w.rank for w in layers.values()), default=0)
    if rank > r_max:
        raise ValueError(f"rank {rank} is above the slots' --max-lora-rank {r_max}")
    pairs = []
    for key, weights in layers.items():
        room = layout.rooms.get(key)
        if room is None:
            raise ValueError(f"{key[0]}.{key[1]} is not a Linear or Conv2d of this model")
        down = weights.down.reshape(weights.rank, -1)
        up = weights.up.reshape(weights.up.shape[0], -1)
        if tuple(down.shape) != (weights.rank, room.fan_in) or tuple(up.shape) != (
            room.fan_out,
            weights.rank,
        ):
            raise ValueError(
                f"{key[0]}.{key[1]}: A {tuple(weights.down.shape)} and B "
                f"{tuple(weights.up.shape)} do not fit a layer of {room.fan_in} in and "
                f"{room.fan_out} out"
            )
        check(key, weights)
        pairs.append((room, down, up, weights.scaling))
    extent = layout.extent(layers)
    planes = _zeroed(rank * extent, dtype=dtype, pinned=pinned).view(rank, extent)
    for room, down, up, scaling in pairs:
        r = down.shape[0]
        # Straight into the planes in the slots' dtype: B x scaling in one rounding, as peft
        # scales its branch in the model's dtype.
        planes[:r, room.a_offset : room.a_offset + room.fan_in].copy_(down)
        torch.mul(up.T, scaling, out=planes[:r, room.b_offset : room.b_offset + room.fan_out])
    return planes


def unpack(
    layout: SlotLayout, packed: torch.Tensor, ranks: Mapping[LayerKey, int]
) -> dict[LayerKey, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of `ranks`, (A, B x scaling) as `pack` laid them out: for tests."""
    out = {}
    for key, rank in ranks.items():
        room = layout.rooms[key]
        a = packed[:rank, room.a_offset : room.a_offset + room.fan_in]
        b = packed[:rank, room.b_offset : room.b_offset + room.fan_out].T
        out[key] = (a, b)
    return out


def _zeroed(elements: int, *, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """Zeros for `elements` in `dtype` on the CPU, written into by `pack`.

    Pinned for a GPU (the copy into a slot reads them asynchronously). Elsewhere from numpy,
    whose large blocks are the kernel's untouched zero pages, in huge pages where it may: the
    parts of a row an adapter leaves at zero cost no write, and the rest a fault per 2 MiB
    instead of one per 4 KiB (torch.zeros writes every byte of fresh pages).
    """
    if pinned:
        return torch.zeros(elements, dtype=dtype, pin_memory=True)
    if elements == 0:  # a merged-only adapter of whole matrices alone
        return torch.zeros(0, dtype=dtype)
    raw = np.zeros(elements * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype)
