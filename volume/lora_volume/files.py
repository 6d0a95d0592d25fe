"""Adapter files on disk: which file holds the weights, and whether it is a sane LoRA safetensors.

Everything here reads bytes and JSON only. It imports no torch and no diffusers, so the operator
uses the same checks when it stages a download, and a pickle file is refused without ever being
opened. Its errors (`lora_volume.errors`) name no `param`: every fault here is the file's.

The bytes are a tenant's: every JSON document here (the header, the JSON strings in its metadata,
adapter_config.json) is parsed by `boundedjson` within the limits below, its length checked before
it is read, so no file costs more memory than those limits allow (docs/security.md).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_volume import boundedjson, errors, formats

# Formats that execute code when loaded. They are refused by name, never opened.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
# The names diffusers' training scripts and peft's save_pretrained use, in order of preference.
WEIGHT_FILE_NAMES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")
ADAPTER_CONFIG = "adapter_config.json"
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LoRA config in a safetensors header

# A LoRA's header lists its tensors (about 130 bytes each) and its trainer's metadata. Built in
# code (tests/support/bombs.py, checked by tests/unit/volume/test_header_bounds.py), a Flux LoRA
# at rank 128 on every layer and both text encoders (1647 tensors) with kohya's metadata of an
# 8000-tag dataset takes 0.6 MiB and 19k values; an SDXL LoHa with DoRA on every layer (6276
# tensors), the same metadata and a 256 KiB thumbnail 1.6 MiB and 73k values. The limits are 5x
# and 3x the larger one, and refusing the worst header they allow costs tens of MiB, where the
# operator holds 1 GiB for 4 stagings at once. A header nests 3 deep ({tensor: {"shape": [..]}};
# the metadata's values are strings) and its numbers are u64s, 20 digits at most.
MAX_HEADER_BYTES = 8 * 1024 * 1024
HEADER_LIMITS = boundedjson.Limits(
    max_bytes=MAX_HEADER_BYTES, max_depth=3, max_values=250_000, max_number_chars=20
)
# The JSON strings inside a header's metadata (kohya's `ss_tag_frequency`, diffusers'
# `lora_adapter_metadata`): {dataset: {tag: count}}, a LoraConfig per component.
METADATA_LIMITS = boundedjson.Limits(max_bytes=MAX_HEADER_BYTES, max_depth=16, max_values=250_000)
# peft's adapter_config.json: a few KB, tens of KB with a rank pattern for every layer.
ADAPTER_CONFIG_LIMITS = boundedjson.Limits(max_bytes=1024 * 1024, max_depth=16, max_values=100_000)

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


def _corrupt(
    path_hint: str, why: str, kind: type[errors.InvalidAdapter] = errors.InvalidAdapter
) -> errors.InvalidAdapter:
    return kind(f"{path_hint} is not a valid safetensors file ({why}); re-export or re-download it")


def parse_safetensors_header(
    prefix: bytes | memoryview, file_size: int, *, name: str = "file"
) -> SafetensorsHeader:
    """Parse and check a safetensors header (pure).

    `prefix` must hold at least the 8-byte length and the JSON header (the whole file will do:
    the header is read where it lies). Checks that every tensor's byte range matches its dtype
    and shape, that ranges neither overlap nor leave gaps, and that they end exactly at the end
    of the file: a truncated file or a header that lies about sizes is rejected before any
    tensor is read. The header's JSON is parsed within HEADER_LIMITS.
    """
    if file_size < 8 or len(prefix) < 8:
        raise _corrupt(name, "shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix[:8])
    check_header_length(header_len, file_size, name=name)
    if len(prefix) < 8 + header_len:
        raise _corrupt(name, "header is truncated")
    return _parse_header_json(memoryview(prefix)[8 : 8 + header_len], file_size, name=name)


def check_header_length(header_len: int, file_size: int, *, name: str = "file") -> None:
    """Refuse a declared header length before its bytes are read (pure): longer than the file,
    or over MAX_HEADER_BYTES."""
    if 8 + header_len > file_size:
        raise _corrupt(
            name,
            f"its header declares {header_len} bytes, more than the {file_size}-byte file holds: "
            "the file is truncated or not safetensors",
        )
    if header_len > MAX_HEADER_BYTES:
        raise errors.InvalidJson(
            f"{name} has a safetensors header of {header_len} bytes, over the limit of "
            f"{MAX_HEADER_BYTES} ({MAX_HEADER_BYTES // 2**20} MiB); a LoRA's header takes well "
            "under 2 MiB: save the file again without large metadata (embedded images, captions)"
        )


def _parse_header_json(
    header: memoryview | bytes, file_size: int, *, name: str
) -> SafetensorsHeader:
    try:
        raw = boundedjson.parse(header, HEADER_LIMITS, where="its header")
    except errors.InvalidJson as e:
        raise _corrupt(name, e.message, errors.InvalidJson) from e
    if not isinstance(raw, dict):
        raise _corrupt(name, "header is not a JSON object")
    metadata = raw.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(name, "__metadata__ must map strings to strings")
    header_len = header.nbytes if isinstance(header, memoryview) else len(header)
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
    `parse_safetensors_header` does; its declared length is checked before its bytes are read."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = f.read(8)
        if size < 8 or len(length) < 8:
            raise _corrupt(name, "shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", length)
        check_header_length(header_len, size, name=name)
        header = f.read(header_len)
    if len(header) < header_len:
        raise _corrupt(name, "header is truncated")
    return _parse_header_json(header, size, name=name)


def _parse_entry(name: str, key: str, entry: Any) -> TensorEntry:
    if not isinstance(entry, dict):
        raise _corrupt(name, f"entry {key!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise _corrupt(name, f"tensor {key!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _corrupt(name, f"tensor {key!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
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
    limit = ADAPTER_CONFIG_LIMITS.max_bytes
    try:
        with config_file.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise errors.InvalidJson(
                    f"{config_file} is {size} bytes, over the limit of {limit} "
                    f"({limit // 2**20} MiB); peft writes a few KB: keep only its configuration"
                )
            data = f.read(limit + 1)  # a file that grows meanwhile is refused by the parser
    except OSError as e:
        raise errors.InvalidAdapter(f"{config_file} cannot be read: {e}") from e
    raw = _json_object(data, ADAPTER_CONFIG_LIMITS, where=str(config_file))
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
    return _json_object(
        raw, METADATA_LIMITS, where=f"the {LORA_METADATA_KEY} header of adapter {name!r}"
    )


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
        frequency = boundedjson.parse(
            header.metadata.get("ss_tag_frequency", "{}"), METADATA_LIMITS, where="ss_tag_frequency"
        )
    except errors.InvalidJson:
        frequency = {}
    for tags in frequency.values() if isinstance(frequency, dict) else ():
        for tag, count in tags.items() if isinstance(tags, dict) else ():
            if isinstance(tag, str) and tag.strip() and isinstance(count, int):
                counts[tag.strip()] = counts.get(tag.strip(), 0) + count
    words.extend(sorted(counts, key=lambda t: (-counts[t], t)))
    return tuple(dict.fromkeys(words))[:most]


def _json_object(data: bytes | str, limits: boundedjson.Limits, *, where: str) -> dict[str, Any]:
    value = boundedjson.parse(data, limits, where=where)
    if not isinstance(value, dict):
        raise errors.InvalidAdapter(f"{where} must hold a JSON object")
    return value
