"""Calibration of the merge cost model (`costs`): what each layer sees per call, and how fast
this device runs a LoRA branch and a merge.

Runs on the pipeline thread, once, before any adapter is placed
(`pipeline.DiffusionBackend.calibrate`): it calls the pipeline and times probe layers of its own.
Imports torch; touches no adapter state.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from lora_inference import costs, formats
from lora_inference.adapters import validation
from lora_inference.backend import LayerKey
from lora_inference.slot_packing import LayerWeights
from lora_inference.slots import Slots


def measure_rows(
    pipe: Any,
    components: Sequence[str],
    shapes: Mapping[str, Mapping[str, validation.LayerShape]],
    *,
    vae_scale: int,
) -> dict[LayerKey, costs.LayerRows]:
    """Rows per layer: three calls of one image and one step with every Linear and Conv2d of
    the adaptable components counting the rows it sees (guided at two sizes, unguided at one)."""
    side = 8 * vae_scale  # 8 latent pixels: valid for every family's patching
    runs = [(side, side, 5.0), (side, 2 * side, 5.0), (side, side, 1.0)]
    seen: list[dict[str, tuple[int, int]]] = []
    for height, width, guidance in runs:
        counts: dict[str, tuple[int, int]] = {}
        with _counting_rows(pipe, components, shapes, counts):
            _generate_latents(pipe, height, width, guidance)
        seen.append(counts)
    area = (side / vae_scale) ** 2
    per_step = {f"{c}.{m}": c in formats.DENOISERS for c in components for m in shapes[c]}
    fitted = costs.fit_rows(*seen, areas=(area, 2 * area), per_step=per_step)
    rows: dict[LayerKey, costs.LayerRows] = {}
    for name, layer_rows in fitted.items():
        component, _, module = name.partition(".")
        rows[(component, module)] = layer_rows
    return rows


def _generate_latents(pipe: Any, height: int, width: int, guidance: float) -> None:
    with torch.inference_mode():
        pipe(
            prompt=["calibration"],
            num_inference_steps=1,
            height=height,
            width=width,
            guidance_scale=guidance,
            output_type="latent",
            generator=torch.Generator(device="cpu").manual_seed(0),
        )


@contextlib.contextmanager
def _counting_rows(
    pipe: Any,
    components: Sequence[str],
    shapes: Mapping[str, Mapping[str, validation.LayerShape]],
    counts: dict[str, tuple[int, int]],
) -> Iterator[None]:
    """Count (rows, passes) per layer while the block runs."""

    def counter(name: str, conv: bool) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not isinstance(output, torch.Tensor):
                return
            # A Linear's rows are all but its last dimension; a Conv2d's, its output positions.
            rows = output.numel() // output.shape[1 if conv else -1]
            before = counts.get(name, (0, 0))
            counts[name] = (before[0] + rows, before[1] + 1)

        return hook

    handles = []
    for component in components:
        model = getattr(pipe, component)
        for module_name, shape in shapes[component].items():
            module = model.get_submodule(module_name)
            handles.append(
                module.register_forward_hook(
                    counter(f"{component}.{module_name}", shape.kernel is not None)
                )
            )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def measure_rates(device: str, dtype: torch.dtype) -> costs.Rates:
    """Time the real operations on small probe layers of this device and dtype.

    Each figure is the fastest of a few samples: other work on the machine only ever adds
    time. The fixed costs come from layers so small that nothing else counts, the per-unit
    costs from layers big enough that the fixed part does not.
    """
    widths = {"tiny": 16, "wide": 512}
    probe = torch.nn.ModuleDict(
        {name: torch.nn.Linear(w, w, device=device, dtype=dtype) for name, w in widths.items()}
    )
    slots = Slots({"probe": probe}, count=1, max_rank=64)

    def place(name: str, rank: int) -> LayerKey:
        width, key = widths[name], ("probe", name)
        down = torch.randn(rank, width, device=device, dtype=dtype) / width
        up = torch.randn(width, rank, device=device, dtype=dtype) / rank
        slots.place("probe", {key: LayerWeights(down, up, alpha=rank, rslora=False)})
        return key

    def merge_seconds(name: str, rank: int, inner: int) -> float:
        key = place(name, rank)

        def merge_and_restore() -> None:
            with slots.call(["probe"], {"probe": 1.0}, merged=[key]):
                pass

        return _fastest_seconds(device, merge_and_restore, inner=inner)

    # A pass through a layer with its branch on, less the same pass with it off.
    place("tiny", 4)
    tiny = probe["tiny"]
    one_row = torch.randn(1, widths["tiny"], device=device, dtype=dtype)
    with slots.call(["probe"], {"probe": 1.0}):
        branch_on = _fastest_seconds(device, lambda: tiny(one_row), inner=50)
    lora_pass_s = max(0.0, branch_on - _fastest_seconds(device, lambda: tiny(one_row), inner=50))
    # The branch's own arithmetic on many rows.
    rank, width, rows = 16, widths["wide"], 1024
    key = place("wide", rank)
    a, b = slots.delta_factors("probe", key)
    x = torch.randn(rows, width, device=device, dtype=dtype)
    y = torch.randn(rows, width, device=device, dtype=dtype)

    def branch() -> object:
        return y + torch.nn.functional.linear(torch.nn.functional.linear(x, a) * 0.5, b)

    lora_mac_s = _fastest_seconds(device, branch, inner=5) / (rows * rank * 2 * width)
    merge_layer_s = merge_seconds("tiny", 4, inner=20)
    elements = width * width
    by_rank = [(r * elements, merge_seconds("wide", r, inner=3)) for r in (4, 64)]
    merge_intercept, merge_mac_s = costs.fit_line(by_rank)
    return costs.Rates(
        lora_pass_s=lora_pass_s,
        lora_mac_s=lora_mac_s,
        merge_layer_s=merge_layer_s,
        merge_mac_s=merge_mac_s,
        merge_element_s=max(0.0, merge_intercept - merge_layer_s) / elements,
    )


def _fastest_seconds(
    device: str, fn: Callable[[], object], *, inner: int, repeats: int = 5
) -> float:
    """Per call, the fastest of `repeats` samples of `inner` calls each."""
    cuda = device.startswith("cuda")

    def synchronize() -> None:
        if cuda:  # kernels run asynchronously; time them, not their launch
            torch.cuda.synchronize()

    samples = []
    with torch.inference_mode():
        fn()  # warm-up: allocator, kernels
        for _ in range(repeats):
            synchronize()
            started = time.perf_counter()
            for _ in range(inner):
                fn()
            synchronize()
            samples.append((time.perf_counter() - started) / inner)
    return min(samples)
