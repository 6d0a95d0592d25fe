"""Hostile safetensors files whose header costs memory or a crash to parse naively, and the
realistic large headers the limits must keep accepting. Each bomb is what a tenant could publish
as an adapter: the volume's tests refuse them one by one, the operator's measure the memory a
staging spends refusing them, the server's load them over HTTP."""

from __future__ import annotations

import json
import random
import string
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lora_volume import files

MIB = 1024 * 1024
OLD_MAX_HEADER_BYTES = 64 * MIB  # what a header could declare before the limit


def safetensors_file(header: bytes, data: bytes = b"") -> bytes:
    """A file of `header` (its length declared in front of it, as the format says) and `data`."""
    return struct.pack("<Q", len(header)) + header + data


def _filled(prefix: bytes, unit: bytes, suffix: bytes, size: int) -> bytes:
    """`prefix`, `unit` repeated, `suffix`: `size` bytes at most."""
    return prefix + unit * ((size - len(prefix) - len(suffix)) // len(unit)) + suffix


def list_bomb(size: int) -> bytes:
    """`{"x": [[], [], ...]}`: nesting 3 deep like a real header's shapes, and one list object
    (56 bytes and a pointer) for every 3 bytes; json.loads builds ~25x the text."""
    return _filled(b'{"x":[', b"[],", b"[]]}", size)


def nesting_bomb(depth: int) -> bytes:
    """`[[[[...]]]]`: json.loads raises RecursionError."""
    return b"[" * depth + b"]" * depth


def long_number(digits: int) -> bytes:
    """A shape with a `digits`-digit dimension: json.loads raises ValueError past 4300."""
    return b'{"t":{"dtype":"F32","shape":[' + b"1" * digits + b'],"data_offsets":[0,4]}}'


def huge_string(size: int) -> bytes:
    """One metadata value filling `size` bytes, with one character outside the BMP, so that
    Python holds it at 4 bytes a character: the costliest string a header of `size` can hold."""
    return _filled(b'{"__metadata__":{"x":"\\ud83d\\ude00', b"a", b'"}}', size)


@dataclass(frozen=True)
class Bomb:
    name: str
    build: Callable[[], bytes]  # the whole file
    message: str  # what the refusal says (a fragment)


def bombs() -> list[Bomb]:
    """The attacks, each as large as it may be: at the old 64 MiB declaration, or just under
    the limit when the limit refuses the larger one by its length alone."""
    under = files.MAX_HEADER_BYTES - 64
    return [
        Bomb(
            "list-bomb-64MiB",
            lambda: safetensors_file(list_bomb(OLD_MAX_HEADER_BYTES - 8)),
            "over the limit of 8388608",
        ),
        Bomb(
            "list-bomb-under-the-limit",
            lambda: safetensors_file(list_bomb(under)),
            "holds more than 250000 values",
        ),
        Bomb(
            "nesting-bomb",
            lambda: safetensors_file(nesting_bomb(under // 2)),
            "nests deeper than 3 levels",
        ),
        Bomb("long-number", lambda: safetensors_file(long_number(5000)), "5000 characters long"),
        Bomb(
            "huge-string",
            lambda: safetensors_file(huge_string(under)),
            "holds no tensors",
        ),
        Bomb(
            "header-longer-than-the-file",
            lambda: struct.pack("<Q", OLD_MAX_HEADER_BYTES - 8) + b'{"x":[' + b"[]," * 1000,
            "more than the 3014-byte file holds",
        ),
    ]


def write_bomb(folder: Path, bomb: Bomb) -> Path:
    path = folder / f"{bomb.name}.safetensors"
    path.write_bytes(bomb.build())
    return path


# Realistic large headers, built in code: what the limits were chosen against (files.py).


def kohya_metadata(tags: int, *, images: int = 4000, thumbnail_bytes: int = 0) -> dict[str, str]:
    """The metadata kohya's sd-scripts writes, for a dataset captioned with `tags` distinct
    tags (its tag frequency twice: alone and inside ss_datasets), and a thumbnail in
    modelspec's (a base64 data URI) when `thumbnail_bytes` is given."""
    rng = random.Random(0)
    frequency = {
        "10_subject": {
            "_".join(
                "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))
                for _ in range(rng.randint(1, 3))
            ): rng.randint(1, images)
            for _ in range(tags)
        }
    }
    buckets = {
        "buckets": {
            str(i): {"resolution": [64 * i, 64 * (32 - i)], "count": 100} for i in range(40)
        }
    }
    datasets = [
        {
            "is_dreambooth": True,
            "batch_size_per_device": 4,
            "num_train_images": images,
            "resolution": [1024, 1024],
            "enable_bucket": True,
            "tag_frequency": frequency,
            "bucket_info": buckets,
            "subsets": [{"img_count": images, "num_repeats": 10, "image_dir": "subject"}],
        }
    ]
    metadata = {
        f"ss_{key}": str(value)
        for key, value in {
            "session_id": 123,
            "training_started_at": 1.7e9,
            "output_name": "subject",
            "learning_rate": 1e-4,
            "unet_lr": 1e-4,
            "text_encoder_lr": 5e-5,
            "num_train_images": images,
            "num_epochs": 10,
            "max_train_steps": 10000,
            "lr_scheduler": "cosine",
            "network_module": "networks.lora",
            "network_dim": 128,
            "network_alpha": 128,
            "mixed_precision": "bf16",
            "optimizer": "AdamW8bit",
            "seed": 42,
            "new_sd_model_hash": "ab" * 32,
            "network_args": json.dumps({"train_blocks": "all", "train_t5xxl": "True"}),
        }.items()
    }
    metadata["ss_tag_frequency"] = json.dumps(frequency)
    metadata["ss_datasets"] = json.dumps(datasets)
    metadata["ss_bucket_info"] = json.dumps(buckets)
    metadata["modelspec.sai_model_spec"] = "1.0.0"
    metadata["modelspec.trigger_phrase"] = "subject, 1girl"
    if thumbnail_bytes:
        digits = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(64))
        metadata["modelspec.thumbnail"] = "data:image/jpeg;base64," + digits * (
            thumbnail_bytes * 4 // 3 // 64
        )
    return metadata


Module = tuple[str, int, int]  # kohya name, in features, out features


def flux_modules() -> list[Module]:
    """Every Linear kohya's Flux LoRA can train: 19 double blocks, 38 single blocks, the
    embedders, CLIP-L's 12 layers and T5-XXL's 24."""
    d = 3072
    modules: list[Module] = []
    for i in range(19):
        for side in ("img", "txt"):
            prefix = f"lora_unet_double_blocks_{i}_{side}"
            modules += [
                (f"{prefix}_mod_lin", d, 6 * d),
                (f"{prefix}_attn_qkv", d, 3 * d),
                (f"{prefix}_attn_proj", d, d),
                (f"{prefix}_mlp_0", d, 4 * d),
                (f"{prefix}_mlp_2", 4 * d, d),
            ]
    for i in range(38):
        prefix = f"lora_unet_single_blocks_{i}"
        modules += [
            (f"{prefix}_linear1", d, 7 * d),
            (f"{prefix}_linear2", 5 * d, d),
            (f"{prefix}_modulation_lin", d, 3 * d),
        ]
    for name in ("img_in", "txt_in", "time_in_in_layer", "time_in_out_layer", "final_layer_linear"):
        modules.append((f"lora_unet_{name}", d, d))
    modules += _clip("lora_te1", 12, 768)
    for i in range(24):
        for part in ("0_SelfAttention_q", "0_SelfAttention_k", "0_SelfAttention_v"):
            modules.append((f"lora_te3_encoder_block_{i}_layer_{part}", 4096, 4096))
        for part in ("0_SelfAttention_o", "1_DenseReluDense_wi_0", "1_DenseReluDense_wi_1"):
            modules.append((f"lora_te3_encoder_block_{i}_layer_{part}", 4096, 4096))
        modules.append((f"lora_te3_encoder_block_{i}_layer_1_DenseReluDense_wo", 10240, 4096))
    return modules


def sdxl_modules() -> list[Module]:
    """Every Linear and ResNet conv of SDXL's UNet (LoCon's reach) and both text encoders."""
    modules: list[Module] = []
    attentions = [("down_blocks_1", 2, 2, 640), ("down_blocks_2", 2, 10, 1280)]
    attentions += [("mid_block", 1, 10, 1280), ("up_blocks_0", 3, 10, 1280)]
    attentions += [("up_blocks_1", 3, 2, 640)]
    for block, count, depth, d in attentions:
        for a in range(count):
            prefix = f"lora_unet_{block}_attentions_{a}"
            modules += [(f"{prefix}_proj_in", d, d), (f"{prefix}_proj_out", d, d)]
            for t in range(depth):
                for part in ("attn1_to_q", "attn1_to_k", "attn1_to_v", "attn1_to_out_0"):
                    modules.append((f"{prefix}_transformer_blocks_{t}_{part}", d, d))
                for part in ("attn2_to_q", "attn2_to_k", "attn2_to_v", "attn2_to_out_0"):
                    modules.append((f"{prefix}_transformer_blocks_{t}_{part}", d, d))
                modules.append((f"{prefix}_transformer_blocks_{t}_ff_net_0_proj", d, 8 * d))
                modules.append((f"{prefix}_transformer_blocks_{t}_ff_net_2", 4 * d, d))
    for block, resnets in (("down_blocks", (2, 2, 2)), ("up_blocks", (3, 3, 3))):
        for b, count in enumerate(resnets):
            for r in range(count):
                for part in ("conv1", "conv2", "time_emb_proj", "conv_shortcut"):
                    modules.append((f"lora_unet_{block}_{b}_resnets_{r}_{part}", 1280, 1280))
    return modules + _clip("lora_te1", 12, 768) + _clip("lora_te2", 32, 1280)


def _clip(prefix: str, layers: int, d: int) -> list[Module]:
    parts = ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj")
    modules = [
        (f"{prefix}_text_model_encoder_layers_{i}_{p}", d, d) for i in range(layers) for p in parts
    ]
    for i in range(layers):
        modules += [
            (f"{prefix}_text_model_encoder_layers_{i}_mlp_fc1", d, 4 * d),
            (f"{prefix}_text_model_encoder_layers_{i}_mlp_fc2", 4 * d, d),
        ]
    return modules


# Per module: (suffix, dtype, shape from (in, out, rank)).
TensorKinds = tuple[tuple[str, str, Callable[[int, int, int], list[int]]], ...]
LORA: TensorKinds = (
    (".lora_down.weight", "BF16", lambda i, o, r: [r, i]),
    (".lora_up.weight", "BF16", lambda i, o, r: [o, r]),
    (".alpha", "F32", lambda i, o, r: []),
)
LOHA_DORA: TensorKinds = (
    (".hada_w1_a", "BF16", lambda i, o, r: [o, r]),
    (".hada_w1_b", "BF16", lambda i, o, r: [r, i]),
    (".hada_w2_a", "BF16", lambda i, o, r: [o, r]),
    (".hada_w2_b", "BF16", lambda i, o, r: [r, i]),
    (".alpha", "F32", lambda i, o, r: []),
    (".dora_scale", "BF16", lambda i, o, r: [1, i]),
)
_BYTES = {"BF16": 2, "F32": 4}


def header_json(
    modules: list[Module],
    tensors: TensorKinds,
    *,
    rank: int,
    metadata: dict[str, str],
) -> tuple[bytes, int]:
    """The compact header (as the safetensors writer spells it) of a file holding `tensors`
    for each of `modules` at `rank`, and the size of its data."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, features_in, features_out in modules:
        for suffix, dtype, shape_of in tensors:
            shape = shape_of(features_in, features_out, rank)
            size = _BYTES[dtype]
            for dim in shape:
                size *= dim
            header[name + suffix] = {
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + size],
            }
            offset += size
    return json.dumps(header, separators=(",", ":")).encode(), offset
