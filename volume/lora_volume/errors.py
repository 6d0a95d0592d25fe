"""What can be wrong with a name, a path or a file on the shared adapter volume.

Plain domain errors, one per fault, each with a message that says what to fix. They know
nothing of who asked: the inference server answers them with HTTP statuses
(`lora_inference.errors.from_volume`), the operator turns them into staging errors
(`lora_operator.rules.errors.from_volume`), each in that one place.
"""

from __future__ import annotations


class VolumeError(Exception):
    """Base class. `param` is the caller's name for the input at fault, when it gave one."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidName(VolumeError):
    """Not a valid adapter (or namespace) name: it could name a path outside its folder."""


class InvalidPath(VolumeError):
    """A path that names no single adapter: relative, or a folder with several weights files."""


class PathForbidden(VolumeError):
    """A path that resolves outside every allowed root (symlinks and `..` followed)."""


class NotFound(VolumeError):
    """A path that does not exist, a folder with no weights file, or an adapter's target that
    cannot be read."""


class UnsupportedFormat(VolumeError):
    """Not a safetensors file: pickle formats are refused by name, never opened."""


class InvalidAdapter(VolumeError):
    """A file that claims to be a LoRA and is not a sane one: a corrupt safetensors header,
    tensors that are not LoRA pairs, an unreadable adapter_config.json or LoRA metadata."""


class InvalidJson(InvalidAdapter):
    """JSON in an adapter's files (a safetensors header, the JSON in its metadata,
    adapter_config.json) that is not JSON, or breaks a bound of `boundedjson.Limits`: longer,
    deeper, with more values or a longer number than any adapter's. Refused before it is built."""
