"""Adapter files: safetensors header checks, LoRA key checks, layout and allowed roots (pure)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from lora_volume import errors, files, layout


def safetensors_bytes(tensors: dict[str, tuple[str, list[int], int]], *, pad: int = 0) -> bytes:
    """A safetensors blob from (dtype, shape, nbytes) entries laid out back to back."""
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * (offset + pad)


def parse(blob: bytes) -> files.SafetensorsHeader:
    return files.parse_safetensors_header(blob, len(blob))


def test_a_well_formed_header_parses() -> None:
    blob = safetensors_bytes(
        {"x.lora_A.weight": ("F32", [2, 3], 24), "x.lora_B.weight": ("F16", [4, 2], 16)}
    )
    header = parse(blob)
    assert header.tensors["x.lora_A.weight"].shape == (2, 3)
    assert header.tensors["x.lora_B.weight"].end == 40


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        pytest.param(b"\x01\x02", "shorter than", id="too-short"),
        pytest.param(struct.pack("<Q", 10**9) + b"{}", "more than the", id="huge-header-length"),
        pytest.param(struct.pack("<Q", 4) + b"nope", "not JSON", id="not-json"),
        pytest.param(struct.pack("<Q", 2) + b"[]", "not a JSON object", id="not-object"),
        pytest.param(
            safetensors_bytes({"t": ("F32", [2, 3], 24)})[:-5], "data bytes", id="truncated-data"
        ),
        pytest.param(
            safetensors_bytes({"t": ("F32", [2, 3], 20)}), "claims shape", id="header-lies"
        ),
        pytest.param(safetensors_bytes({"t": ("Q4", [2], 2)}), "unknown dtype", id="bad-dtype"),
        pytest.param(
            safetensors_bytes({"t": ("F32", [1], 4)}, pad=4), "data bytes", id="trailing-bytes"
        ),
        pytest.param(
            safetensors_bytes({"t": ("F32", [-1], 4)}), "invalid shape", id="negative-dim"
        ),
    ],
)
def test_corrupt_headers_are_refused_with_the_reason(blob: bytes, message: str) -> None:
    with pytest.raises(errors.InvalidAdapter, match=message):
        parse(blob)


def test_overlapping_tensors_are_refused() -> None:
    raw = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        }
    ).encode()
    blob = struct.pack("<Q", len(raw)) + raw + b"\0" * 8
    with pytest.raises(errors.InvalidAdapter, match="overlaps"):
        parse(blob)


@pytest.mark.parametrize(
    "key",
    [
        "unet.a.to_q.lora_A.weight",
        "unet.a.to_q.lora_B.weight",
        "lora_unet_a_to_q.lora_down.weight",
        "lora_te_x.lora_up.weight",
        "lora_unet_a.alpha",
        "unet.a.processor.to_q_lora.down.weight",
        "lora_unet_a.diff",  # served merged only
        "lora_unet_a.lokr_w2",
        "lora_unet_a.dora_scale",
    ],
)
def test_lora_keys_are_accepted(key: str) -> None:
    files.check_lora_keys([key])


@pytest.mark.parametrize(
    ("key", "message"),
    [
        pytest.param("model.diffusion_model.input.weight", "not part of a LoRA", id="full-weight"),
    ],
)
def test_non_lora_keys_are_refused(key: str, message: str) -> None:
    with pytest.raises(errors.InvalidAdapter, match=message):
        files.check_lora_keys(["unet.x.lora_A.weight", key])


def test_an_empty_state_dict_is_refused() -> None:
    with pytest.raises(errors.InvalidAdapter, match="no tensors"):
        files.check_lora_keys([])


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt", ".pth", ".pkl"])
def test_pickle_files_are_refused_by_name(tmp_path: Path, suffix: str) -> None:
    weights = tmp_path / f"adapter{suffix}"
    weights.write_bytes(b"this would be a pickle")
    with pytest.raises(errors.UnsupportedFormat, match="pickle"):
        files.find_weights_file(weights)


def test_directory_with_only_pickle_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(errors.UnsupportedFormat, match="only pickle"):
        files.find_weights_file(tmp_path)


def test_directory_prefers_the_diffusers_file_name(tmp_path: Path) -> None:
    (tmp_path / "other.safetensors").write_bytes(b"")
    (tmp_path / files.WEIGHT_FILE_NAMES[0]).write_bytes(b"")
    assert files.find_weights_file(tmp_path).name == files.WEIGHT_FILE_NAMES[0]


def test_ambiguous_directory_asks_which_file(tmp_path: Path) -> None:
    (tmp_path / "one.safetensors").write_bytes(b"")
    (tmp_path / "two.safetensors").write_bytes(b"")
    with pytest.raises(errors.InvalidPath, match="several"):
        files.find_weights_file(tmp_path)


def test_adapter_config_is_read(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "org/model", "r": 8, "lora_alpha": 16})
    )
    config = files.read_adapter_config(tmp_path)
    assert config == files.AdapterConfig(base_model="org/model", rank=8, alpha=16.0)
    (tmp_path / "bare").mkdir()
    assert files.read_adapter_config(tmp_path / "bare") is None


@pytest.mark.parametrize("name", ["pixel-art", "a", "A_b.c-9", "x" * 253])
def test_valid_adapter_names(name: str) -> None:
    assert layout.check_adapter_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "../x", "a/b", "-a", "a-", "a..b", "x" * 254, 7, None, "a b", "a\n", "a\x00"]
)
def test_invalid_adapter_names(name: object) -> None:
    with pytest.raises(errors.InvalidName):
        layout.check_adapter_name(name)


def test_resolve_allowed_follows_symlinks_and_dotdot(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "ok").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    roots = (root,)
    assert layout.resolve_allowed(root / "ok", roots, param="p") == (root / "ok").resolve()
    with pytest.raises(errors.PathForbidden, match="outside the allowed roots"):
        layout.resolve_allowed(root / "escape", roots, param="p")
    with pytest.raises(errors.PathForbidden):
        layout.resolve_allowed(f"{root}/../outside", roots, param="p")
    with pytest.raises(errors.NotFound):
        layout.resolve_allowed(root / "missing", roots, param="p")
    with pytest.raises(errors.InvalidPath, match="absolute"):
        layout.resolve_allowed("relative/path", roots, param="p")
    with pytest.raises(errors.PathForbidden, match="allows no adapter paths"):
        layout.resolve_allowed(root / "ok", (), param="p")


def test_resolve_on_root_follows_the_current_pointer(tmp_path: Path) -> None:
    revision = layout.revision_dir(tmp_path, "pixel", "ab" * 32)
    revision.mkdir(parents=True)
    layout.current_link(tmp_path, "pixel").symlink_to(Path("revisions") / ("ab" * 32))
    (tmp_path / "plain").mkdir()
    (tmp_path / "single.safetensors").write_bytes(b"")
    assert layout.resolve_on_root(tmp_path, "pixel") == revision.resolve()
    assert layout.resolve_on_root(tmp_path, "plain") == (tmp_path / "plain").resolve()
    assert layout.resolve_on_root(tmp_path, "single") == (tmp_path / "single.safetensors").resolve()
    assert layout.resolve_on_root(tmp_path, "missing") is None
