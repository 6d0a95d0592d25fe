"""The layout of one slot's row in the slot buffers (pure): where each layer's A row, B column
and bias live. `slots.Slots` allocates buffers of this layout and reads them through it.

Inside a plane, the layers adapters target most come first, so an adapter's planes need only a
prefix of each plane (`SlotLayout.extent`): attention projections (what diffusers' and peft's
training scripts target), then the other Linear and 1x1 Conv2d layers (kohya's LoRA adds the
feed-forward layers, the projections and the text encoders' MLPs), then the other Conv2d layers
(LoCon and LyCORIS). An attention-only adapter of SD 1.5 packs into a fifth of each plane, of
SDXL into half of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lora_inference.backend import LayerKey

# The last part of an attention projection's name in diffusers' models and transformers' CLIP
# (besides `to_out.0`).
_ATTENTION = frozenset(
    {
        "to_q",
        "to_k",
        "to_v",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "q_proj",
        "k_proj",
        "v_proj",
        "out_proj",
    }
)


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

    def extent(self, keys: Iterable[LayerKey]) -> int:
        """The prefix of a plane that holds the rooms of `keys` (layers of this layout)."""
        return max((self.rooms[k].b_offset + self.rooms[k].fan_out for k in keys), default=0)

    @classmethod
    def plan(
        cls, shapes: Mapping[LayerKey, tuple[int, int, tuple[int, int] | None]], max_rank: int
    ) -> SlotLayout:
        """`shapes`: per layer (in_features, out_features, kernel or None), in the model's
        order, which each group of layers keeps."""
        rooms: dict[LayerKey, LayerRoom] = {}
        offset = bias = 0
        ordered = sorted(shapes, key=lambda key: _group(key[1], shapes[key][2]))  # stable
        for key in ordered:
            fan_in_channels, fan_out, kernel = shapes[key]
            fan_in = fan_in_channels * (kernel[0] * kernel[1] if kernel else 1)
            rooms[key] = LayerRoom(offset, offset + fan_in, bias, fan_in, fan_out, kernel)
            offset += fan_in + fan_out
            bias += fan_out
        return cls(max_rank=max_rank, rooms=rooms, plane_elements=offset, bias_elements=bias)


def _group(module: str, kernel: tuple[int, int] | None) -> int:
    """Where a layer's room goes in a plane: 0 attention projections, 1 other Linear and 1x1
    Conv2d layers, 2 the other Conv2d layers."""
    if module.rsplit(".", 1)[-1] in _ATTENTION or f".{module}".endswith(".to_out.0"):
        return 0
    return 1 if kernel in (None, (1, 1)) else 2
