"""A composed adapter on the volume: staged adapters at their scales, published as one revision.

A LoRAAdapter with `spec.compose` is staged as a revision directory that holds `stack.json` (each
member's name, the sha256 of the revision it was composed from, its scale, and the block groups
its scale varies by, if any) and each member's
weights under `members/` (hard links to the stored objects). So a composed revision is
self-contained and immutable like any other: collecting a member's old revision never takes the
weights from under it, and a member's new revision makes a new manifest, so a new revision of the
composition. The revision's name is the manifest's SHA-256.

The operator writes the manifest (`manifest_bytes`), the inference server reads it
(`parse_manifest`) and builds one adapter from the members; both sides use this module, so the
format has one definition. Pure apart from `is_stack`, which looks at one directory.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeGuard

from lora_volume import errors, layout

STACK_FILE = "stack.json"
MEMBERS_DIR = "members"
# One member is a composition too: an adapter at another scale, or with block weights.
MIN_MEMBERS, MAX_MEMBERS = 1, 4
SCALE_RANGE = (-10.0, 10.0)

# The block groups a member's scale may vary by ("LoRA block weights"; what each group covers is
# `lora_inference.stackkeys`'): requests and compositions name the same groups.
BLOCK_GROUPS = ("text_encoder", "down", "mid", "up", "double", "single")
# (group, multiplier) pairs in BLOCK_GROUPS order; empty: the member's scale on every layer.
Blocks = tuple[tuple[str, float], ...]
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class StackEntry:
    """One member: the adapter, the revision composed from, and its scale in the stack."""

    name: str
    sha256: str
    scale: float
    blocks: Blocks = ()

    @property
    def file(self) -> PurePosixPath:
        """Where the member's weights lie inside the composed revision directory."""
        return PurePosixPath(MEMBERS_DIR) / f"{self.name}.safetensors"


def manifest_bytes(entries: Sequence[StackEntry]) -> bytes:
    """The manifest of a composition, canonical (members in name order, fixed layout), so equal
    compositions have equal bytes and so one revision."""
    members = [_member_json(e) for e in sorted(entries, key=lambda e: e.name)]
    return (json.dumps({"members": members}, sort_keys=True, indent=1) + "\n").encode()


def _member_json(entry: StackEntry) -> dict[str, object]:
    member: dict[str, object] = {"name": entry.name, "sha256": entry.sha256, "scale": entry.scale}
    if entry.blocks:  # absent when none, so a manifest without blocks keeps its bytes
        member["blocks"] = dict(entry.blocks)
    return member


def ordered_blocks(given: dict[str, float]) -> Blocks:
    """`given` ({group: multiplier}, groups already checked) in BLOCK_GROUPS order."""
    return tuple((group, float(given[group])) for group in BLOCK_GROUPS if group in given)


def in_scale_range(value: object) -> TypeGuard[int | float]:
    """Whether `value` is a number a scale or block multiplier may be (finite, within
    SCALE_RANGE)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and SCALE_RANGE[0] <= value <= SCALE_RANGE[1]
    )


def parse_manifest(data: bytes, *, where: str) -> tuple[StackEntry, ...]:
    """Read a manifest; InvalidAdapter saying what is wrong with it (`where`: the file)."""

    def invalid(what: str) -> errors.InvalidAdapter:
        return errors.InvalidAdapter(f"{where} is not a valid composition: {what}")

    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"not JSON ({e})") from e
    members = raw.get("members") if isinstance(raw, dict) else None
    if not isinstance(members, list) or not MIN_MEMBERS <= len(members) <= MAX_MEMBERS:
        raise invalid(f"'members' must list {MIN_MEMBERS} to {MAX_MEMBERS} adapters")
    entries = []
    for i, member in enumerate(members):
        if not isinstance(member, dict):
            raise invalid(f"member {i} is not an object")
        name, sha, scale = member.get("name"), member.get("sha256"), member.get("scale")
        try:
            layout.check_adapter_name(name, param=f"members[{i}].name")
        except errors.InvalidName as e:
            raise invalid(e.message) from e
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise invalid(f"member {name!r} has no sha256")
        if not in_scale_range(scale):
            raise invalid(f"member {name!r} has no scale between -10 and 10")
        blocks = member.get("blocks", {})
        if (
            not isinstance(blocks, dict)
            or not set(blocks) <= set(BLOCK_GROUPS)
            or not all(in_scale_range(v) for v in blocks.values())
        ):
            raise invalid(
                f"member {name!r} has blocks that are not {{group: multiplier}} with groups "
                f"among {', '.join(BLOCK_GROUPS)} and multipliers between -10 and 10"
            )
        entries.append(
            StackEntry(
                name=str(name), sha256=sha, scale=float(scale), blocks=ordered_blocks(blocks)
            )
        )
    if len({e.name for e in entries}) < len(entries):
        raise invalid("a member is named twice")
    return tuple(entries)


def is_stack(path: Path) -> bool:
    """Whether `path` is a composed revision directory."""
    return (path / STACK_FILE).is_file()
