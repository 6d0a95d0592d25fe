"""The layout of one slot's row in the slot buffers (pure): where each layer's A row, B column
and bias live. `slots.Slots` allocates buffers of this layout and reads them through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lora_inference.backend import LayerKey


@dataclass(frozen=True)
class LayerRoom:
    """Where one layer's A row and B column live inside each rank plane of a slot's row."""

    a_offset: int
    b_offset: int
    bias_offset: int  # in a slot's bias row (`Slots` keeps biases beside the planes)
    fan_in: int  # in_features, or in_channels x kernel elements
    fan_out: int
    kernel: tuple[int, int] | None  # a Conv2d's kernel size; None for a Linear


@dataclass(frozen=True)
class SlotLayout:
    """The layout of one slot's row (pure): `max_rank` planes of `plane_elements`, each holding
    one rank's A row and B column of every layer."""

    max_rank: int
    rooms: Mapping[LayerKey, LayerRoom]
    plane_elements: int
    bias_elements: int  # one slot's bias row: every layer's fan_out

    @property
    def row_elements(self) -> int:
        return self.max_rank * self.plane_elements

    @classmethod
    def plan(
        cls, shapes: Mapping[LayerKey, tuple[int, int, tuple[int, int] | None]], max_rank: int
    ) -> SlotLayout:
        """`shapes`: per layer (in_features, out_features, kernel or None)."""
        rooms: dict[LayerKey, LayerRoom] = {}
        offset = bias = 0
        for key, (fan_in_channels, fan_out, kernel) in shapes.items():
            fan_in = fan_in_channels * (kernel[0] * kernel[1] if kernel else 1)
            rooms[key] = LayerRoom(offset, offset + fan_in, bias, fan_in, fan_out, kernel)
            offset += fan_in + fan_out
            bias += fan_out
        return cls(max_rank=max_rank, rooms=rooms, plane_elements=offset, bias_elements=bias)
