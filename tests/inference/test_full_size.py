"""The full-size SDXL architecture for GPU benchmarks really is SDXL-sized (built on `meta`)."""

from __future__ import annotations

from lora_inference.tools.full_size import build_sdxl_components

# Parameter counts of stabilityai/stable-diffusion-xl-base-1.0's networks.
SDXL_PARAMETERS = {
    "unet": 2_567_463_684,
    "vae": 83_653_863,
    "text_encoder": 123_060_480,
    "text_encoder_2": 694_659_840,
}


def test_networks_have_sdxl_base_sizes() -> None:
    networks = build_sdxl_components("meta")
    counts = {name: sum(p.numel() for p in net.parameters()) for name, net in networks.items()}
    assert counts == SDXL_PARAMETERS
