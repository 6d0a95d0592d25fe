"""The seam between the server and what draws its images: the `Backend` Protocol and the values
that cross it, defined once here.

Two backends implement it: the diffusers pipeline (`pipeline.DiffusionBackend`, torch) and the
simulated GPU (`simulate.SimulatedBackend`, which sleeps for a profile's costs). The server core
(app, engine, admission, reader, residency) calls a backend only through these Protocols and
passes only these values; the CLI picks the backend and hands it to `app.create_app`. Each
consumer is given the part it calls: the reader `AdapterParser` (the read pool), residency
`SlotPipeline` (the pipeline thread), the engine and the app the whole `Backend`.

A parse's weights (`ParsedAdapter.layers`, `packed`, `full`) are the backend's own (torch
tensors in the pipeline, sizes in the simulation): only the backend that made a parse reads
them; the server core reads their keys (which layers an adapter targets) and nothing else.

Imports no torch, diffusers, peft or transformers, nor any backend (lint-imports checks it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from lora_volume.stacks import Blocks
from PIL import Image

from lora_inference.costs import MergePolicy
from lora_inference.stackkeys import stack_sha256

__all__ = [
    "AdapterParser",
    "Backend",
    "BatchOutcome",
    "BatchPath",
    "ImageJob",
    "LayerKey",
    "ParsedAdapter",
    "SlotPipeline",
    "StackMember",
]

LayerKey = tuple[str, str]  # (pipeline component, module path inside it)

# How a pipeline call ran its images: the base model alone, one adapter as a branch, one adapter
# merged into the layers where it pays, or several (or adapters and the base) in one pass.
BatchPath = Literal["base", "adapter", "merged", "mixed"]


@dataclass(frozen=True)
class ParsedAdapter:
    """An adapter read from disk, checked and converted: what the CPU tier caches."""

    sha256: str
    size_bytes: int
    rank: int
    weights_file: Path
    # Per targeted layer: the weights under peft's module names, with the setup peft would give
    # them (stacks are built from these). The backend's own values: see the module docstring.
    layers: Mapping[LayerKey, Any]
    # The same, packed into one slot row: entering a slot is one copy of it (None: nothing to
    # copy, as in a simulation).
    packed: Any
    format: str = "lora"  # lora_volume.formats.Format.key of the file
    trigger_words: tuple[str, ...] = ()  # what the file's metadata says to put in a prompt
    # A merged-only adapter's whole-matrix layers, on the CPU: merged into the base weights for
    # batches of it alone, never held in a slot.
    full: Mapping[LayerKey, Any] = field(default_factory=dict)

    @classmethod
    def of_stack(
        cls,
        members: Sequence[StackMember],
        layers: Mapping[LayerKey, Any],
        packed: Any,
        *,
        size_bytes: int,
        rank: int,
    ) -> ParsedAdapter:
        """A stack's parse (`AdapterParser.compose`): its identity is its members' versions at
        their scales and blocks (`stackkeys.stack_sha256`), whichever backend built it."""
        return cls(
            sha256=stack_sha256([(m.name, m.parsed.sha256, m.scale, m.blocks) for m in members]),
            size_bytes=size_bytes,
            rank=rank,
            weights_file=members[0].parsed.weights_file,
            layers=layers,
            packed=packed,
        )


@dataclass(frozen=True)
class StackMember:
    """One adapter of a stack: its name, the scale it is applied at, and its parse."""

    name: str
    scale: float
    parsed: ParsedAdapter
    # Per block group multipliers of `scale` (stackkeys); empty: `scale` on every layer.
    blocks: Blocks = ()


@dataclass(frozen=True)
class ImageJob:
    """One request's share of a batch."""

    prompt: str
    negative_prompt: str | None
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class BatchOutcome:
    """A pipeline call's images (one per seed, jobs in order), how it ran, and how many layers
    it merged."""

    images: list[Image.Image]
    path: BatchPath
    merged_layers: int


class AdapterParser(Protocol):
    """What the reader calls, from its read pool (any thread): reading and converting only,
    never the pipeline's state."""

    def parse_adapter(self, path: Path, *, name: str, max_rank: int) -> ParsedAdapter:
        """Read, hash, check and convert the adapter at `path`.

        Raises the volume's UnsupportedFormat (pickle) and InvalidAdapter (corrupt file, not a
        LoRA), and IncompatibleAdapter (what does not fit this model: shapes, a rank above
        `max_rank`, NaN or Inf weights, as far as the backend can tell).
        """
        ...

    def compose(self, members: Sequence[StackMember], *, name: str, param: str) -> ParsedAdapter:
        """One adapter equal to the sum of `members` at their scales, ready for a slot
        (`ParsedAdapter.of_stack`); `name` is the stack's (`stackkeys.stack_name`), `param` the
        request field an IncompatibleAdapter (members that cannot be stacked) is about."""
        ...


class SlotPipeline(Protocol):
    """What residency calls, on the pipeline thread only: copy an adapter into a slot, empty
    one. Slots are named by residency."""

    def place(self, slot: str, adapter: ParsedAdapter) -> None: ...

    def clear(self, slot: str) -> None: ...


class Backend(AdapterParser, SlotPipeline, Protocol):
    """A pipeline the server drives: the reader's and residency's parts, and what the engine
    and the app call. Driven by one thread (the engine's pipeline worker) but for
    `AdapterParser`'s methods; every method blocks."""

    family: str  # what it serves, for the log (a diffusers pipeline class name)
    # Defaults of a generation request that gives none (the model family's).
    default_size: int
    default_steps: int
    default_guidance: float

    def calibrate(self) -> object:
        """Measure what `run_batch`'s merge decisions need (`--merge auto`), once, before any
        adapter is placed."""
        ...

    def run_batch(
        self,
        jobs: Sequence[ImageJob],
        slots: Sequence[str | None],
        scales: Mapping[str, float],
        *,
        width: int,
        height: int,
        steps: int,
        guidance_scale: float,
        merge: MergePolicy = "auto",
    ) -> BatchOutcome:
        """One pipeline call for `jobs`, each through its slot (None: the base model) at its
        slot's scale in `scales`."""
        ...
