"""What names a stack and what tells two apart, and the block groups a member's scale may vary
by ("LoRA block weights", as A1111 and ComfyUI users write them) (pure; no torch).

A request may scale an adapter per block group: `lora: {"name": "a", "scale": 0.8, "blocks":
{"down": 0.5, "up": 0}}` applies `a` at 0.8 x 0.5 on the UNet's down blocks, not at all on its up
blocks, and at 0.8 everywhere else. The groups follow the denoiser's own layout:

- `text_encoder`: every text encoder the adapter targets;
- `down`, `mid`, `up`: a UNet's `down_blocks`, `mid_block` and `up_blocks` (SD 1.5, SDXL), as
  diffusers' `set_adapters` names them;
- `double`, `single`: a transformer's two-stream blocks (Flux's `transformer_blocks`, SD 3.5's
  joint blocks) and Flux's `single_transformer_blocks`.

A layer in none of them (a UNet's conv_in or time embedding, a transformer's embedders) keeps
the adapter's scale. A composition may give its members blocks too (`lora_volume.stacks`). A
request with blocks is served as a stack of that adapter (stacking), so
it is exact and cached like any stack; its name and identity include the blocks.

The real stacking module and the simulated one both name stacks here, so their names and
identities cannot drift apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# Named once, for requests and compositions (`spec.compose[].blocks`) alike.
from lora_volume.stacks import Blocks

_PREFIXES = (
    ("down_blocks.", "down"),
    ("mid_block.", "mid"),
    ("up_blocks.", "up"),
    ("transformer_blocks.", "double"),
    ("single_transformer_blocks.", "single"),
)


def group_of(component: str, module: str) -> str | None:
    """The block group of a layer (a pipeline component and a module path in it), or None."""
    if component.startswith("text_encoder"):
        return "text_encoder"
    for prefix, group in _PREFIXES:
        if module.startswith(prefix):
            return group
    return None


def multiplier(blocks: Blocks, component: str, module: str) -> float:
    """What `blocks` multiplies the adapter's scale by on this layer (1 outside every group)."""
    group = group_of(component, module)
    return next((value for name, value in blocks if name == group), 1.0)


def blocks_text(blocks: Blocks) -> str:
    """`[down=0.5,up=0]`, or nothing for no blocks."""
    if not blocks:
        return ""
    return "[" + ",".join(f"{group}={value:g}" for group, value in blocks) + "]"


def stack_sha256(members: Sequence[tuple[str, str, float, Blocks]]) -> str:
    """A stack's identity: its members' (name, sha256, scale, blocks), in name order."""
    lines = [
        f"{name}\t{sha}\t{scale!r}" + (f"\t{blocks_text(blocks)}" if blocks else "") + "\n"
        for name, sha, scale, blocks in sorted(members)
    ]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def stack_name(members: Sequence[tuple[str, float, Blocks]]) -> str:
    """How logs and errors name a stack: `a*0.8+b*0.5[up=0]`, in name order."""
    return "+".join(
        f"{name}*{scale:g}{blocks_text(blocks)}" for name, scale, blocks in sorted(members)
    )
