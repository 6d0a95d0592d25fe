"""Adapters that must be refused, written next to good ones, each with the status it must get."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from lora_volume.files import WEIGHT_FILE_NAMES
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class BadAdapter:
    name: str
    path: Path
    status: int
    message: str  # a fragment the error message must contain


def _weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(adapter_dir / WEIGHT_FILE_NAMES[0]))


def _save_dir(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHT_FILE_NAMES[0]))
    return directory


def write_bad_adapters(
    root: Path, good_unet: Path, good_with_te: Path, outside: Path
) -> list[BadAdapter]:
    """Write every kind of bad adapter under `root` (and one escape under `outside`)."""
    bad: list[BadAdapter] = []
    base = _weights(good_unet)
    first_a = next(k for k in base if k.endswith("lora_A.weight"))

    wrong = dict(base)
    wrong[first_a] = torch.randn(wrong[first_a].shape[0], wrong[first_a].shape[1] + 8)
    bad.append(
        BadAdapter("wrong-shapes", _save_dir(root / "wrong-shapes", wrong), 422, "expects lora_A")
    )

    with_te = _weights(good_with_te)
    te_key = next(
        k for k in with_te if k.startswith("text_encoder.") and k.endswith("lora_A.weight")
    )
    te_wrong = dict(with_te)
    te_wrong[te_key] = torch.randn(te_wrong[te_key].shape[0], 48)
    bad.append(
        BadAdapter("te-mismatch", _save_dir(root / "te-mismatch", te_wrong), 422, "text_encoder")
    )

    unknown = dict(base)
    unknown["unet.no_such_block.to_q.lora_A.weight"] = torch.randn(4, 16)
    unknown["unet.no_such_block.to_q.lora_B.weight"] = torch.randn(16, 4)
    bad.append(
        BadAdapter(
            "unknown-module", _save_dir(root / "unknown-module", unknown), 422, "does not have"
        )
    )

    mutating = dict(base)
    mutating["unet.conv_in.oft_blocks"] = torch.zeros(3)  # rotates the base weights
    bad.append(BadAdapter("mutates-base", _save_dir(root / "mutates-base", mutating), 422, "OFT"))

    for label, value in (("nan", float("nan")), ("inf", float("inf"))):
        poisoned = dict(base)
        poisoned[first_a] = poisoned[first_a].clone()
        poisoned[first_a][0, 0] = value
        bad.append(
            BadAdapter(
                f"{label}-weights", _save_dir(root / f"{label}-weights", poisoned), 422, first_a
            )
        )

    not_lora = {"conv_in.weight": torch.randn(8, 4, 3, 3), "conv_in.bias": torch.randn(8)}
    bad.append(
        BadAdapter("not-lora", _save_dir(root / "not-lora", not_lora), 422, "not part of a LoRA")
    )

    blob = (good_unet / WEIGHT_FILE_NAMES[0]).read_bytes()
    truncated = root / "truncated"
    truncated.mkdir(parents=True)
    (truncated / WEIGHT_FILE_NAMES[0]).write_bytes(blob[:-100])
    bad.append(BadAdapter("truncated", truncated, 422, "data bytes"))

    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    header[first_a]["shape"] = [header[first_a]["shape"][0] * 2, header[first_a]["shape"][1]]
    lying = json.dumps(header).encode()
    lying_dir = root / "lying-header"
    lying_dir.mkdir(parents=True)
    (lying_dir / WEIGHT_FILE_NAMES[0]).write_bytes(
        struct.pack("<Q", len(lying)) + lying + blob[8 + header_len :]
    )
    bad.append(BadAdapter("lying-header", lying_dir, 422, "claims shape"))

    pickle_dir = root / "pickle"
    pickle_dir.mkdir(parents=True)
    torch.save(base, pickle_dir / "adapter_model.bin")
    bad.append(BadAdapter("pickle", pickle_dir, 415, "pickle"))
    bad.append(BadAdapter("pickle-file", pickle_dir / "adapter_model.bin", 415, "pickle"))

    disguised = root / "disguised.safetensors"
    torch.save(base, disguised)
    bad.append(BadAdapter("disguised", disguised, 422, "not a valid safetensors"))

    mismatch = _save_dir(root / "base-mismatch", base)
    (mismatch / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "stabilityai/some-other-model", "r": 4})
    )
    bad.append(BadAdapter("base-mismatch", mismatch, 422, "declares base model"))

    escaped = _save_dir(outside / "escaped", base)
    (root / "symlink-out").symlink_to(escaped)
    bad.append(BadAdapter("symlink-out", root / "symlink-out", 403, "outside the allowed roots"))
    dotdot = Path(f"{root}/{os.path.relpath(escaped, root)}")  # root/../../outside/escaped
    bad.append(BadAdapter("dotdot", dotdot, 403, "outside"))
    bad.append(BadAdapter("missing", root / "does-not-exist", 404, "does not exist"))
    return bad
