"""The merged path: a batch of one adapter runs with its delta merged into the base weights.

Merged images match the unmerged path to within one 8-bit level (the same sums, rounded in
another order); afterwards the base model is bit-identical to a pipeline that never held an
adapter, because every merged weight is restored from a pristine copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_inference.backend import ImageJob
from lora_inference.pipeline import DiffusionBackend

from tests.unit.inference.conftest import Assets, BatchShape, Reference, decode


async def images(server: Any, n: int, **body: Any) -> list[np.ndarray]:
    request = {"prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2, "seed": 3}
    status, payload = await server.post(
        "/v1/images/generations", {**request, **body, "n": n}, token=None
    )
    assert status == 200, payload
    return [decode(item["b64_json"]) for item in payload["data"]]


async def test_merged_images_are_within_one_level_of_the_unmerged_ones(
    start_server: Any, assets: Assets
) -> None:
    merged = await start_server(merge="always", max_loras=3)
    plain = await start_server(merge="never", max_loras=3)
    cases = [("a", assets.adapter_a, 1.0), ("b", assets.adapter_b, 1.0), ("k", assets.kohya, 0.7)]
    base = await images(plain, 1)
    calls = 0
    for name, path, scale in cases:
        await merged.load(name, path)
        await plain.load(name, path)
        for n in (1, 3):  # one image, and three in one call
            lora = {"name": name, "scale": scale}
            got = await images(merged, n, lora=lora)
            want = await images(plain, n, lora=lora)
            calls += 1
            for image, expected in zip(got, want, strict=True):
                assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1, name
                assert np.abs(image.astype(int) - base[0].astype(int)).mean() > 1, name
    assert merged.metric("lora_batches_total", path="merged") == calls
    assert plain.metric("lora_batches_total", path="adapter") == calls


@pytest.fixture(scope="module")
def merging(backend: DiffusionBackend, assets: Assets) -> Iterator[DiffusionBackend]:
    """The shared backend with three adapters in slots of their own, emptied afterwards."""
    for name, path in (("a", assets.adapter_a), ("b", assets.adapter_b), ("k", assets.kohya)):
        backend.place(f"merge-{name}", backend.parse_adapter(path, name=name, max_rank=64))
    yield backend
    for slot in backend.resident_keys():
        backend.clear(slot)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "k"]),
            st.sampled_from([1.0, 0.5, -1.5]),
            st.integers(1, 3),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_after_any_merged_calls_the_base_is_bit_identical_to_a_pristine_pipeline(
    merging: DiffusionBackend, reference: Reference, calls: list[tuple[str, float, int]]
) -> None:
    shape: BatchShape = {"width": 32, "height": 32, "steps": 2, "guidance_scale": 7.5}
    for adapter, scale, images_in_call in calls:
        slot = f"merge-{adapter}"
        job = ImageJob(prompt="x", negative_prompt=None, seeds=tuple(range(images_in_call)))
        outcome = merging.run_batch([job], [slot], {slot: scale}, merge="always", **shape)
        assert outcome.path == "merged" and outcome.merged_layers > 0
    base_job = ImageJob(prompt="a lighthouse", negative_prompt=None, seeds=(7,))
    base = merging.run_batch([base_job], [None], {}, **shape).images[0]
    assert np.array_equal(np.asarray(base.convert("RGB")), reference())


def test_calibration_counts_rows_for_every_layer_an_adapter_targets(
    merging: DiffusionBackend,
) -> None:
    rows = merging.calibrate().rows
    for slot in merging.resident_keys():
        for component, module in merging.slots.footprint(slot):
            seen = rows[(component, module)]
            if component == "text_encoder":  # once per call, whatever the image size
                assert (seen.per_step, seen.per_area, seen.fixed) == (False, 0.0, 154.0)
            elif module.endswith(("attn2.to_k", "attn2.to_v")):  # keys/values of the prompt
                assert (seen.per_step, seen.per_area) == (True, 0.0)
            else:  # the image's own positions: rows grow with the area
                assert seen.per_step and seen.per_area > 0
            assert seen.uncond_factor == 0.5  # guidance doubles every SD 1.5 batch
