"""What a call's LoRA layers cost each way they can run, and which way to take, layer by layer.

Purely computational: no torch, no clock. The pipeline measures the inputs once at start-up
(`pipeline.DiffusionBackend.calibrate`): how fast this device runs a LoRA branch and a merge, and
how many rows each layer sees per image for a given image size. The engine asks `plan_merge` for
every batch that uses a single adapter, so the same batch always gets the same answer (a request
alone in its batch stays bit-reproducible).

Left unmerged, a LoRA layer costs on every pass a fixed overhead (a few kernel launches and, on a
CPU, Python) plus work proportional to rows x rank x (fan-in + fan-out). Merged, it costs once per
call a fixed overhead plus the delta B @ A (rank x fan-in x fan-out) and two passes over the weight
(the add, and the restore from the pristine copy). High-resolution layers see many rows and are
narrow, so they merge; deep, wide layers see few rows and stay unmerged.

A batch that mixes adapters has nothing to decide here: it runs every image's branch in one
gathered pass per layer (`slots.Slots.call`), whatever the number of adapters. Nor does a batch of
a merged-only adapter (LoKr with a full w2, `.diff` files, kohya / LyCORIS DoRA): its
whole-matrix deltas have no unmerged form, so it is merged on every layer whatever the policy
says (`policy_for`), and the scheduler gives it batches of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

# auto: merge the layers where plan_merge says it pays; always / never: every layer / none.
MergePolicy = Literal["auto", "always", "never"]


@dataclass(frozen=True)
class Rates:
    """Seconds per unit of work on this device, in the model's dtype (measured at start-up)."""

    lora_pass_s: float  # fixed cost of one pass through a LoRA branch
    lora_mac_s: float  # per multiply-accumulate inside a LoRA branch
    merge_layer_s: float  # fixed cost of merging and restoring one layer
    merge_mac_s: float  # per multiply-accumulate of the delta B @ A
    merge_element_s: float  # per weight element (the add and the restore)


@dataclass(frozen=True)
class LayerRows:
    """Rows one layer sees per image and pass, as an affine function of the latent area.

    Spatial layers scale with the image; layers fed by the text (cross-attention keys and values,
    the text encoders) do not. `uncond_factor` is how the rows change when the call runs without
    classifier-free guidance (0.5 for the Stable Diffusion families, 1 for Flux).
    """

    per_area: float
    fixed: float
    passes: int  # passes through the layer per step (denoiser) or per call (text encoders)
    per_step: bool  # a denoiser layer: it runs once per step
    uncond_factor: float = 1.0

    def rows(self, latent_area: float, *, guided: bool) -> float:
        rows = max(0.0, self.per_area * latent_area + self.fixed)
        return rows if guided else rows * self.uncond_factor


@dataclass(frozen=True)
class LayerLoad:
    """One layer of the adapter in the batch, as the cost model needs it."""

    fan_in: int  # in_features x kernel elements
    fan_out: int
    rank: int
    rows: LayerRows | None  # None: calibration never saw the layer run


@dataclass(frozen=True)
class Call:
    images: int
    steps: int
    latent_area: float
    guided: bool  # classifier-free guidance doubles the rows of the Stable Diffusion families


def fit_rows(
    small: Mapping[str, tuple[int, int]],
    large: Mapping[str, tuple[int, int]],
    unguided: Mapping[str, tuple[int, int]],
    *,
    areas: tuple[float, float],
    per_step: Mapping[str, bool],
) -> dict[str, LayerRows]:
    """Fit `LayerRows` per layer from three calibration calls of one image and one step.

    Each mapping gives, per layer, (rows, passes) seen in one call: guided at the two latent
    areas in `areas`, and unguided at the first. A layer absent from a call saw no rows in it.
    """
    small_area, large_area = areas
    fitted: dict[str, LayerRows] = {}
    for layer, (rows_small, passes) in small.items():
        rows_large = large.get(layer, (rows_small, passes))[0]
        per_area = (rows_large - rows_small) / (large_area - small_area)
        rows_unguided = unguided.get(layer, (0, 0))[0]
        fitted[layer] = LayerRows(
            per_area=per_area,
            fixed=rows_small - per_area * small_area,
            passes=passes,
            per_step=per_step.get(layer, False),
            uncond_factor=rows_unguided / rows_small if rows_small else 1.0,
        )
    return fitted


def _over_call(rows: LayerRows, call: Call) -> tuple[int, float]:
    """A layer's passes over one call, and the rows it sees per image over them."""
    repeat = call.steps if rows.per_step else 1
    return repeat * rows.passes, rows.rows(call.latent_area, guided=call.guided) * repeat


def unmerged_seconds(layer: LayerLoad, call: Call, rates: Rates) -> float:
    """What the LoRA branch of `layer` costs over one call."""
    if layer.rows is None:
        return 0.0
    passes, rows = _over_call(layer.rows, call)
    macs = call.images * rows * layer.rank * (layer.fan_in + layer.fan_out)
    return passes * rates.lora_pass_s + macs * rates.lora_mac_s


def merged_seconds(layer: LayerLoad, rates: Rates) -> float:
    """What merging `layer` for one call and restoring it afterwards costs."""
    elements = layer.fan_in * layer.fan_out
    return (
        rates.merge_layer_s
        + layer.rank * elements * rates.merge_mac_s
        + elements * rates.merge_element_s
    )


def policy_for(policy: MergePolicy, *, merged_only: bool) -> MergePolicy:
    """The policy a single-adapter batch runs under: `policy`, except that a merged-only adapter
    is always merged (`--merge never` included: it cannot run as a branch)."""
    return "always" if merged_only else policy


def plan_merge(layers: Sequence[LayerLoad], call: Call, rates: Rates) -> list[bool]:
    """For each layer of a single-adapter batch: merge it for this call?

    Each layer is decided on its own: merging one layer does not change what the others cost.
    """
    return [merged_seconds(layer, rates) < unmerged_seconds(layer, call, rates) for layer in layers]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through (x, seconds) points; both kept >= 0.

    A negative intercept or slope is measurement noise on a busy machine, not a property of the
    device, and would make the cost model prefer whatever it multiplies.
    """
    n = len(points)
    if n < 2:
        raise ValueError("fitting a line needs at least two points")
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        raise ValueError("fitting a line needs points at two different x")
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)
    return max(0.0, mean_y - slope * mean_x), slope
