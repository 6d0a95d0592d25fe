"""The cost model (merging, fusing): pure, so tested with made-up rates and layers, exhaustively
where cheap."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_inference import costs

# Roughly a 2-core CPU: 25 us of Python per LoRA pass, 2 GMAC/s in skinny matmuls, a merge of
# one layer 30 us plus 20 GMAC/s for B @ A and 1 ns per weight element.
CPU = costs.Rates(
    lora_pass_s=25e-6,
    lora_mac_s=5e-10,
    merge_layer_s=30e-6,
    merge_mac_s=5e-11,
    merge_element_s=1e-9,
)
SPATIAL = costs.LayerRows(per_area=2.0, fixed=0.0, passes=1, per_step=True, uncond_factor=0.5)
TEXT = costs.LayerRows(per_area=0.0, fixed=154.0, passes=2, per_step=False, uncond_factor=0.5)


def layer(width: int, rows: costs.LayerRows | None = SPATIAL, rank: int = 32) -> costs.LayerLoad:
    return costs.LayerLoad(fan_in=width, fan_out=width, rank=rank, rows=rows)


def call(steps: int = 20, area: float = 64 * 64, images: int = 1) -> costs.Call:
    return costs.Call(images=images, steps=steps, latent_area=area, guided=True)


def test_narrow_high_resolution_layers_merge_and_wide_low_resolution_ones_do_not() -> None:
    # An SD 1.5 UNet's two ends at 8x8 latents: 320 wide at full latent resolution, 1280 wide
    # at an eighth of it in each direction.
    top = costs.LayerLoad(fan_in=320, fan_out=320, rank=32, rows=SPATIAL)
    deep_rows = costs.LayerRows(per_area=2 / 64, fixed=0.0, passes=1, per_step=True)
    deep = costs.LayerLoad(fan_in=1280, fan_out=1280, rank=32, rows=deep_rows)
    assert costs.plan_merge([top, deep], call(steps=4, area=8 * 8), CPU) == [True, False]
    # At 64x64 latents (512 pixels) the deep layer sees 64 times the rows and merges too.
    assert costs.plan_merge([top, deep], call(steps=4, area=64 * 64), CPU) == [True, True]


@pytest.mark.parametrize(
    ("steps", "expected"),
    [pytest.param(1, False, id="one-step"), pytest.param(50, True, id="fifty-steps")],
)
def test_a_merge_pays_once_enough_steps_share_it(steps: int, expected: bool) -> None:
    wide = layer(1280, costs.LayerRows(per_area=0.0, fixed=64.0, passes=1, per_step=True))
    assert costs.plan_merge([wide], call(steps=steps), CPU) == [expected]


def test_a_layer_calibration_never_saw_run_is_never_merged() -> None:
    assert costs.unmerged_seconds(layer(320, rows=None), call(), CPU) == 0.0
    assert costs.plan_merge([layer(320, rows=None)], call(), CPU) == [False]


def test_text_encoder_layers_run_once_per_call_whatever_the_steps() -> None:
    text = layer(768, TEXT)
    assert costs.unmerged_seconds(text, call(steps=1), CPU) == costs.unmerged_seconds(
        text, call(steps=50), CPU
    )


def test_without_guidance_rows_follow_the_calibrated_factor() -> None:
    guided = costs.Call(images=2, steps=4, latent_area=256, guided=True)
    unguided = costs.Call(images=2, steps=4, latent_area=256, guided=False)
    no_fixed = costs.Rates(0.0, 1e-9, 0.0, 0.0, 0.0)
    half = costs.unmerged_seconds(layer(64), unguided, no_fixed)
    assert half == pytest.approx(costs.unmerged_seconds(layer(64), guided, no_fixed) / 2)


@given(
    width=st.integers(8, 4096),
    rank=st.integers(1, 128),
    area=st.floats(1, 128 * 128),
    images=st.integers(1, 8),
    steps=st.integers(1, 100),
)
def test_more_steps_or_images_never_turn_a_merge_into_no_merge(
    width: int, rank: int, area: float, images: int, steps: int
) -> None:
    load = layer(width, rank=rank)
    before = costs.plan_merge([load], call(steps, area, images), CPU)[0]
    after = costs.plan_merge([load], call(steps + 1, area, images + 1), CPU)[0]
    assert after or not before


def test_rows_are_fitted_from_the_three_calibration_calls() -> None:
    small = {"unet.a": (128, 1), "unet.k": (154, 1), "te.q": (154, 2)}
    large = {"unet.a": (256, 1), "unet.k": (154, 1), "te.q": (154, 2)}
    unguided = {"unet.a": (64, 1), "unet.k": (77, 1), "te.q": (77, 1)}
    fitted = costs.fit_rows(
        small, large, unguided, areas=(64, 128), per_step={"unet.a": True, "unet.k": True}
    )
    assert fitted["unet.a"] == costs.LayerRows(2.0, 0.0, 1, True, 0.5)
    assert fitted["unet.k"] == costs.LayerRows(0.0, 154.0, 1, True, 0.5)
    assert fitted["te.q"] == costs.LayerRows(0.0, 154.0, 2, False, 0.5)
    assert fitted["unet.a"].rows(100, guided=True) == 200.0


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        pytest.param([(0, 1.0), (10, 21.0)], (1.0, 2.0), id="exact"),
        pytest.param([(0, 5.0), (10, 1.0)], (3.0, 0.0), id="negative-slope-is-noise"),
        pytest.param([(10, 1.0), (20, 5.0)], (0.0, 0.4), id="negative-intercept-is-noise"),
    ],
)
def test_lines_are_fitted_and_noise_cannot_make_a_cost_negative(
    points: list[tuple[float, float]], expected: tuple[float, float]
) -> None:
    assert costs.fit_line(points) == pytest.approx(expected)


def test_a_line_needs_two_distinct_points() -> None:
    with pytest.raises(ValueError, match="two"):
        costs.fit_line([(1, 1.0)])
    with pytest.raises(ValueError, match="two different"):
        costs.fit_line([(1, 1.0), (1, 2.0)])


# -- fusing the branches of a batch that mixes adapters ------------------------------------------


@pytest.mark.parametrize("policy", ["auto", "always", "never"])
def test_a_merged_only_adapter_is_merged_whatever_the_policy_says(
    policy: costs.MergePolicy,
) -> None:
    """Its whole-matrix deltas have no unmerged form: `--merge never` cannot run it as a branch."""
    assert costs.policy_for(policy, merged_only=True) == "always"
    assert costs.policy_for(policy, merged_only=False) == policy
