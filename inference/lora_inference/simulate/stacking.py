"""Stacks in a simulated server: `lora_inference.stacking`'s names, without torch.

A stack of simulated adapters is as large as its members at a non-zero scale together, and its
rank is the sum of theirs (as a real stack's is on a layer every member targets). Its identity
and name are the real module's (`stack_sha256`, `stack_name`, the same text: a test compares
them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_inference.simulate.backend import SimulatedWeights, simulated_mb


@dataclass(frozen=True)
class Member:
    name: str
    sha256: str
    scale: float
    layers: Mapping[Any, Any]


def stack_sha256(members: Sequence[tuple[str, str, float]]) -> str:
    lines = [f"{name}\t{sha}\t{scale!r}\n" for name, sha, scale in sorted(members)]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def stack_name(members: Sequence[tuple[str, float]]) -> str:
    return "+".join(f"{name}*{scale:g}" for name, scale in sorted(members))


def compose(members: Sequence[Member], *, param: str = "lora") -> dict[Any, SimulatedWeights]:
    kept = [m for m in members if m.scale != 0.0]
    return {
        ("simulated", "stack"): SimulatedWeights(
            mb=sum(simulated_mb(m) for m in kept),
            rank=sum(max((w.rank for w in m.layers.values()), default=0) for m in kept),
        )
    }
