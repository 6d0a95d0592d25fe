"""An adapter file read once: the bytes, their SHA-256 and the tensors as views of those bytes
agree with hashlib and with safetensors' own reader, for every dtype, at any chunk size, and at
offsets no torch view can take."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from lora_inference import weightsfile
from lora_volume import files


def every_dtype() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    floats = torch.randn(3, 5)
    return {
        "f32": floats,
        "f16": floats.half(),
        "bf16": floats.bfloat16(),
        "f64": floats.double(),
        "f8_e4m3": floats.to(torch.float8_e4m3fn),
        "f8_e5m2": floats.to(torch.float8_e5m2),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(7, dtype=torch.uint8),
        "i16": torch.arange(9, dtype=torch.int16),
        "i32": torch.arange(11, dtype=torch.int32),
        "i64": torch.arange(13, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(4.0),
        "empty": torch.zeros(0, 4),
    }


def read_back(path: Path) -> tuple[weightsfile.WeightsFile, dict[str, torch.Tensor]]:
    read = weightsfile.read(path)
    return read, read.tensors(files.parse_safetensors_header(read.data, read.size))


@pytest.mark.parametrize("chunk", [7, 4096, weightsfile.CHUNK_BYTES], ids=["7", "4k", "default"])
def test_the_tensors_are_safetensors_own_and_the_hash_is_the_files(
    tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weightsfile, "CHUNK_BYTES", chunk)
    path = tmp_path / "every.safetensors"
    safetensors.torch.save_file(every_dtype(), str(path))
    read, tensors = read_back(path)
    assert read.sha256() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert read.size == path.stat().st_size
    want = safetensors.torch.load(path.read_bytes())
    assert list(tensors) == sorted(want)
    for key, tensor in want.items():
        got = tensors[key]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), key
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_every_dtype_a_checked_header_may_name_has_a_torch_dtype() -> None:
    assert set(weightsfile.DTYPES) == set(files._DTYPE_BYTES)
    for name, dtype in weightsfile.DTYPES.items():
        assert dtype.itemsize == files._DTYPE_BYTES[name], name


def test_a_tensor_no_view_can_take_is_copied_out(tmp_path: Path) -> None:
    """A file written by hand whose float32 data starts at an odd byte: the values are still
    the file's, in a tensor of their own."""
    values = torch.tensor([1.5, -2.25, 3.0])
    data = values.numpy().tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, len(data)]}})
    header += " " * ((1 - 8 - len(header)) % 4)  # the data begins 1 byte past a multiple of 4
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + data)
    assert (8 + len(header)) % 4 == 1
    _, tensors = read_back(path)
    assert torch.equal(tensors["w"], values)


def test_the_views_share_the_bytes_read(tmp_path: Path) -> None:
    """No copy: every aligned tensor lies in the one buffer the file was read into."""
    path = tmp_path / "a.safetensors"
    safetensors.torch.save_file({"a": torch.ones(64), "b": torch.zeros(8, 8)}, str(path))
    read, tensors = read_back(path)
    start = torch.frombuffer(read.data, dtype=torch.uint8).data_ptr()
    for tensor in tensors.values():
        assert start <= tensor.data_ptr() < start + read.size
