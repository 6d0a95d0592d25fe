"""Pictures side by side for the demos: one column per model or adapter, one row per prompt.

Images are enlarged without smoothing, so the small pictures the demo models draw stay sharp.
Needs only Pillow (no torch): the cluster demo draws its sheet on the machine that drives it.
"""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageDraw

LABEL_HEIGHT = 24


def contact_sheet(
    columns: Sequence[str],
    rows: Sequence[tuple[str, Sequence[Image.Image]]],
    side: int = 256,
) -> Image.Image:
    """A grid of `side`-pixel squares: each column under its label in `columns`, each row
    (label, images) with its label, when it has one, in a strip above it."""
    row_label = LABEL_HEIGHT if any(label for label, _ in rows) else 0
    row_height = side + row_label
    sheet = Image.new("RGB", (side * len(columns), LABEL_HEIGHT + row_height * len(rows)), "white")
    pen = ImageDraw.Draw(sheet)
    for i, label in enumerate(columns):
        pen.text((i * side + 8, 6), label, fill="black")
    for r, (label, images) in enumerate(rows):
        if len(images) != len(columns):
            raise ValueError(f"row {label!r} has {len(images)} images for {len(columns)} columns")
        top = LABEL_HEIGHT + r * row_height
        if label:
            pen.text((8, top + 6), label, fill="dimgray")
        for i, image in enumerate(images):
            picture = image.convert("RGB").resize((side, side), Image.Resampling.NEAREST)
            sheet.paste(picture, (i * side, top + row_label))
    return sheet
