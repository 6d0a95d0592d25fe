"""Stacks in a simulated server: `lora_inference.stacking`'s names, without torch.

A stack of simulated adapters is as large as its members at a non-zero scale together, and its
rank is the sum of theirs (as a real stack's is on a layer every member targets). Its identity
and name come from `lora_inference.stackkeys`, as a real stack's do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_volume.stacks import Blocks

from lora_inference.simulate.backend import SimulatedWeights, simulated_mb


@dataclass(frozen=True)
class Member:
    name: str
    sha256: str
    scale: float
    layers: Mapping[Any, Any]
    blocks: Blocks = ()


def compose(members: Sequence[Member], *, param: str = "lora") -> dict[Any, SimulatedWeights]:
    kept = [m for m in members if m.scale != 0.0]
    return {
        ("simulated", "stack"): SimulatedWeights(
            mb=sum(simulated_mb(m) for m in kept),
            rank=sum(max((w.rank for w in m.layers.values()), default=0) for m in kept),
        )
    }
