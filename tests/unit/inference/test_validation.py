"""Shape checks of adapters against a model's layer table (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from lora_inference import errors
from lora_inference.adapters.validation import LayerShape, check_adapter_fits

MODEL = {
    "unet": {
        "blk.to_q": LayerShape(16, 16),
        "blk.proj": LayerShape(8, 16, (3, 3)),
    },
    "text_encoder": {"enc.q_proj": LayerShape(32, 32)},
}


def pair(module: str, rank: int, fan_in: int, fan_out: int) -> dict[str, tuple[int, ...]]:
    return {f"{module}.lora_A.weight": (rank, fan_in), f"{module}.lora_B.weight": (fan_out, rank)}


def test_a_fitting_adapter_reports_rank_and_components() -> None:
    adapter = {
        "unet": {
            **pair("blk.to_q", 4, 16, 16),
            "blk.proj.lora_A.weight": (4, 8, 3, 3),
            "blk.proj.lora_B.weight": (16, 4, 1, 1),
        },
        "text_encoder": pair("enc.q_proj", 2, 32, 32),
    }
    summary = check_adapter_fits(adapter, MODEL, max_rank=8, name="x")
    assert (summary.rank, summary.components, summary.layers) == (4, ("text_encoder", "unet"), 3)


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        pytest.param({"transformer": pair("blk.to_q", 4, 16, 16)}, "lacks", id="missing-component"),
        pytest.param({"unet": pair("blk.nope", 4, 16, 16)}, "does not have", id="unknown-module"),
        pytest.param(
            {"unet": pair("blk.to_q", 4, 24, 16)}, "expects lora_A 4x16", id="wrong-fan-in"
        ),
        pytest.param({"unet": pair("blk.to_q", 4, 16, 32)}, "expects", id="wider-than-base"),
        pytest.param(
            {"unet": {"blk.to_q.lora_A.weight": (4, 16)}}, "without its partner", id="missing-half"
        ),
        pytest.param(
            {"unet": pair("blk.to_q", 16, 16, 16)}, "exceeds --max-lora-rank 8", id="rank"
        ),
        pytest.param({"text_encoder": pair("enc.q_proj", 2, 48, 32)}, "expects", id="te-mismatch"),
        pytest.param(
            {
                "unet": {
                    "blk.proj.lora_A.weight": (4, 8, 1, 1),
                    "blk.proj.lora_B.weight": (16, 4, 1, 1),
                }
            },
            "expects lora_A 4x8x3x3",
            id="conv-kernel",
        ),
        pytest.param({"unet": {"blk.to_q.weight": (16, 16)}}, "not a LoRA weight", id="not-lora"),
        pytest.param({"unet": {}}, "no LoRA pairs", id="empty"),
    ],
)
def test_misfits_are_refused_with_the_reason(adapter: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.IncompatibleAdapter, match=message):
        check_adapter_fits(adapter, MODEL, max_rank=8, name="x")


def test_alpha_entries_are_ignored() -> None:
    adapter = {"unet": {**pair("blk.to_q", 4, 16, 16), "blk.to_q.alpha": ()}}
    assert check_adapter_fits(adapter, MODEL, max_rank=8, name="x").rank == 4
