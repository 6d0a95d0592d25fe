"""Adapter files in each format the inference server reads (LoCon, LoHa, LoKr under kohya's names
on SD 1.5 and SDXL, kohya and XLabs Flux, SD3 kohya, peft with biases), built on the tiny
pipelines with the delta each format defines per layer (float64), and `write` to save one.
Imports torch: for the inference tests only."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lora_inference.slots import LayerKey
from lora_inference.tools.random_adapters import build_random_lora
from safetensors.torch import save_file

Tensors = dict[str, torch.Tensor]
TARGET = 0.05  # each layer's delta, as a fraction of its weights' RMS: a trained adapter's size


@dataclass
class Made:
    """An adapter file's tensors and, per layer, the delta its format defines at scale 1."""

    tensors: Tensors
    reference: dict[LayerKey, torch.Tensor]
    bias_reference: dict[LayerKey, torch.Tensor] = dataclasses.field(default_factory=dict)
    metadata: dict[str, str] | None = None


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _alpha_for(weight: torch.Tensor, delta_at_alpha_dim: torch.Tensor, dim: int) -> float:
    """An alpha that makes the delta TARGET of the weights' RMS, rounded as a file stores it."""
    ratio = TARGET * weight.double().pow(2).mean().sqrt() / delta_at_alpha_dim.pow(2).mean().sqrt()
    return float(torch.tensor(dim * float(ratio), dtype=torch.float32))


def loha(weight: torch.Tensor, g: torch.Generator, rank: int = 3) -> tuple[Tensors, torch.Tensor]:
    out, fan_in = weight.shape[0], weight[0].numel()
    t = {
        f"hada_w{i}_{ab}": randn(g, *s)
        for i in (1, 2)
        for ab, s in (("a", (out, rank)), ("b", (rank, fan_in)))
    }
    f = {k: v.double() for k, v in t.items()}
    product = (f["hada_w1_a"] @ f["hada_w1_b"]) * (f["hada_w2_a"] @ f["hada_w2_b"])
    alpha = _alpha_for(weight, product, rank)
    t["alpha"] = torch.tensor(alpha)
    return t, (alpha / rank * product).reshape(weight.shape)


def _lokr_w1(t: Tensors, g: torch.Generator, *, a: int, c: int, w1_rank: int) -> torch.Tensor:
    """A LoKr's w1 (a x c) into `t`, full or factored at `w1_rank`; its value in float64."""
    if w1_rank:
        t["lokr_w1_a"], t["lokr_w1_b"] = randn(g, a, w1_rank), randn(g, w1_rank, c)
        return t["lokr_w1_a"].double() @ t["lokr_w1_b"].double()
    t["lokr_w1"] = randn(g, a, c)
    return t["lokr_w1"].double()


def lokr(
    weight: torch.Tensor, g: torch.Generator, *, a: int, c: int, rank: int = 2, w1_rank: int = 0
) -> tuple[Tensors, torch.Tensor]:
    out, cin, kernel = weight.shape[0], weight.shape[1], tuple(weight.shape[2:])
    b, d = out // a, cin // c
    t: Tensors = {
        "lokr_w2_a": randn(g, b, rank),
        "lokr_w2_b": randn(g, rank, d * math.prod(kernel)),
    }
    w1 = _lokr_w1(t, g, a=a, c=c, w1_rank=w1_rank)
    w2 = (t["lokr_w2_a"].double() @ t["lokr_w2_b"].double()).reshape(b, d, *kernel)
    product = torch.kron(w1.reshape(a, c, *(1 for _ in kernel)), w2)
    alpha = _alpha_for(weight, product, rank)
    t["alpha"] = torch.tensor(alpha)
    return t, alpha / rank * product


def locon_tucker(
    weight: torch.Tensor, g: torch.Generator, rank: int = 3
) -> tuple[Tensors, torch.Tensor]:
    out, cin, kh, kw = weight.shape
    t = {
        "lora_down.weight": randn(g, rank, cin, 1, 1),
        "lora_mid.weight": randn(g, rank, rank, kh, kw),
        "lora_up.weight": randn(g, out, rank, 1, 1),
    }
    f = {k: v.double() for k, v in t.items()}
    # up(mid(down(x))): three convolutions, composed.
    product = torch.einsum(
        "op,pqhw,qi->oihw",
        f["lora_up.weight"][:, :, 0, 0],
        f["lora_mid.weight"],
        f["lora_down.weight"][:, :, 0, 0],
    )
    alpha = _alpha_for(weight, product, rank)
    t["alpha"] = torch.tensor(alpha)
    return t, alpha / rank * product


def _sized(weight: torch.Tensor, delta: torch.Tensor, target: float = TARGET) -> float:
    """The factor that makes `delta` `target` of the weights' RMS."""
    return float(target * weight.double().pow(2).mean().sqrt() / delta.pow(2).mean().sqrt())


def lokr_full(
    weight: torch.Tensor,
    g: torch.Generator,
    *,
    a: int,
    c: int,
    w1_rank: int = 0,
    target: float = TARGET,
) -> tuple[Tensors, torch.Tensor]:
    """LoKr with a full w2 (b, d, *kernel): scale 1 with a full w1 (LyCORIS ignores alpha
    then), alpha / w1's rank with a factored one."""
    out, cin, kernel = weight.shape[0], weight.shape[1], tuple(weight.shape[2:])
    b, d = out // a, cin // c
    t: Tensors = {}
    w1 = _lokr_w1(t, g, a=a, c=c, w1_rank=w1_rank)
    w2 = randn(g, b, d, *kernel)
    product = torch.kron(w1.reshape(a, c, *(1 for _ in kernel)), w2.double())
    if w1_rank:
        t["lokr_w2"] = w2
        alpha = _alpha_for(weight, product, w1_rank)
        t["alpha"] = torch.tensor(alpha)
        return t, alpha / w1_rank * product
    t["lokr_w2"] = (w2 * _sized(weight, product, target)).float()
    t["alpha"] = torch.tensor(123.0)  # stored, and ignored: both factors are full
    return t, torch.kron(w1.reshape(a, c, *(1 for _ in kernel)), t["lokr_w2"].double())


def full_diff(
    weight: torch.Tensor, g: torch.Generator, target: float = TARGET
) -> tuple[Tensors, torch.Tensor]:
    """A `.diff` (LyCORIS full): the delta itself."""
    raw = randn(g, *weight.shape).double()
    diff = (raw * _sized(weight, raw, target)).float()
    return {"diff": diff}, diff.double()


def dora(build: Builder, *, axis: int, wobble: float = 0.1) -> Builder:
    """`build`'s module with a `dora_scale` (kohya / LyCORIS DoRA): magnitudes within `wobble` of
    the norms of W + ΔW per input channel (`axis` 1, LyCORIS's default) or per output row (`axis`
    0); the delta it defines is `W' - W`, `W' = m (W + ΔW) / |W + ΔW|`, against this base W."""

    def make(weight: torch.Tensor, g: torch.Generator) -> tuple[Tensors, torch.Tensor]:
        tensors, delta = build(weight, g)
        base = weight.double()
        adapted = base + delta.reshape(base.shape)
        dims = tuple(d for d in range(base.dim()) if d != axis)
        norm = torch.linalg.vector_norm(adapted, dim=dims, keepdim=True)
        noise = 2 * torch.rand(norm.shape, generator=g, dtype=torch.float64) - 1
        tensors["dora_scale"] = (norm * (1 + wobble * noise)).float()
        return tensors, tensors["dora_scale"].double() * adapted / norm - base

    return make


def with_bias_diffs(pipe: Any, made: Made, seed: int = 12) -> Made:
    """`made` (a kohya file) with a `.diff_b` beside each `.diff` whose layer has a bias."""
    g = torch.Generator().manual_seed(seed)
    for component, path in list(made.reference):
        module = getattr(pipe, component).get_submodule(path)
        stem = kohya_stem(component, path)
        if module.bias is None or f"{stem}.diff" not in made.tensors:
            continue
        bias = randn(g, module.bias.shape[0]) * 0.05
        made.tensors[f"{stem}.diff_b"] = bias
        made.bias_reference[(component, path)] = bias.double()
    return made


def plain(weight: torch.Tensor, g: torch.Generator, rank: int = 4) -> tuple[Tensors, torch.Tensor]:
    kernel = tuple(weight.shape[2:])
    ones = (1,) * len(kernel)
    t = {
        "lora_down.weight": randn(g, rank, weight.shape[1], *kernel),
        "lora_up.weight": randn(g, weight.shape[0], rank, *ones),
    }
    product = (
        t["lora_up.weight"].double().reshape(weight.shape[0], rank)
        @ t["lora_down.weight"].double().reshape(rank, -1)
    ).reshape(weight.shape)
    alpha = _alpha_for(weight, product, rank)
    t["alpha"] = torch.tensor(alpha)
    return t, alpha / rank * product


Builder = Callable[[torch.Tensor, torch.Generator], tuple[Tensors, torch.Tensor]]
_KOHYA = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}


def kohya_file(pipe: Any, choose: Callable[[str, str, torch.nn.Module], Builder | None]) -> Made:
    """A kohya-named file (SD 1.5, SDXL): each layer `choose` gives a builder for."""
    g = torch.Generator().manual_seed(0)
    made = Made({}, {})
    for component in ("unet", "text_encoder", "text_encoder_2"):
        model = getattr(pipe, component, None)
        if model is None:
            continue
        for path, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear | torch.nn.Conv2d):
                continue
            build = choose(component, path, module)
            if build is None:
                continue
            tensors, delta = build(module.weight.detach(), g)
            stem = kohya_stem(component, path)
            made.tensors.update({f"{stem}.{k}": v for k, v in tensors.items()})
            made.reference[(component, path)] = delta
    return made


def kohya_stem(component: str, path: str) -> str:
    """kohya's name for a layer of SD 1.5 or SDXL (diffusers' module path)."""
    # kohya names a text encoder's layers from text_model, however transformers nests it
    named = path if component == "unet" or path.startswith("text_model.") else f"text_model.{path}"
    return _KOHYA[component] + named.replace(".", "_")


def _is_conv3(m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.Conv2d) and tuple(m.kernel_size) == (3, 3)


def _attention(path: str) -> bool:
    return path.endswith(("to_q", "to_v", "to_out.0", "q_proj", "out_proj"))


def sd_locon(pipe: Any) -> Made:
    """LoCon as LyCORIS writes it: Tucker on the 3x3 convolutions, plain pairs elsewhere."""

    def choose(component: str, path: str, m: torch.nn.Module) -> Builder | None:
        if component == "unet" and _is_conv3(m) and "resnets" in path:
            return locon_tucker
        if _attention(path) or path.endswith("conv_shortcut"):
            return plain
        return None

    return kohya_file(pipe, choose)


def sd_loha(pipe: Any) -> Made:
    def choose(component: str, path: str, m: torch.nn.Module) -> Builder | None:
        if _attention(path) or (_is_conv3(m) and "resnets" in path) or path.endswith("proj_in"):
            return loha
        return None

    return kohya_file(pipe, choose)


def sd_lokr(pipe: Any, *, full_w2: bool = False) -> Made:
    """Both Kronecker orientations (c <= a and c > a), w1 full and factored, Linear and conv;
    `full_w2`: w2 a full matrix, as LyCORIS writes it for small layers (served merged only)."""
    count = iter(range(10**6))
    build: Callable[..., tuple[Tensors, torch.Tensor]] = lokr_full if full_w2 else lokr

    def choose(component: str, path: str, m: torch.nn.Module) -> Builder | None:
        if not (_attention(path) or (_is_conv3(m) and "resnets" in path)):
            return None
        i = next(count)
        a, c = (4, 2) if i % 2 else (2, 4)
        return lambda w, g: build(w, g, a=a, c=c, w1_rank=2 if i % 3 == 0 else 0)

    return kohya_file(pipe, choose)


def sd_lokr_full(pipe: Any) -> Made:
    return sd_lokr(pipe, full_w2=True)


def sd_lokr_mixed(pipe: Any) -> Made:
    """One LoKr file with a full w2 on the convolutions and a factored one on attention (as
    LyCORIS picks per layer): served merged only, its factored layers from a slot."""

    def choose(component: str, path: str, m: torch.nn.Module) -> Builder | None:
        if _is_conv3(m) and "resnets" in path:
            return lambda w, g: lokr_full(w, g, a=2, c=4)
        if _attention(path):
            return lambda w, g: lokr(w, g, a=4, c=2)
        return None

    return kohya_file(pipe, choose)


def sd_full(pipe: Any) -> Made:
    """LyCORIS full: `.diff` on attention, projections and convolutions, `.diff_b` beside
    each whose layer has a bias."""

    def choose(component: str, path: str, m: torch.nn.Module) -> Builder | None:
        if _attention(path) or path.endswith("proj_in") or (_is_conv3(m) and "resnets" in path):
            return full_diff
        return None

    return with_bias_diffs(pipe, kohya_file(pipe, choose))


def sd_dora(pipe: Any) -> Made:
    """kohya / LyCORIS DoRA: kohya pairs with a `dora_scale` per input channel on attention and
    convolutions, per output row on attention outputs, and a LoHa with one on projections."""

    def choose(component: str, path: str, m: torch.nn.Module) -> Builder | None:
        if path.endswith(("to_out.0", "out_proj")):
            return dora(plain, axis=0)
        if _attention(path) or (_is_conv3(m) and "resnets" in path):
            return dora(plain, axis=1)
        if path.endswith("proj_in"):
            return dora(loha, axis=1)
        return None

    return kohya_file(pipe, choose)


_FLUX_KOHYA = {  # kohya's Flux names -> diffusers' layers (a fused qkv splits into three)
    "lora_unet_double_blocks_0_img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "lora_unet_double_blocks_0_txt_attn_qkv": (
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
    ),
    "lora_unet_double_blocks_0_img_attn_proj": ("attn.to_out.0",),
    "lora_unet_single_blocks_0_linear2": ("proj_out",),
}


def _flux_layers(pipe: Any, stem: str) -> list[tuple[str, torch.Tensor]]:
    block = "single_transformer_blocks.0." if "single" in stem else "transformer_blocks.0."
    return [
        (block + p, pipe.transformer.get_submodule(block + p).weight.detach())
        for p in _FLUX_KOHYA[stem]
    ]


def flux_lycoris(builder: Builder) -> Callable[[Any], Made]:
    def make(pipe: Any) -> Made:
        g = torch.Generator().manual_seed(0)
        made = Made({}, {})
        for stem in _FLUX_KOHYA:
            layers = _flux_layers(pipe, stem)
            fused = torch.cat([w for _, w in layers])
            tensors, delta = builder(fused, g)
            made.tensors.update({f"{stem}.{k}": v for k, v in tensors.items()})
            for (path, _), part in zip(
                layers, torch.split(delta, [w.shape[0] for _, w in layers]), strict=True
            ):
                made.reference[("transformer", path)] = part
        return made

    return make


def flux_xlabs(pipe: Any) -> Made:
    """XLabs' names; no alphas (scale 1)."""
    g = torch.Generator().manual_seed(0)
    made = Made({}, {})
    names = {
        "qkv_lora1": _FLUX_KOHYA["lora_unet_double_blocks_0_img_attn_qkv"],
        "proj_lora1": ("attn.to_out.0",),
        "qkv_lora2": _FLUX_KOHYA["lora_unet_double_blocks_0_txt_attn_qkv"],
        "proj_lora2": ("attn.to_add_out",),
    }
    for name, paths in names.items():
        weights = [
            pipe.transformer.get_submodule(f"transformer_blocks.0.{p}").weight.detach()
            for p in paths
        ]
        fused = torch.cat(weights)
        down, up = randn(g, 4, fused.shape[1]) * 0.2, randn(g, fused.shape[0], 4) * 0.05
        made.tensors[f"double_blocks.0.processor.{name}.down.weight"] = down
        made.tensors[f"double_blocks.0.processor.{name}.up.weight"] = up
        delta = up.double() @ down.double()
        for p, part in zip(paths, torch.split(delta, [w.shape[0] for w in weights]), strict=True):
            made.reference[("transformer", f"transformer_blocks.0.{p}")] = part
    return made


_SD3_KOHYA = {  # sd-scripts' SD 3 names -> diffusers' layers in the (only, so last) block
    "lora_unet_joint_blocks_0_x_block_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "lora_unet_joint_blocks_0_context_block_attn_qkv": (
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
    ),
    "lora_unet_joint_blocks_0_x_block_attn_proj": ("attn.to_out.0",),
    "lora_unet_joint_blocks_0_x_block_mlp_fc1": ("ff.net.0.proj",),
    "lora_unet_joint_blocks_0_context_block_adaLN_modulation_1": ("norm1_context.linear",),
}


def sd3_kohya(builder: Builder) -> Callable[[Any], Made]:
    """A kohya-named SD 3 file. The last block's context modulation is stored with its shift and
    scale halves in SD 3's own order, which diffusers' layer swaps."""

    def make(pipe: Any) -> Made:
        g = torch.Generator().manual_seed(0)
        made = Made({}, {})
        for stem, paths in _SD3_KOHYA.items():
            weights = [
                pipe.transformer.get_submodule(f"transformer_blocks.0.{p}").weight.detach()
                for p in paths
            ]
            fused = torch.cat(weights)
            if "adaLN" in stem:  # the base rows in the file's order (a DoRA norms them)
                fused = torch.cat(list(reversed(fused.chunk(2))))
            tensors, delta = builder(fused, g)
            made.tensors.update({f"{stem}.{k}": v for k, v in tensors.items()})
            if "adaLN" in stem:
                shift, scale = delta.chunk(2)
                delta = torch.cat([scale, shift])
            for path, part in zip(
                paths, torch.split(delta, [w.shape[0] for w in weights]), strict=True
            ):
                made.reference[("transformer", f"transformer_blocks.0.{path}")] = part
        q_proj = "text_model.encoder.layers.0.self_attn.q_proj"
        tensors, delta = builder(pipe.text_encoder.get_submodule(q_proj).weight.detach(), g)
        stem = "lora_te1_" + q_proj.replace(".", "_")
        made.tensors.update({f"{stem}.{k}": v for k, v in tensors.items()})
        made.reference[("text_encoder", q_proj)] = delta
        return made

    return make


def peft_with_biases(pipe: Any) -> Made:
    """peft's lora_bias: B carries a bias, scaled with it by alpha / r (here 2 / 4)."""
    denoiser = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    tensors = build_random_lora(pipe, seed=7, strength=0.2)
    g = torch.Generator().manual_seed(8)
    made = Made(tensors, {})
    for key in list(tensors):
        if not key.endswith("lora_B.weight"):
            continue
        module = key.removesuffix(".lora_B.weight")
        bias = randn(g, tensors[key].shape[0]) * 0.3
        tensors[f"{module}.lora_B.bias"] = bias
        down, up = tensors[f"{module}.lora_A.weight"].double(), tensors[key].double()
        layer = (denoiser, module.removeprefix(f"{denoiser}."))
        made.reference[layer] = 0.5 * up @ down
        made.bias_reference[layer] = 0.5 * bias.double()
    config: dict[str, Any] = {"r": 4, "lora_alpha": 2, "lora_bias": True}
    config["target_modules"] = sorted({k.split(".lora_")[0].split(".", 1)[1] for k in tensors})
    made.metadata = {
        "lora_adapter_metadata": json.dumps({f"{denoiser}.{k}": v for k, v in config.items()})
    }
    return made


def write(path: Path, tensors: Tensors, metadata: dict[str, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path
