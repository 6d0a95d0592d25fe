"""The same request gives the same image on every serving path, at the step counts users run.

A request's image must not depend on how the server ran it: alone or in a batch that mixes
adapters (one gathered pass per layer), merged into the weights or as a branch. The
paths sum the same products in another order, so they agree to float rounding, which an 8-bit
image shows as at most one level, at 2 steps and at 50 alike.

That holds for adapters whose deltas are small next to the weights they change, as trained ones
are. A random adapter far stronger than its base layers makes the tiny random models chaotic:
attention logits grow until softmax picks a key on a knife's edge, and a change in the last bit
of one weight moves the picture by dozens of levels after a few steps, whatever the path. The
last test shows that boundary, so the adapters here stay on the well-conditioned side of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from lora_inference.backend import ImageJob
from lora_inference.costs import MergePolicy
from lora_inference.pipeline import DiffusionBackend
from lora_inference.tools.random_adapters import write_random_adapter
from lora_inference.tools.tiny_models import ARCHITECTURES, write_tiny_model

from tests.unit.inference.conftest import BatchShape

STEPS = (2, 4, 8, 20)


@dataclass(frozen=True)
class Family:
    backend: DiffusionBackend
    pipe: object
    model: Path


def _family(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Family:
    model = write_tiny_model(tmp_path_factory.mktemp(arch) / f"tiny-{arch}", arch)
    backend = DiffusionBackend.load(model, device="cpu", dtype=torch.float32)
    return Family(backend, DiffusionPipeline.from_pretrained(str(model)), model)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def slotted(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """Two adapters in slots: a denoiser-only rank 4 and a rank 8 with text-encoder layers."""
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "a": write_random_adapter(root / "a", family.pipe, base_model="m", seed=1),
        "b": write_random_adapter(
            root / "b",
            family.pipe,
            base_model="m",
            seed=2,
            rank=8,
            strength=0.3,
            text_encoder=True,
        ),
    }
    for slot, path in made.items():
        family.backend.place(slot, family.backend.parse_adapter(path, name=slot, max_rank=64))
    yield family
    for slot in made:
        family.backend.clear(slot)


def _pixels(images: Sequence[object]) -> list[np.ndarray]:
    return [np.asarray(image).astype(int) for image in images]


@pytest.mark.parametrize("steps", STEPS)
def test_every_path_draws_the_same_image(slotted: Family, steps: int) -> None:
    backend = slotted.backend
    size = backend.default_size
    shape: BatchShape = {"width": size, "height": size, "steps": steps, "guidance_scale": 5.0}
    jobs = {
        slot: ImageJob(prompt=f"a lighthouse {slot}", negative_prompt=None, seeds=(7,))
        for slot in ("a", "b", None)
    }

    def alone(slot: str | None, merge: MergePolicy) -> np.ndarray:
        scales = {} if slot is None else {slot: 0.8}
        outcome = backend.run_batch([jobs[slot]], [slot], scales, merge=merge, **shape)
        return _pixels(outcome.images)[0]

    reference = {slot: alone(slot, "never") for slot in jobs}
    drawn: dict[str, dict[str | None, np.ndarray]] = {
        "merged": {slot: alone(slot, "always") for slot in ("a", "b")}
    }
    for order in (["b", None, "a"], ["a", "a", "b", None]):
        outcome = backend.run_batch(
            [jobs[s] for s in order],
            order,
            {"a": 0.8, "b": 0.8},
            **shape,
        )
        assert outcome.path == "mixed"
        drawn[f"mixed {order}"] = dict(zip(order, _pixels(outcome.images), strict=True))
    for path, images in drawn.items():
        for slot, image in images.items():
            worst = int(np.abs(image - reference[slot]).max())
            assert worst <= 1, f"{path}: {slot or 'base'} is {worst} levels off at {steps} steps"
    for slot in ("a", "b"):  # the adapters are there to be seen
        assert np.abs(reference[slot] - reference[None]).mean() > 0.5, slot


def test_a_last_bit_change_moves_an_overstrong_adapter_but_not_a_sane_one(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Why the drift between paths is a property of the adapter, not of a path: scaling every
    down matrix by (1 + 1e-6), far below any path's rounding difference, leaves a sane adapter's
    20-step image within a level and moves an overstrong one's by dozens."""
    family = _family("sd15", tmp_path_factory)
    tmp_path = tmp_path_factory.mktemp("strengths")
    backend = family.backend
    shape: BatchShape = {"width": 64, "height": 64, "steps": 20, "guidance_scale": 7.0}
    job = ImageJob(prompt="a lighthouse", negative_prompt=None, seeds=(7,))
    moved = {}
    for strength in (0.3, 0.8):
        path = write_random_adapter(
            tmp_path / str(strength),
            family.pipe,
            base_model="m",
            rank=8,
            seed=1,
            strength=strength,
            text_encoder=True,
        )
        parsed = backend.parse_adapter(path, name="x", max_rank=64)
        nudged = {k: replace(w, down=w.down * (1 + 1e-6)) for k, w in parsed.layers.items()}
        images = []
        for slot, layers in (("x", parsed.layers), ("y", nudged)):
            backend.slots.place(slot, layers)
            outcome = backend.run_batch([job], [slot], {slot: 1.0}, merge="never", **shape)
            images.append(_pixels(outcome.images)[0])
            backend.clear(slot)
        moved[strength] = int(np.abs(images[0] - images[1]).max())
    assert moved[0.3] <= 1, moved
    assert moved[0.8] > 16, moved
