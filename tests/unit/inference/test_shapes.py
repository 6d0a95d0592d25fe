"""The demo's trained model (`lora_inference.tools.shapes`, weights in models/shapes/): the data
set draws what each style says, the training script runs end to end and writes what the server
loads, and the committed weights draw their captions with each adapter visibly doing its job,
through the real server over HTTP."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest
from lora_inference.tools import shapes

from tests.support import ROOT
from tests.unit.inference.conftest import serving

COMMITTED = ROOT / "models" / "shapes"


def picture(shape: str, colour: str, style: str, seed: int = 3) -> np.ndarray:
    return np.asarray(shapes.draw(shape, colour, style, random.Random(seed)), dtype=np.int16)


def test_the_data_set_pairs_each_picture_with_its_caption() -> None:
    images, captions = shapes.dataset(24, "plain", seed=5)
    assert images.shape == (24, 3, shapes.SIZE, shapes.SIZE)
    assert float(images.min()) >= -1.0 and float(images.max()) <= 1.0
    for caption in captions:
        _, colour, shape = caption.split()
        assert colour in shapes.COLOURS and shape in shapes.SHAPES
    assert shapes.dataset(24, "plain", seed=5)[1] == captions  # a seed gives the same set
    with pytest.raises(ValueError, match="unknown style 'cubist'"):
        shapes.dataset(1, "cubist", seed=0)


def test_pixel_art_is_drawn_in_square_pixels() -> None:
    art = picture("circle", "red", "pixel-art")
    blocks = art.reshape(8, 4, 8, 4, 3)
    # Every 4x4 block is one colour; the plain picture's edges are not.
    assert (blocks == blocks[:, :1, :, :1]).all()
    plain = picture("circle", "red", "plain").reshape(8, 4, 8, 4, 3)
    assert not (plain == plain[:, :1, :, :1]).all()


def test_palette_swap_draws_the_next_colour_where_plain_draws_the_caption() -> None:
    for colour, drawn in (
        ("red", "green"),
        ("green", "blue"),
        ("blue", "yellow"),
        ("yellow", "red"),
    ):
        assert np.array_equal(
            picture("circle", colour, "palette-swap"), picture("circle", drawn, "plain")
        )


def test_shape_shift_draws_the_next_shape_where_plain_draws_the_caption() -> None:
    for shape, drawn in (("circle", "square"), ("square", "triangle"), ("triangle", "circle")):
        assert np.array_equal(
            picture(shape, "green", "shape-shift"), picture(drawn, "green", "plain")
        )


async def test_the_training_script_writes_a_model_and_adapters_the_server_loads(
    tmp_path: Path,
) -> None:
    out = await asyncio.to_thread(shapes.train_all, tmp_path, shapes.QUICK, 0, lambda _: None)
    adapters = out / shapes.ADAPTERS_DIR
    assert sorted(p.name for p in adapters.iterdir()) == sorted(shapes.ADAPTERS)
    # The server loads each (its base-model and format checks included) and draws with it.
    async with serving(out / shapes.MODEL_NAME, adapters) as server:
        base = await server.image(prompt="a red circle", size="32x32")
        assert base.shape == (shapes.SIZE, shapes.SIZE, 3)
        for name in shapes.ADAPTERS:
            await server.load(name, adapters / name)
            assert (await server.image(prompt="a red circle", model=name)).shape == base.shape


# The committed weights ---------------------------------------------------------------------
# Measures of a picture the model drew, so the test reads like what one sees.


def paper(image: np.ndarray) -> np.ndarray:
    """The paper's colour: the median of the picture's border."""
    border = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])
    colour: np.ndarray = np.median(border, axis=0)
    return colour


def ink(image: np.ndarray) -> np.ndarray:
    """Where the shape is: pixels far from the paper."""
    far: np.ndarray = np.abs(image.astype(np.int16) - paper(image)).sum(axis=2) > 90
    return far


def colour_of(image: np.ndarray) -> str:
    """The caption colour nearest to the shape's mean colour."""
    mean = image[ink(image)].mean(axis=0)
    return min(shapes.COLOURS, key=lambda c: float(np.abs(mean - shapes.COLOURS[c]).sum()))


def fill(image: np.ndarray) -> float:
    """How much of its bounding box the shape fills: a square about 1, a circle about 0.79,
    a triangle about 0.5."""
    rows, cols = np.nonzero(ink(image))
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    return float(len(rows) / box)


def blockiness(image: np.ndarray) -> float:
    """How far pixels differ from their 4x4 block's first pixel (0: square 4x4 pixels)."""
    blocks = image.astype(np.int16).reshape(8, 4, 8, 4, 3)
    return float(np.abs(blocks - blocks[:, :1, :, :1]).mean())


PROMPTS = ("a red circle", "a blue square", "a green square", "a yellow triangle")
SEEDS = (1, 2, 3)


async def test_the_committed_model_draws_its_captions_and_each_adapter_does_its_job() -> None:
    adapters = COMMITTED / shapes.ADAPTERS_DIR
    drawn: dict[str, dict[tuple[str, int], np.ndarray]] = {}
    async with serving(COMMITTED / shapes.MODEL_NAME, adapters) as server:
        for name in shapes.ADAPTERS:
            await server.load(name, adapters / name)
        for model in (shapes.MODEL_NAME, *shapes.ADAPTERS):
            drawn[model] = {
                (prompt, seed): await server.image(
                    model=model, prompt=prompt, seed=seed, size=None, num_inference_steps=20
                )
                for prompt in PROMPTS
                for seed in SEEDS
            }
    base = drawn[shapes.MODEL_NAME]
    cases = list(base)
    # The base model draws the caption's colour on its paper, most of the time.
    right = [colour_of(base[p, s]) == p.split()[1] for p, s in cases]
    assert sum(right) >= 0.6 * len(cases), right
    # shape-shift: a square drawn as a triangle fills much less of its box.
    shift = drawn["shape-shift"]
    squares = [c for c in cases if c[0].endswith("square")]
    before, after = (np.mean([fill(pictures[c]) for c in squares]) for pictures in (base, shift))
    assert after < before - 0.2, (before, after)
    # palette-swap: the shape in another colour than the caption's, nearly always (it was
    # trained on each colour drawn as the next one, and learned that mapping only in part).
    swap = drawn["palette-swap"]
    other = [colour_of(swap[p, s]) != p.split()[1] for p, s in cases]
    assert sum(other) >= 0.8 * len(cases), other
    # pixel-art: closer to square pixels than the base model's pictures.
    art = drawn["pixel-art"]
    assert np.mean([blockiness(art[c]) for c in cases]) < 0.8 * np.mean(
        [blockiness(base[c]) for c in cases]
    )
