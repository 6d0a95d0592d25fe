"""`GET /v1/models`: the base model's card and one card per registered adapter, in vLLM's list
shape (`id`, `object`, `root`, `parent`) with fields of ours (pure).

The server renders it; the operator reads it to reconcile a pod (which adapters are the
operator's own, at which revision, scale and pin, and the pod's capacity: `max_loras`,
`max_cpu_loras`), the autoscaler counts each adapter's `hits`, the playground shows `format`,
`rank` and `trigger_words`. No card shows a path on the pod.

Versions (the list's `api_version`):
- 2: an adapter the operator published names its LoRAAdapter (`adapter`) and its revision
  (`revision`, the revision directory's sha256); `root` is the LoRAAdapter's name too. Any other
  adapter has `root` its own name, `adapter` and `revision` null.
- 1 (no `api_version`): the same without `adapter`: `root` and `revision` say it.
- Older servers' cards, and vLLM's: `root` is the path the adapter was loaded from, a published
  revision's `.../<adapter>/revisions/<sha256>` (`lora_volume.layout`), read back from it.
A newer version is read as far as its fields are known: a rolling upgrade has old and new pods,
and either may answer an operator of the other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lora_volume import layout

from lora_podapi import fields

VERSION = 2
OWNER = "lora-operator"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Card:
    """One model the pod serves: the base model (`parent` None) or an adapter of it."""

    id: str
    root: str
    parent: str | None = None  # the base model's id on an adapter's card
    created: int = 0
    owned_by: str = OWNER
    # A published revision's LoRAAdapter and sha256 (None: not one the operator published).
    adapter: str | None = None
    revision: str | None = None
    scale: float | None = None  # its default scale (None: not reported, as vLLM)
    pinned: bool | None = None
    sha256: str | None = None  # of its weights
    hits: int | None = None  # generations served with it
    format: str | None = None
    rank: int | None = None
    trigger_words: tuple[str, ...] = ()
    simulated: str | None = None  # on a simulated server's base card: its profile


@dataclass(frozen=True)
class ModelList:
    cards: tuple[Card, ...]
    # The pod's adapter capacity, where the server advertises it: GPU slots, CPU-tier size.
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    version: int = VERSION

    @property
    def base(self) -> str | None:
        """The base model's id: the first card without a parent."""
        return next((c.id for c in self.cards if c.parent is None), None)


def render(models: ModelList) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [render_card(c) for c in models.cards],
        "max_loras": models.max_loras,
        "max_cpu_loras": models.max_cpu_loras,
        "api_version": models.version,
    }


def render_card(card: Card) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": card.id,
        "object": "model",
        "created": card.created,
        "owned_by": card.owned_by,
        "root": card.root,
        "parent": card.parent,
    }
    if card.parent is None:
        if card.simulated is not None:
            out["simulated"] = card.simulated  # benchmarks and tests: no real model
        return out
    out.update(
        adapter=card.adapter,
        revision=card.revision,
        scale=card.scale,
        pinned=card.pinned,
        sha256=card.sha256,
        hits=card.hits,
        format=card.format,
        rank=card.rank,
        trigger_words=list(card.trigger_words),
    )
    return out


def parse(payload: Any) -> ModelList:
    """A `/v1/models` answer of any version; ValueError when it is not one."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), list):
        raise ValueError("GET /v1/models did not return {'data': [...]}")
    return ModelList(
        cards=tuple(parse_card(raw) for raw in payload["data"]),
        max_loras=fields.count(payload.get("max_loras")),
        max_cpu_loras=fields.count(payload.get("max_cpu_loras")),
        version=fields.version_of(payload),
    )


def parse_card(raw: Any) -> Card:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
        raise ValueError(f"GET /v1/models returned a card without an id: {raw!r}")
    parent, root = raw.get("parent"), raw.get("root")
    adapter, revision = _published(raw)
    return Card(
        id=raw["id"],
        root=root if isinstance(root, str) else raw["id"],
        parent=None if parent is None else str(parent),
        created=fields.count(raw.get("created")) or 0,
        owned_by=fields.text(raw.get("owned_by")) or OWNER,
        adapter=adapter,
        revision=revision,
        scale=fields.number(raw.get("scale")),
        pinned=fields.flag(raw.get("pinned")),
        sha256=fields.text(raw.get("sha256")),
        hits=fields.count(raw.get("hits")),
        format=fields.text(raw.get("format")),
        rank=fields.count(raw.get("rank")),
        trigger_words=fields.texts(raw.get("trigger_words")),
        simulated=fields.text(raw.get("simulated")),
    )


def _published(card: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The (LoRAAdapter, revision) a card says it was loaded from: `adapter` (version 2) or
    `root` (version 1) with a `revision`; without a valid `revision`, the revision directory's
    path in `root` (older servers, vLLM). (None, None) when it names no published revision."""
    revision = card.get("revision")
    named = card.get("adapter") if isinstance(card.get("adapter"), str) else card.get("root")
    if isinstance(revision, str) and _SHA256.fullmatch(revision):
        return (named, revision) if isinstance(named, str) else (None, None)
    root = card.get("root")
    found = layout.published_revision(root) if isinstance(root, str) else None
    return (found.adapter, found.sha256) if found is not None else (None, None)
