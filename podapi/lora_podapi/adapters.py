"""`GET /v1/adapters`: residency, capacity and queue, what an adapter-aware router routes by
(pure). Two forms, one version (`api_version`):

- the listing: one entry per registered adapter (its tier, `gpu`, `cpu` or `disk`, its usage,
  size, format, ...), for people and tools;
- the residency view (`?view=residency`, `object: residency`): only the adapters' names by tier,
  what the router polls every second (with an ETag: a 304 while nothing changed).

Both end with the served model, its capacity (`max_loras`, `max_cpu_loras`) and its queue
(`num_requests_waiting`, `num_requests_running`). Version 1, also read without `api_version`
(servers before the field); an older server that answers the listing to a residency poll is
read by its entries' tiers (`parse_residency` takes either form).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lora_podapi import fields

VERSION = 1
TIERS = ("gpu", "cpu", "disk")


@dataclass(frozen=True)
class Capacity:
    """The served model, the pod's adapter capacity and its queue as it answered."""

    model: str | None = None
    max_loras: int | None = None  # GPU slots
    max_cpu_loras: int | None = None
    waiting: int | None = None  # requests queued, not yet in a batch
    running: int | None = None  # requests in the batch being generated

    @property
    def queue(self) -> int | None:
        """Waiting plus running, when the pod says both."""
        return None if self.waiting is None or self.running is None else self.waiting + self.running


@dataclass(frozen=True)
class Residency:
    """Which adapters are in which tier: the residency view."""

    gpu: tuple[str, ...] = ()
    cpu: tuple[str, ...] = ()
    disk: tuple[str, ...] = ()
    capacity: Capacity = field(default_factory=Capacity)
    version: int = VERSION


@dataclass(frozen=True)
class Entry:
    """One registered adapter in the listing."""

    id: str
    path: str | None = None  # what it was loaded from, on the pod
    tier: str = "disk"  # gpu, cpu or disk
    pinned: bool | None = None
    origin: str | None = None  # static, api, resolver, request
    hits: int | None = None
    last_used: float | None = None  # unix time of its last generation
    size_bytes: int | None = None
    sha256: str | None = None
    rank: int | None = None
    format: str | None = None
    merged_only: bool | None = None  # served merged into the base weights, in batches of its own
    targets: tuple[str, ...] = ()
    trigger_words: tuple[str, ...] = ()


@dataclass(frozen=True)
class Listing:
    entries: tuple[Entry, ...]
    capacity: Capacity = field(default_factory=Capacity)
    version: int = VERSION

    def residency(self) -> Residency:
        """The same answer as the residency view says it: names by tier."""
        gpu, cpu, disk = (tuple(e.id for e in self.entries if e.tier == t) for t in TIERS)
        return Residency(gpu, cpu, disk, self.capacity, self.version)


def render_residency(residency: Residency) -> dict[str, Any]:
    return {
        "object": "residency",
        "gpu": list(residency.gpu),
        "cpu": list(residency.cpu),
        "disk": list(residency.disk),
        **_render_capacity(residency.capacity),
        "api_version": residency.version,
    }


def render_listing(listing: Listing) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [_render_entry(e) for e in listing.entries],
        **_render_capacity(listing.capacity),
        "api_version": listing.version,
    }


def _render_entry(entry: Entry) -> dict[str, Any]:
    """An entry's fields under their own names (its tuples as lists)."""
    out = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _render_capacity(c: Capacity) -> dict[str, Any]:
    return {
        "model": c.model,
        "max_loras": c.max_loras,
        "max_cpu_loras": c.max_cpu_loras,
        "num_requests_waiting": c.waiting,
        "num_requests_running": c.running,
    }


def parse_residency(payload: Any) -> Residency:
    """A `GET /v1/adapters` answer in either form, as residency; ValueError when it is neither."""
    if isinstance(payload, Mapping) and payload.get("object") == "residency":
        gpu, cpu, disk = (_names(payload, tier) for tier in TIERS)
        return Residency(gpu, cpu, disk, _parse_capacity(payload), fields.version_of(payload))
    return parse_listing(payload).residency()


def _names(payload: Mapping[str, Any], tier: str) -> tuple[str, ...]:
    names = payload.get(tier)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"GET /v1/adapters?view=residency did not list {tier} names")
    return tuple(names)


def parse_listing(payload: Any) -> Listing:
    """The listing form; ValueError when it is not one."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), list):
        raise ValueError("GET /v1/adapters did not return {'data': [...]}")
    return Listing(
        entries=tuple(_parse_entry(raw) for raw in payload["data"]),
        capacity=_parse_capacity(payload),
        version=fields.version_of(payload),
    )


def _parse_entry(raw: Any) -> Entry:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
        raise ValueError(f"GET /v1/adapters returned an entry without an id: {raw!r}")
    tier = raw.get("tier")
    return Entry(
        id=raw["id"],
        tier=tier if tier in TIERS else "disk",
        path=fields.text(raw.get("path")),
        pinned=fields.flag(raw.get("pinned")),
        origin=fields.text(raw.get("origin")),
        hits=fields.count(raw.get("hits")),
        last_used=fields.number(raw.get("last_used")),
        size_bytes=fields.count(raw.get("size_bytes")),
        sha256=fields.text(raw.get("sha256")),
        rank=fields.count(raw.get("rank")),
        format=fields.text(raw.get("format")),
        merged_only=fields.flag(raw.get("merged_only")),
        targets=fields.texts(raw.get("targets")),
        trigger_words=fields.texts(raw.get("trigger_words")),
    )


def _parse_capacity(payload: Mapping[str, Any]) -> Capacity:
    return Capacity(
        model=fields.text(payload.get("model")),
        max_loras=fields.count(payload.get("max_loras")),
        max_cpu_loras=fields.count(payload.get("max_cpu_loras")),
        waiting=fields.count(payload.get("num_requests_waiting")),
        running=fields.count(payload.get("num_requests_running")),
    )
