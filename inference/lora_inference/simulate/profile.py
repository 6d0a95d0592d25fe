"""A simulated GPU's costs: a profile file read into a value, and what each step costs (pure).

A profile (`profiles/<name>.json`, with the measurements it comes from under `provenance`)
gives, for one model on one GPU at its own image size and step count:

- `generation_s`: a pipeline call of the base model, by images per call (measured points;
  between them linear, beyond the last the last segment's slope);
- `batch_factor`: a call's cost against the base model's: one adapter `merged` (what the
  server's cost model chooses on a GPU) or unmerged (`adapter`, with `--merge never`); a batch
  that mixes adapters `1 + mixed_per_adapter x adapters` (fitted to a measured call of several);
- `adapter_mb_per_rank`: how large an adapter of a given rank is on this model, in the model's
  dtype (`unet`, plus `text_encoders` when it adapts them);
- `first_use_s_per_mb`: an adapter's first use (read, hash, convert, copy into a slot) per MB,
  and `slot_copy_s_per_mb`, the copy alone: what a hit in the CPU tier costs.

Other sizes and step counts scale the call's time linearly in pixels and steps. Nothing here
sleeps or touches files but `load_profile`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_inference.backend import BatchPath

PROFILES = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A profile that cannot be found or read; the message says which and why."""


@dataclass(frozen=True)
class Profile:
    name: str
    family: str
    size: int  # the image side the figures are for
    steps: int
    guidance: float
    generation_s: tuple[tuple[int, float], ...]  # (images per call, seconds), ascending
    merged_factor: float
    adapter_factor: float
    mixed_per_adapter: float
    unet_mb_per_rank: float
    text_encoders_mb_per_rank: float
    first_use_s_per_mb: float
    slot_copy_s_per_mb: float

    def base_call_s(self, images: int) -> float:
        """The base model's call of `images` images at the profile's size and steps."""
        points = self.generation_s
        if len(points) == 1:  # one measured size: proportional to the images
            (n0, t0) = points[0]
            return t0 * max(images, 1) / n0
        if images <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(points):
            if images <= n1:
                return t0 + (t1 - t0) * (images - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (images - n1) / (n1 - n0)

    def factor(self, path: BatchPath, adapters: int) -> float:
        """A call's cost against the base model's, by the way it runs."""
        if path == "merged":
            return self.merged_factor
        if path == "adapter":
            return self.adapter_factor
        if path == "mixed":
            return 1.0 + self.mixed_per_adapter * adapters
        return 1.0

    def call_s(
        self, images: int, *, path: BatchPath, adapters: int, steps: int, width: int, height: int
    ) -> float:
        """One pipeline call: `images` images, `adapters` distinct adapters in it."""
        scale = (steps / self.steps) * (width * height) / (self.size * self.size)
        return self.base_call_s(images) * self.factor(path, adapters) * scale

    def adapter_mb(self, rank: int, *, text_encoders: bool) -> float:
        """How large an adapter of `rank` is on this model."""
        per_rank = self.unet_mb_per_rank + (self.text_encoders_mb_per_rank if text_encoders else 0)
        return rank * per_rank

    def read_s(self, mb: float) -> float:
        """The part of a first use before the copy into a slot: read, hash, convert."""
        return max(0.0, self.first_use_s_per_mb - self.slot_copy_s_per_mb) * mb

    def copy_s(self, mb: float) -> float:
        """A copy of a parsed adapter into a GPU slot."""
        return self.slot_copy_s_per_mb * mb

    def first_use_s(self, mb: float) -> float:
        return self.read_s(mb) + self.copy_s(mb)

    def no_miss_images_per_s(self, pods: int, *, batch: int = 1) -> float:
        """A fleet's throughput if every request hit a GPU slot: every pod running full calls of
        one adapter (merged), at the profile's size and steps."""
        return pods * batch / (self.base_call_s(batch) * self.merged_factor)


def parse_profile(raw: Mapping[str, Any], *, source: str = "profile") -> Profile:
    """A profile from its JSON object; ProfileError saying what is missing or wrong."""
    try:
        points = sorted((int(k), float(v)) for k, v in raw["generation_s"].items())
        factor = raw["batch_factor"]
        sizes = raw["adapter_mb_per_rank"]
        profile = Profile(
            name=str(raw["name"]),
            family=str(raw.get("family", "simulated")),
            size=int(raw["size"]),
            steps=int(raw["steps"]),
            guidance=float(raw.get("guidance", 5.0)),
            generation_s=tuple(points),
            merged_factor=float(factor["merged"]),
            adapter_factor=float(factor["adapter"]),
            mixed_per_adapter=float(factor["mixed_per_adapter"]),
            unet_mb_per_rank=float(sizes["unet"]),
            text_encoders_mb_per_rank=float(sizes.get("text_encoders", 0.0)),
            first_use_s_per_mb=float(raw["first_use_s_per_mb"]),
            slot_copy_s_per_mb=float(raw["slot_copy_s_per_mb"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProfileError(f"{source} is not a simulation profile: {e!r}") from e
    if not points or any(n < 1 or t <= 0 for n, t in points) or profile.size < 1:
        raise ProfileError(f"{source}: generation_s needs positive times for 1 or more images")
    if profile.steps < 1 or min(profile.first_use_s_per_mb, profile.slot_copy_s_per_mb) < 0:
        raise ProfileError(f"{source}: steps must be positive and adapter costs at least 0")
    return profile


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def load_profile(name_or_path: str) -> Profile:
    """A bundled profile by name (`h200-sdxl-20step`), or a profile file by its path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES / f"{name_or_path}.json"
    if not path.is_file():
        raise ProfileError(
            f"no simulation profile {name_or_path!r}: name one of {', '.join(profile_names())} "
            "or give the path of a profile file"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"{path} cannot be read as JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ProfileError(f"{path} is not a JSON object")
    return parse_profile(raw, source=str(path))
