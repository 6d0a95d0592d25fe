"""The full-size benchmark architectures really are SDXL- and SD 1.5-sized (built on `meta`)."""

from __future__ import annotations

from typing import Any

import pytest
from lora_inference.tools.full_size import build_sd15_components, build_sdxl_components

# Parameter counts of stabilityai/stable-diffusion-xl-base-1.0's and
# stable-diffusion-v1-5/stable-diffusion-v1-5's networks.
SDXL_PARAMETERS = {
    "unet": 2_567_463_684,
    "vae": 83_653_863,
    "text_encoder": 123_060_480,
    "text_encoder_2": 694_659_840,
}
SD15_PARAMETERS = {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        pytest.param(build_sdxl_components, SDXL_PARAMETERS, id="sdxl"),
        pytest.param(build_sd15_components, SD15_PARAMETERS, id="sd15"),
    ],
)
def test_networks_have_the_real_sizes(build: Any, expected: dict[str, int]) -> None:
    networks = build("meta")
    counts = {name: sum(p.numel() for p in net.parameters()) for name, net in networks.items()}
    assert counts == expected
