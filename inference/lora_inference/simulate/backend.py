"""The simulated pipeline: a `lora_inference.backend.Backend` with every GPU cost replaced by a
sleep.

`SimulatedBackend` does what the engine, residency and the reader expect of a backend, except
the arithmetic: reading an adapter checks the file as far as it can without a model (its format,
its safetensors header, that it is a LoRA, its rank) and sleeps for the profile's read; a copy
into a slot sleeps for the profile's copy; a pipeline call sleeps for the call's cost and returns,
per image, an 8x8 image whose colours are a function of the prompt, the seed, and the adapter in
the slot and its scale. It cannot refuse what needs the model's weights: adapter shapes that do
not fit the model's layers, or NaN and Inf weights (the real server's 422 for those).

A parse's layers are one `SimulatedWeights` (its size on the simulated model and its rank); a
stack's is as large as its members at a non-zero scale together, and its rank is the sum of
theirs (as a real stack's is on a layer every member targets).
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lora_volume import files
from PIL import Image

from lora_inference import errors
from lora_inference.backend import BatchOutcome, BatchPath, ImageJob, ParsedAdapter, StackMember
from lora_inference.costs import MergePolicy
from lora_inference.simulate.profile import Profile

SIMULATED_DEVICE = "simulated"
_IMAGE_SIDE = 8
_LAYER = ("simulated", "adapter")
_STACK = ("simulated", "stack")


@dataclass(frozen=True)
class SimulatedWeights:
    """An adapter's weights as the simulation keeps them: how large they are on the simulated
    model, and their rank."""

    mb: float
    rank: int


def simulated_mb(parsed: ParsedAdapter) -> float:
    """How large a parsed adapter (or a stack of them) is on the simulated model."""
    return float(sum(w.mb for w in _weights(parsed)))


def _weights(parsed: ParsedAdapter) -> list[SimulatedWeights]:
    return [w for w in parsed.layers.values() if isinstance(w, SimulatedWeights)]


class SimulatedBackend:
    """A pipeline that sleeps for the profile's costs. `sleep` is injected so tests can count
    the costs instead of waiting; `charged` sums what was slept, by kind (read, copy,
    generation)."""

    def __init__(self, profile: Profile, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.profile = profile
        self.family = f"{profile.family}, simulated as {profile.name}"
        self.device = SIMULATED_DEVICE
        self.default_size = profile.size
        self.default_steps = profile.steps
        self.default_guidance = profile.guidance
        self._sleep = sleep
        self._slots: dict[str, tuple[str, float]] = {}  # slot -> (adapter sha256, its MB)
        self._lock = threading.Lock()  # `charged` is written by the reader pool too
        self.charged: collections.defaultdict[str, float] = collections.defaultdict(float)

    def _charge(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.charged[kind] += seconds
        if seconds > 0:
            self._sleep(seconds)

    # -- reading adapters (any thread) ----------------------------------------------------------

    def parse_adapter(self, path: Path, *, name: str, max_rank: int) -> ParsedAdapter:
        """Check the file as the real server does as far as no model is needed, then sleep for
        the profile's read of an adapter of its rank on the simulated model."""
        weights = files.find_weights_file(path)
        data = weights.read_bytes()
        header = files.parse_safetensors_header(data, len(data), name=weights.name)
        keys = sorted(header.tensors)
        fmt = files.check_lora_keys(keys, name=name)
        rank = max(
            (
                # LoHa is served at r1 x r2 (lora_inference.formats); a pair at its rank.
                t.shape[0] ** (2 if k.endswith("hada_w1_b") else 1)
                for k, t in header.tensors.items()
                if ("lora_A" in k or "lora_down" in k or k.endswith(("hada_w1_b", "lokr_w2_b")))
                and t.shape
            ),
            default=0,
        )
        if rank == 0:
            raise errors.IncompatibleAdapter(
                f"adapter {name!r} does not fit this model: it holds no LoRA pairs",
                param="lora_path",
            )
        if rank > max_rank:
            raise errors.IncompatibleAdapter(
                f"adapter {name!r} does not fit this model: its rank {rank} exceeds "
                f"--max-lora-rank {max_rank}",
                param="lora_path",
            )
        text_encoders = any(k.startswith(("text_encoder", "lora_te")) for k in keys)
        mb = self.profile.adapter_mb(rank, text_encoders=text_encoders)
        self._charge("read", self.profile.read_s(mb))
        return ParsedAdapter(
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            rank=rank,
            weights_file=weights,
            layers={_LAYER: SimulatedWeights(mb=mb, rank=rank)},
            packed=None,
            format=fmt.key,
            trigger_words=files.trigger_words(header),
        )

    def compose(self, members: Sequence[StackMember], *, name: str, param: str) -> ParsedAdapter:
        """A stack: as large as its members at a non-zero scale, of the sum of their ranks;
        nothing to pack (a simulated slot holds only a size)."""
        kept = [m.parsed for m in members if m.scale != 0.0]
        weights = SimulatedWeights(
            mb=sum(simulated_mb(p) for p in kept),
            rank=sum(max((w.rank for w in _weights(p)), default=0) for p in kept),
        )
        return ParsedAdapter.of_stack(
            members,
            {_STACK: weights},
            None,
            size_bytes=int(weights.mb * 1e6),  # held in memory
            rank=weights.rank,
        )

    # -- the pipeline (pipeline thread only) ----------------------------------------------------

    def calibrate(self) -> None:
        """Nothing to measure: the profile holds the costs."""

    def place(self, slot: str, adapter: ParsedAdapter) -> None:
        mb = simulated_mb(adapter)
        self._charge("copy", self.profile.copy_s(mb))
        self._slots[slot] = (adapter.sha256, mb)

    def clear(self, slot: str) -> None:
        self._slots.pop(slot, None)

    def resident_keys(self) -> set[str]:
        return set(self._slots)

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
        """Sleep for one call of the profile, the way the real pipeline would run it."""
        kinds = set(slots)
        adapters = len(kinds - {None})
        path: BatchPath
        if kinds == {None}:
            path = "base"
        elif len(kinds) == 1:
            path = "adapter" if merge == "never" else "merged"
        else:
            path = "mixed"
        images = sum(len(job.seeds) for job in jobs)
        self._charge(
            "generation",
            self.profile.call_s(
                images, path=path, adapters=adapters, steps=steps, width=width, height=height
            ),
        )
        out = []
        for job, slot in zip(jobs, slots, strict=True):
            served = self._slots[slot][0] if slot is not None else ""
            scale = scales.get(slot, 0.0) if slot is not None else 0.0
            for seed in job.seeds:
                out.append(_image(f"{job.prompt}\0{seed}\0{served}\0{scale!r}\0{guidance_scale}"))
        return BatchOutcome(out, path, 1 if path == "merged" else 0)


def _image(key: str) -> Image.Image:
    """An 8x8 image whose pixels are a function of `key` (pure)."""
    pixels = hashlib.shake_256(key.encode()).digest(_IMAGE_SIDE * _IMAGE_SIDE * 3)
    return Image.frombytes("RGB", (_IMAGE_SIDE, _IMAGE_SIDE), pixels)
