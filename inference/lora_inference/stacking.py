"""Stacking: several adapters at their own scales, built into one adapter that equals their sum.

A LoRA layer adds `scaling x B @ A` to its base layer's output. The sum of several such deltas is
itself one: stack the members' A matrices along the rank (rows of A, the "down" weight) and their
B matrices beside each other (columns of B, the "up" weight), each B multiplied by its member's
scale and scaling, and give the result a scaling of 1 (alpha equal to the summed rank). So a stack
is exact, is built once on the CPU from the members' parsed weights, and then is cached, copied
into a slot, batched and evicted like any other adapter. Its rank is the sum of its members'
ranks in each layer.

The members are taken in name order, so the order a request lists them in changes nothing, down
to the last bit. A member at scale 0 adds nothing and is left out.

Imports torch (the members' tensors), never diffusers or peft.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from lora_volume.stacks import Blocks

from lora_inference import errors
from lora_inference.backend import LayerKey
from lora_inference.slot_packing import LayerWeights
from lora_inference.stackkeys import multiplier

# At most this many conflicting layers are named in an error; the rest are counted.
_NAMED_CONFLICTS = 3


@dataclass(frozen=True)
class Member:
    """One adapter of a stack: its name, the scale it is applied at, and its parsed layers."""

    name: str
    sha256: str
    scale: float
    layers: Mapping[LayerKey, LayerWeights]
    # Per block group multipliers of `scale` (stackkeys); empty: `scale` on every layer.
    blocks: Blocks = ()


def compose(members: Sequence[Member], *, param: str = "lora") -> dict[LayerKey, LayerWeights]:
    """The layers of one adapter equal to the sum of `members`, each at its scale.

    Raises IncompatibleAdapter naming the members and layers when two members target one layer
    with matrices that cannot be stacked (a different kernel or width: not the same layer of the
    same base model).
    """
    ordered = sorted((m for m in members if m.scale != 0.0), key=lambda m: m.name)
    by_layer: dict[LayerKey, list[tuple[Member, LayerWeights]]] = {}
    for member in ordered:
        for key, weights in member.layers.items():
            by_layer.setdefault(key, []).append((member, weights))
    conflicts = [(key, parts) for key, parts in sorted(by_layer.items()) if not _stackable(parts)]
    if conflicts:
        raise _conflict(conflicts, param)
    return {key: _sum(key, parts) for key, parts in sorted(by_layer.items())}


def _stackable(parts: list[tuple[Member, LayerWeights]]) -> bool:
    """Whether the layers' matrices agree in every dimension but the rank."""
    first = parts[0][1]
    return all(
        w.down.shape[1:] == first.down.shape[1:]
        and w.up.shape[:1] + w.up.shape[2:] == first.up.shape[:1] + first.up.shape[2:]
        for _, w in parts[1:]
    )


def _sum(key: LayerKey, parts: list[tuple[Member, LayerWeights]]) -> LayerWeights:
    if any(w.magnitude is not None for _, w in parts):
        names = ", ".join(m.name for m, w in parts if w.magnitude is not None)
        raise errors.IncompatibleAdapter(
            f"{names}: a DoRA adapter cannot be stacked (its rescale of the weights is not a sum "
            "of deltas); use it alone",
            param="lora",
        )
    dtype = parts[0][1].up.dtype
    down = torch.cat([w.down.to(dtype) for _, w in parts], dim=0)
    # The product runs in float32 and is rounded once, to the members' dtype.
    # Each member's B times its scale on this layer (its block group's, when it has blocks).
    scaled = [(w, m.scale * multiplier(m.blocks, *key) * w.scaling) for m, w in parts]
    up = torch.cat([(w.up.float() * s).to(dtype) for w, s in scaled], dim=1)
    biases = [w.bias.float() * s for w, s in scaled if w.bias is not None]
    bias = torch.stack(biases).sum(0).to(dtype) if biases else None
    return LayerWeights(down=down, up=up, alpha=float(down.shape[0]), rslora=False, bias=bias)


def _conflict(
    conflicts: list[tuple[LayerKey, list[tuple[Member, LayerWeights]]]], param: str
) -> Exception:
    names = sorted({m.name for _, parts in conflicts for m, _ in parts})
    shown = []
    for (component, module), parts in conflicts[:_NAMED_CONFLICTS]:
        shapes = ", ".join(f"{m.name} {tuple(w.down.shape)}x{tuple(w.up.shape)}" for m, w in parts)
        shown.append(f"{component}.{module} ({shapes})")
    more = len(conflicts) - len(shown)
    return errors.IncompatibleAdapter(
        f"adapters {', '.join(names)} cannot be stacked: they target "
        f"{'; '.join(shown)}{f' and {more} more layer(s)' if more else ''} with different "
        "shapes; stack adapters trained for the same base model",
        param=param,
    )
