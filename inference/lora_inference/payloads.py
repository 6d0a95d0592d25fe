"""The engine's state as the pod API's payloads (`lora_podapi`): the values `GET /v1/models`
and `GET /v1/adapters` answer with, rendered by the handlers in `app`.

Owns: which record field becomes which field of a card or an entry. Must not: render JSON or
touch HTTP (the handlers do), or change the engine.
"""

from __future__ import annotations

from lora_podapi import adapters, models
from lora_volume import formats, layout

from lora_inference.adapters.registry import AdapterRecord
from lora_inference.config import ServerConfig
from lora_inference.engine import Engine


def model_list(config: ServerConfig, engine: Engine | None, created: int) -> models.ModelList:
    """The base model's card, then a card per registered adapter once the engine has started.

    No card shows a path on the pod (the model's, or the adapter volume's): `root` is what the
    card was made from, by name. A revision the operator published names its LoRAAdapter
    (`adapter`; a rollout's alias is served from another adapter's revision) and the revision's
    sha256 (`revision`), by which the operator recognises its own adapters; any other adapter's
    `root` is its own name and both are null."""
    cards = [
        models.Card(
            id=config.model_id,
            root=config.model_id,
            created=created,
            simulated=config.simulate or None,  # benchmarks and tests: no real model
        )
    ]
    if engine is not None:
        cards += [card(config, engine, r, created) for r in engine.registry.records()]
    # Beyond vLLM's list: the capacity the operator places adapters by.
    return models.ModelList(tuple(cards), config.max_loras, config.max_cpu_loras)


def card(config: ServerConfig, engine: Engine, record: AdapterRecord, created: int) -> models.Card:
    """The adapter's card in `GET /v1/models`, and the answer to its load call when the caller
    asks for JSON."""
    published = layout.published_revision(record.path)
    return models.Card(
        id=record.name,
        root=published.adapter if published is not None else record.name,
        parent=config.model_id,
        created=created,
        adapter=published.adapter if published is not None else None,
        revision=published.sha256 if published is not None else None,
        # Beyond vLLM's card: what the operator compares with the LoRAAdapter's spec, the
        # demand it scales hot adapters by, and what the playground shows.
        scale=record.scale,
        pinned=record.pinned,
        sha256=record.sha256,
        hits=engine.registry.stats(record.name).hits,
        format=record.format,
        rank=record.rank,
        trigger_words=record.trigger_words,
    )


def capacity(config: ServerConfig, engine: Engine) -> adapters.Capacity:
    occupancy = engine.occupancy()
    return adapters.Capacity(
        model=config.model_id,
        max_loras=config.max_loras,
        max_cpu_loras=config.max_cpu_loras,
        waiting=occupancy.waiting,
        running=occupancy.running,
    )


def residency(config: ServerConfig, engine: Engine) -> adapters.Residency:
    """The adapters' names by tier: what a router polls."""
    tiers = [(r.name, engine.residency.tier_of(r)) for r in engine.registry.records()]
    gpu, cpu, disk = (tuple(n for n, t in tiers if t == tier) for tier in adapters.TIERS)
    return adapters.Residency(gpu, cpu, disk, capacity(config, engine))


def listing(config: ServerConfig, engine: Engine) -> adapters.Listing:
    """Every registered adapter, its tier and usage."""
    entries = []
    for record in engine.registry.records():
        stats = engine.registry.stats(record.name)
        entries.append(
            adapters.Entry(
                id=record.name,
                tier=engine.residency.tier_of(record),
                path=str(record.path),
                pinned=record.pinned,
                origin=record.origin,
                hits=stats.hits,
                last_used=stats.last_used,
                size_bytes=record.size_bytes,
                sha256=record.sha256,
                rank=record.rank,
                format=record.format,
                # Served merged into the base weights, in batches of its own (docs/adapters.md).
                merged_only=formats.merged_only(record.format),
                targets=record.targets,
                trigger_words=record.trigger_words,
            )
        )
    return adapters.Listing(tuple(entries), capacity(config, engine))
