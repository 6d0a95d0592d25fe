"""Does an adapter fit this base model? Decided from shapes alone, before the pipeline is touched.

Purely computational: it compares the tensor shapes of an adapter (already converted to peft key
names, grouped by pipeline component) with a table of the base model's layer shapes taken once at
start-up. Checking here, rather than letting diffusers find out half-way through a load, is what
keeps a rejected adapter from leaving partial state behind (see docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lora_inference import errors


@dataclass(frozen=True)
class LayerShape:
    """A Linear layer (`kernel` is None) or a Conv2d layer of the base model."""

    in_features: int
    out_features: int
    kernel: tuple[int, ...] | None = None


# component name ("unet", "text_encoder", ...) -> module path -> shape
ModelShapes = Mapping[str, Mapping[str, LayerShape]]
# component name -> peft key ("<module>.lora_A.weight") -> tensor shape
AdapterShapes = Mapping[str, Mapping[str, tuple[int, ...]]]


@dataclass(frozen=True)
class AdapterSummary:
    rank: int
    components: tuple[str, ...]
    layers: int


def _fail(name: str, why: str) -> errors.IncompatibleAdapter:
    return errors.IncompatibleAdapter(
        f"adapter {name!r} does not fit this model: {why}", param="lora_path"
    )


def _split(key: str) -> tuple[str, str]:
    """'a.b.to_q.lora_A.weight' -> ('a.b.to_q', 'A')."""
    for half in ("A", "B"):
        marker = f".lora_{half}."
        if marker in key:
            return key.split(marker, 1)[0], half
    raise ValueError(key)


def check_adapter_fits(
    adapter: AdapterShapes, model: ModelShapes, *, max_rank: int, name: str
) -> AdapterSummary:
    """Check every LoRA pair against the layer it targets; return the adapter's rank.

    Refuses (IncompatibleAdapter, 422): components the model lacks, modules it lacks, layers that
    are neither Linear nor Conv2d, halves without a partner, shapes that disagree with the base
    layer (which is how an adapter for another architecture or a wider Flux LoRA shows up), ranks
    above `max_rank`.
    """
    rank = 0
    layers = 0
    for component, tensors in adapter.items():
        if component not in model:
            have = ", ".join(sorted(model))
            raise _fail(name, f"it targets '{component}', which this model lacks (it has {have})")
        pairs: dict[str, dict[str, tuple[int, ...]]] = {}
        for key, shape in tensors.items():
            if key.endswith(".alpha"):
                continue
            try:
                module, half = _split(key)
            except ValueError:
                raise _fail(name, f"'{component}.{key}' is not a LoRA weight") from None
            pairs.setdefault(module, {})[half] = shape
        for module, halves in sorted(pairs.items()):
            where = f"{component}.{module}"
            base = model[component].get(module)
            if base is None:
                raise _fail(name, f"it targets '{where}', which this model does not have")
            if set(halves) != {"A", "B"}:
                raise _fail(name, f"'{where}' has lora_{''.join(halves)} without its partner")
            r = _check_pair(name, where, base, halves["A"], halves["B"])
            if r > max_rank:
                raise _fail(name, f"its rank {r} at '{where}' exceeds --max-lora-rank {max_rank}")
            rank = max(rank, r)
            layers += 1
    if layers == 0:
        raise _fail(name, "it holds no LoRA pairs")
    return AdapterSummary(rank=rank, components=tuple(sorted(adapter)), layers=layers)


def _check_pair(
    name: str, where: str, base: LayerShape, down: tuple[int, ...], up: tuple[int, ...]
) -> int:
    if base.kernel is None:
        expected_down: tuple[int, ...] = (down[0] if down else 0, base.in_features)
        expected_up: tuple[int, ...] = (base.out_features, down[0] if down else 0)
    else:
        r = down[0] if down else 0
        expected_down = (r, base.in_features, *base.kernel)
        expected_up = (base.out_features, r, 1, 1)
    if len(down) < 1 or down != expected_down or up != expected_up:
        raise _fail(
            name,
            f"'{where}' expects lora_A {_fmt(expected_down)} and lora_B {_fmt(expected_up)} "
            f"for a layer of {base.in_features} -> {base.out_features}, "
            f"got {_fmt(down)} and {_fmt(up)}",
        )
    if down[0] == 0:
        raise _fail(name, f"'{where}' has rank 0")
    return down[0]


def _fmt(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"
