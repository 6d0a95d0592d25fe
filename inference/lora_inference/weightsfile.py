"""An adapter's weights file read once: its bytes into one buffer, hashed as they arrive, and its
tensors as views of those bytes.

One pass over the file: each chunk is read into the buffer and handed at once to a hashing thread
(hashlib drops the GIL), so the SHA-256 is done about when the read is, and the conversion that
follows (`parsing`) runs beside whatever of it is left. The buffer comes from numpy, which asks
the kernel for huge pages for it: filling it costs a read, not a page fault per 4 KiB. The
tensors are the file's bytes themselves, laid out as the header `lora_volume.files` checked says
(no copy, unlike `safetensors.torch.load`, which also parses the header a second time); a tensor
whose offset is not a multiple of its element size (a file written by hand) is copied out alone.

Any thread; touches no pipeline state. Imports torch and numpy, never diffusers.
"""

from __future__ import annotations

import hashlib
import os
import queue
import struct
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from lora_volume import files

from lora_inference import errors

CHUNK_BYTES = 16 * 1024 * 1024  # read, then hashed, at a time
# Beside the reader's pool (two threads): a hash never waits for a reader, nor a reader for a
# hash until its own is due.
_HASHING = ThreadPoolExecutor(2, thread_name_prefix="adapter-hash")

# safetensors' dtypes (lora_volume.files checks a header names only these) as torch's.
DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
}


class WeightsFile:
    """The bytes of one file, read once; its SHA-256 when `sha256` is called."""

    def __init__(self, path: Path, buffer: np.ndarray, digest: Future[str]) -> None:
        self.path = path
        self._buffer = buffer
        self._digest = digest

    @property
    def size(self) -> int:
        return int(self._buffer.size)

    @property
    def data(self) -> memoryview:
        return self._buffer.data

    def sha256(self) -> str:
        """The hex SHA-256 of the bytes read (waits for the hashing thread to finish)."""
        return self._digest.result()

    def tensors(self, header: files.SafetensorsHeader) -> dict[str, torch.Tensor]:
        """The file's tensors, sorted by name, as views of its bytes: `header` must be this
        file's, checked (`files.parse_safetensors_header`), so every range lies in the file."""
        if sys.byteorder != "little":  # safetensors is little-endian: let its reader swap
            return dict(sorted(safetensors.torch.load(bytes(self.data)).items()))
        (header_len,) = struct.unpack("<Q", self.data[:8])
        start = 8 + header_len
        raw = torch.from_numpy(self._buffer)
        out: dict[str, torch.Tensor] = {}
        for key in sorted(header.tensors):
            entry = header.tensors[key]
            dtype = DTYPES.get(entry.dtype)
            if dtype is None:
                raise errors.IncompatibleAdapter(
                    f"{self.path.name}: tensor {key!r} has dtype {entry.dtype}, which torch "
                    "cannot hold; re-export the adapter in float16, bfloat16 or float32",
                    param="lora_path",
                )
            span = raw[start + entry.begin : start + entry.end]
            if (start + entry.begin) % dtype.itemsize:
                span = span.clone()  # torch views need offsets aligned to the element size
            out[key] = span.view(dtype).reshape(entry.shape)
        return out


def read(path: Path) -> WeightsFile:
    """Read the file at `path` once, hashing it as it arrives (`WeightsFile.sha256`).

    A file that ends before the size it had when opened is read as far as it goes (its header
    check then refuses it); bytes added meanwhile are not read.
    """
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buffer = np.empty(size, dtype=np.uint8)
        view = buffer.data
        ready: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        digest = _HASHING.submit(_hash, view, ready)
        done = 0
        try:
            while done < size:
                got = f.readinto(view[done : min(size, done + CHUNK_BYTES)])
                if not got:
                    break
                done += got
                ready.put(done)
        finally:
            ready.put(None)  # the hashing thread ends whatever happened here
    return WeightsFile(path, buffer[:done], digest)


def _hash(view: memoryview, ready: queue.SimpleQueue[int | None]) -> str:
    """Hashing thread: `view` up to each offset `ready` gives, until it gives None."""
    digest = hashlib.sha256()
    hashed = 0
    while (end := ready.get()) is not None:
        digest.update(view[hashed:end])
        hashed = end
    return digest.hexdigest()
