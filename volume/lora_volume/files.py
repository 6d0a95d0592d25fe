"""Adapter files on disk: which file holds the weights, and whether it is a sane LoRA safetensors.

Everything here reads bytes and JSON only. It imports no torch and no diffusers, so the operator
uses the same checks when it stages a download, and a pickle file is refused without ever being
opened. Its errors (`lora_volume.errors`) name no `param`: every fault here is the file's.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_volume import errors, formats

# Formats that execute code when loaded. They are refused by name, never opened.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
# The names diffusers' training scripts and peft's save_pretrained use, in order of preference.
WEIGHT_FILE_NAMES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")
ADAPTER_CONFIG = "adapter_config.json"
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LoRA config in a safetensors header

# A LoRA header lists a few thousand tensors at most; a larger header is a corrupt or hostile file.
MAX_HEADER_BYTES = 64 * 1024 * 1024

_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


@dataclass(frozen=True)
class AdapterConfig:
    """What `adapter_config.json` says, when the adapter has one."""

    base_model: str | None
    rank: int | None
    alpha: float | None


def _corrupt(path_hint: str, why: str) -> errors.InvalidAdapter:
    return errors.InvalidAdapter(
        f"{path_hint} is not a valid safetensors file ({why}); re-export or re-download it"
    )


def parse_safetensors_header(
    prefix: bytes, file_size: int, *, name: str = "file"
) -> SafetensorsHeader:
    """Parse and check a safetensors header (pure).

    `prefix` must hold at least the 8-byte length and the JSON header. Checks that every tensor's
    byte range matches its dtype and shape, that ranges neither overlap nor leave gaps, and that
    they end exactly at the end of the file: a truncated file or a header that lies about sizes is
    rejected before any tensor is read.
    """
    if file_size < 8 or len(prefix) < 8:
        raise _corrupt(name, "shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise _corrupt(name, f"header length {header_len} does not fit in a {file_size}-byte file")
    if len(prefix) < 8 + header_len:
        raise _corrupt(name, "header is truncated")
    try:
        raw = json.loads(prefix[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(name, f"header is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise _corrupt(name, "header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(name, "__metadata__ must map strings to strings")
    data_size = file_size - 8 - header_len
    tensors: dict[str, TensorEntry] = {}
    for key, entry in raw.items():
        tensors[key] = _parse_entry(name, key, entry)
    spans = sorted((t.begin, t.end) for t in tensors.values())
    cursor = 0
    for begin, end in spans:
        if begin != cursor:
            raise _corrupt(name, f"tensor data overlaps or leaves a gap at byte {begin}")
        cursor = end
    if cursor != data_size:
        raise _corrupt(name, f"header describes {cursor} data bytes but the file holds {data_size}")
    return SafetensorsHeader(tensors=tensors, metadata=dict(metadata))


def read_safetensors_header(path: Path, *, name: str = "file") -> SafetensorsHeader:
    """Read the header of the safetensors file at `path` (not its tensors) and check it as
    `parse_safetensors_header` does."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) == 8:
            (header_len,) = struct.unpack("<Q", prefix)
            prefix += f.read(min(header_len, MAX_HEADER_BYTES))
    return parse_safetensors_header(prefix, size, name=name)


def _parse_entry(name: str, key: str, entry: Any) -> TensorEntry:
    if not isinstance(entry, dict):
        raise _corrupt(name, f"entry {key!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise _corrupt(name, f"tensor {key!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _corrupt(name, f"tensor {key!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _corrupt(name, f"tensor {key!r} has invalid data_offsets {offsets!r}")
    expected = math.prod(shape) * _DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise _corrupt(
            name,
            f"tensor {key!r} claims shape {shape} ({expected} bytes) "
            f"but spans {offsets[1] - offsets[0]} bytes",
        )
    return TensorEntry(dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])


def check_lora_keys(keys: list[str], *, name: str = "adapter") -> formats.Format:
    """The adapter format of a state dict, or InvalidAdapter if it is not one that is served
    (pure; `formats.classify` names each refused format and says what to do)."""
    return formats.classify(keys, name=name)


def find_weights_file(path: Path) -> Path:
    """The safetensors file of an adapter given as a file or a directory.

    Refuses pickle formats by name (UnsupportedFormat) and says which file it expected.
    """
    if path.is_file():
        return _check_suffix(path)
    candidates = sorted(p for p in path.iterdir() if p.is_file())
    for wanted in WEIGHT_FILE_NAMES:
        if (path / wanted).is_file():
            return path / wanted
    safetensors = [p for p in candidates if p.suffix == ".safetensors"]
    if len(safetensors) == 1:
        return safetensors[0]
    if len(safetensors) > 1:
        raise errors.InvalidPath(
            f"{path} holds several .safetensors files ({', '.join(p.name for p in safetensors)}); "
            f"name one of them, or rename the weights to {WEIGHT_FILE_NAMES[0]}"
        )
    if any(p.suffix in PICKLE_SUFFIXES for p in candidates):
        raise errors.UnsupportedFormat(
            f"{path} holds only pickle weights, which can run code when opened and are never "
            "loaded; convert them to .safetensors"
        )
    raise errors.NotFound(f"{path} holds no .safetensors file")


def _check_suffix(file: Path) -> Path:
    if file.suffix == ".safetensors":
        return file
    if file.suffix in PICKLE_SUFFIXES:
        raise errors.UnsupportedFormat(
            f"{file.name} is a pickle file, which can run code when opened and is never loaded; "
            "convert it to .safetensors"
        )
    raise errors.UnsupportedFormat(
        f"{file.name} is not a .safetensors file; adapters are served only in safetensors format"
    )


def read_adapter_config(adapter_path: Path) -> AdapterConfig | None:
    """`adapter_config.json` next to the weights, if there is one (None otherwise)."""
    directory = adapter_path if adapter_path.is_dir() else adapter_path.parent
    config_file = directory / ADAPTER_CONFIG
    if not config_file.is_file():
        return None
    try:
        text = config_file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise errors.InvalidAdapter(f"{config_file} cannot be read: {e}") from e
    raw = _json_object(text, where=str(config_file))
    base = raw.get("base_model_name_or_path")
    rank = raw.get("r")
    alpha = raw.get("lora_alpha")
    return AdapterConfig(
        base_model=base if isinstance(base, str) and base else None,
        rank=rank if isinstance(rank, int) else None,
        alpha=float(alpha) if isinstance(alpha, int | float) else None,
    )


def lora_metadata(header: SafetensorsHeader, *, name: str) -> dict[str, Any] | None:
    """diffusers' LoRA configuration (`lora_adapter_metadata` in the header), if the file has one.

    diffusers' training scripts write each component's LoraConfig there (`unet.r`,
    `unet.lora_alpha`, `unet.alpha_pattern`, ...); it decides the alphas instead of the tensors.
    """
    raw = header.metadata.get(LORA_METADATA_KEY)
    if not raw:
        return None
    return _json_object(raw, where=f"the {LORA_METADATA_KEY} header of adapter {name!r}")


def trigger_words(header: SafetensorsHeader, *, most: int = 5) -> tuple[str, ...]:
    """The words the file's metadata says to put in a prompt (pure), in order of importance.

    `modelspec.trigger_phrase` (Stability's model spec; comma-separated) first, then the tags
    kohya's trainer counted in its captions (`ss_tag_frequency`, {dataset: {tag: count}}), most
    frequent first, up to `most` in all. Metadata is informational: a malformed entry gives no
    words rather than refusing the file.
    """
    words: list[str] = []
    phrase = header.metadata.get("modelspec.trigger_phrase", "")
    words.extend(w.strip() for w in phrase.split(",") if w.strip())
    counts: dict[str, int] = {}
    try:
        frequency = json.loads(header.metadata.get("ss_tag_frequency", "{}"))
    except json.JSONDecodeError:
        frequency = {}
    for tags in frequency.values() if isinstance(frequency, dict) else ():
        for tag, count in tags.items() if isinstance(tags, dict) else ():
            if isinstance(tag, str) and tag.strip() and isinstance(count, int):
                counts[tag.strip()] = counts.get(tag.strip(), 0) + count
    words.extend(sorted(counts, key=lambda t: (-counts[t], t)))
    return tuple(dict.fromkeys(words))[:most]


def _json_object(text: str, *, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise errors.InvalidAdapter(f"{where} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise errors.InvalidAdapter(f"{where} must hold a JSON object")
    return value
