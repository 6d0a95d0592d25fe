"""LoRA-shaped safetensors files as bytes, built with numpy (no torch: the operator's unit tests
use them), and their sha256."""

from __future__ import annotations

import hashlib

import numpy as np
from safetensors.numpy import save


def lora_bytes(seed: int = 0, rank: int = 4, metadata: dict[str, str] | None = None) -> bytes:
    """A small peft-style LoRA safetensors file, as bytes (its header's `__metadata__`:
    `metadata`)."""
    rng = np.random.default_rng(seed)
    tensors = {
        "unet.down.0.attn.to_q.lora_A.weight": rng.standard_normal((rank, 32)).astype(np.float32),
        "unet.down.0.attn.to_q.lora_B.weight": rng.standard_normal((32, rank)).astype(np.float32),
    }
    return save(tensors, metadata=metadata)


def not_lora_bytes() -> bytes:
    """A valid safetensors file holding a full weight, not a LoRA."""
    return save({"unet.conv_in.weight": np.zeros((4, 4), dtype=np.float32)})


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
