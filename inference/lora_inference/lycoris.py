"""LyCORIS modules (LoCon with Tucker, LoHa, LoKr with a factored w2) and plain kohya pairs as
exact pairs, each module's scale folded into its up factor, in float64 (pure; any thread).

The mathematics, and the test that holds each to its format's definition, are in
docs/adapters.md; `formats` decides which files are folded here and serves them at scaling 1.
Imports torch only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from lora_volume import formats

from lora_inference import errors

Tensors = dict[str, torch.Tensor]

SUFFIXES = (
    ".lora_down.weight",
    ".lora_up.weight",
    ".lora_mid.weight",
    ".alpha",
    ".hada_w1_a",
    ".hada_w1_b",
    ".hada_w2_a",
    ".hada_w2_b",
    ".lokr_w1",
    ".lokr_w1_a",
    ".lokr_w1_b",
    ".lokr_w2_a",
    ".lokr_w2_b",
)


def to_folded_pairs(tensors: Tensors, fmt: formats.Format, *, name: str) -> Tensors:
    """`tensors` with every module, LyCORIS or plain pair, replaced by a kohya pair of the same
    delta with the module's scale folded into its up factor (pure). Float64."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out: Tensors = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            out[key] = tensor
            continue
        modules.setdefault(key.removesuffix(suffix), {})[suffix.lstrip(".")] = tensor
    for module, parts in modules.items():
        try:
            pair = _module_pair(parts)
        except KeyError as e:
            raise _bad(name, fmt, f"module {module!r} lacks its tensor {e}") from e
        except (RuntimeError, ValueError) as e:
            raise _bad(name, fmt, f"module {module!r} is not a well-formed one: {e}") from e
        if pair is None:
            if "lora_down.weight" not in parts:  # an alpha without its pair: nothing to serve
                continue
            pair = _plain_pair(parts)
        down, up = _full_rank_if_narrower(*pair)
        out[f"{module}.lora_down.weight"] = down
        out[f"{module}.lora_up.weight"] = up
    return out


def module_delta(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One module's delta at scale 1, its scale folded in, as (fan_out, fan_in), in float64: a
    LyCORIS module's (as `to_folded_pairs` reads it) or a plain pair's (pure). Raises KeyError
    for a missing tensor, RuntimeError or ValueError for shapes that do not fit."""
    down, up, scale = _module_pair(parts) or _plain_pair(parts)
    return scale * up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)


def _plain_pair(parts: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(down, up, alpha / rank) of a kohya pair, in float64."""
    f64 = {k: v.to(torch.float64) for k, v in parts.items()}
    rank = f64["lora_down.weight"].shape[0]
    alpha = float(f64["alpha"]) if "alpha" in f64 else rank
    return f64["lora_down.weight"], f64["lora_up.weight"], alpha / rank


def _module_pair(
    parts: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(down, up, scale) of one LyCORIS module, delta = scale x up @ down (flattened), or None
    for a plain pair. The scale is the format's alpha / dim (1 without an alpha)."""
    f64 = {k: v.to(torch.float64) for k, v in parts.items()}
    alpha = float(f64["alpha"]) if "alpha" in f64 else None
    if "lora_mid.weight" in f64:
        down, mid = f64["lora_down.weight"], f64["lora_mid.weight"]
        # a 1x1 down, then mid (r x r x kh x kw): one kh x kw conv from the input.
        folded = torch.einsum("pqhw,qi->pihw", mid, down.reshape(down.shape[0], -1))
        rank = down.shape[0]
        return folded, f64["lora_up.weight"], (alpha if alpha is not None else rank) / rank
    if "hada_w1_a" in f64:
        u1, v1 = f64["hada_w1_a"], f64["hada_w1_b"].reshape(f64["hada_w1_b"].shape[0], -1)
        u2, v2 = f64["hada_w2_a"], f64["hada_w2_b"].reshape(f64["hada_w2_b"].shape[0], -1)
        # (U1 V1) * (U2 V2) = sum over (p, q) of (U1[:, p] * U2[:, q]) (V1[p] * V2[q]).
        up = (u1[:, :, None] * u2[:, None, :]).reshape(u1.shape[0], -1)
        down = (v1[:, None, :] * v2[None, :, :]).reshape(-1, v1.shape[1])
        rank = v1.shape[0]
        return down, up, (alpha if alpha is not None else rank) / rank
    if "lokr_w2_a" in f64:
        w1 = f64["lokr_w1"] if "lokr_w1" in f64 else f64["lokr_w1_a"] @ f64["lokr_w1_b"]
        w2a, w2b = f64["lokr_w2_a"], f64["lokr_w2_b"].reshape(f64["lokr_w2_b"].shape[0], -1)
        if w1.dim() != 2 or w2a.dim() != 2:
            raise ValueError(f"LoKr factors must be matrices, got w1 {tuple(w1.shape)}")
        a, c = w1.shape
        if c <= a:  # kron(W1, U V) = kron(W1, U) @ kron(I_c, V): rank c x r
            up, down = torch.kron(w1, w2a), torch.kron(torch.eye(c, dtype=w1.dtype), w2b)
        else:  # = kron(I_a, U) @ kron(W1, V): rank a x r
            up, down = torch.kron(torch.eye(a, dtype=w1.dtype), w2a), torch.kron(w1, w2b)
        dim = w2b.shape[0]
        return down, up, (alpha / dim if alpha is not None else 1.0)
    if any(k.startswith(("hada_", "lokr_")) for k in f64):
        raise ValueError(f"it holds {sorted(f64)}, not a complete set of factors")
    return None


def _full_rank_if_narrower(
    down: torch.Tensor, up: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down, scale x up) at rank min(k, fan_in, fan_out): a product wider than its layer is
    stored as the layer's full delta and an identity, the same delta at a smaller rank."""
    k = down.shape[0]
    fan_in = down[0].numel()
    up = up.reshape(up.shape[0], -1) * scale
    if k <= min(fan_in, up.shape[0]):
        return down, up
    delta = up @ down.reshape(k, -1)
    if fan_in <= up.shape[0]:
        eye = torch.eye(fan_in, dtype=delta.dtype)
        return eye.reshape(fan_in, *down.shape[1:]), delta
    return delta.reshape(-1, *down.shape[1:]), torch.eye(up.shape[0], dtype=delta.dtype)


def _bad(name: str, fmt: formats.Format, why: str) -> errors.IncompatibleAdapter:
    return errors.IncompatibleAdapter(f"adapter {name!r} ({fmt.label}): {why}", param="lora_path")
