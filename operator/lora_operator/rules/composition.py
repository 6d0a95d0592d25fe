"""Compositions (`spec.compose`): what a composed adapter is built from (pure).

A composed LoRAAdapter names 1 to 4 other LoRAAdapters of its namespace, each at a scale and
optionally with block weights. It is staged as a revision holding a manifest of the members'
staged revisions and their weights (`lora_volume.stacks`), so its revision changes exactly when
a member's revision, a scale or a block weight does. `plan_composition` decides, from the
composition's spec and what the controller knows of each member, which revisions it is built
from, or raises the staging error saying which member stops it. `composed_revision` names the
revision that staging would publish.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from lora_volume import description, formats, stacks

from lora_operator.rules import errors
from lora_operator.rules.model import AdapterInfo, StagedRef


@dataclass(frozen=True)
class MemberState:
    """What the controller knows of one member: its spec, the revision it staged and what that
    revision's file declares (None: not known yet)."""

    info: AdapterInfo
    staged: StagedRef | None
    adapter: description.Description | None = None


def plan_composition(
    info: AdapterInfo, members: Mapping[str, MemberState]
) -> tuple[stacks.StackEntry, ...]:
    """The members' revisions and scales `info` is built from; `members`: by name, the
    LoRAAdapters of its namespace that exist (absent: no such object)."""
    names = [m.name for m in info.compose]
    missing = [n for n in names if n not in members or members[n].info.deleting]
    if missing:
        raise errors.MemberMissing(
            f"spec.compose names {_list(missing)}, which {_is(missing)} no LoRAAdapter of "
            f"namespace {info.namespace} (or {_is(missing)} being deleted); create "
            f"{_it(missing)} or remove {_it(missing)} from spec.compose"
        )
    nested = [n for n in names if n == info.name or members[n].info.compose]
    if nested:
        raise errors.MemberInvalid(
            f"spec.compose names {_list(nested)}, which {_is(nested)} a composition; compose "
            "adapters that have a source of their own"
        )
    other_base = [n for n in names if members[n].info.base_model != info.base_model]
    if other_base:
        found = ", ".join(f"{n!r} is for {members[n].info.base_model!r}" for n in other_base)
        raise errors.MemberInvalid(
            f"spec.compose mixes base models: {found}, this adapter for {info.base_model!r}; "
            "compose adapters of one base model"
        )
    unstackable = [
        (n, adapter.format)
        for n in names
        if (adapter := members[n].adapter) is not None and not formats.stackable(adapter.format.key)
    ]
    if unstackable:
        found = ", ".join(f"{n!r} is a {f.label} file" for n, f in unstackable)
        raise errors.MemberInvalid(
            f"spec.compose names adapters that cannot be stacked: {found}; a stack is a sum of "
            "low-rank deltas, which merged-only formats and DoRA are not: serve them alone"
        )
    entries, unstaged = [], []
    for member in info.compose:
        staged = members[member.name].staged
        if staged is None:
            unstaged.append(member.name)
        else:
            entries.append(
                stacks.StackEntry(
                    name=member.name,
                    sha256=staged.sha256,
                    scale=member.scale,
                    blocks=member.blocks,
                )
            )
    if unstaged:
        raise errors.MemberNotStaged(f"waiting for {_list(unstaged)} to be staged")
    return tuple(entries)


def composed_revision(entries: tuple[stacks.StackEntry, ...]) -> str:
    """The revision (the manifest's SHA-256) a composition of `entries` is published as."""
    return hashlib.sha256(stacks.manifest_bytes(entries)).hexdigest()


def _list(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _is(names: list[str]) -> str:
    return "is" if len(names) == 1 else "are"


def _it(names: list[str]) -> str:
    return "it" if len(names) == 1 else "them"
