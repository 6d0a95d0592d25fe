"""Domain errors of the inference server.

Every error a user can cause is one of these, or one of the shared volume's
(`lora_volume.errors`: names, paths and adapter files), raised with a message that says what to
fix. `from_volume` says which of these each volume error is; the HTTP layer maps them to status
codes in exactly one place (`app.error_middleware`); nothing else in the package knows about HTTP.
"""

from __future__ import annotations

from lora_volume import errors as volume_errors


class InferenceError(Exception):
    """Base class. `param` names the request field at fault, when there is one."""

    status = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(InferenceError):
    """A malformed body, a missing or mistyped field, a value out of range, a bad name."""

    status = 400
    error_type = "BadRequestError"


class AdapterConflict(InvalidRequest):
    """A name already in use without `load_inplace`, or every GPU slot pinned."""


class Unauthorized(InferenceError):
    status = 401
    error_type = "AuthenticationError"


class Forbidden(InferenceError):
    """Something this server was started not to allow (request-level adapter registration)."""

    status = 403
    error_type = "PermissionDeniedError"


class PathForbidden(Forbidden):
    """A path outside every allowed root (after resolving symlinks and `..`)."""


class AdapterNotFound(InferenceError):
    """An adapter name nobody registered and the resolver cannot find, or a missing path."""

    status = 404
    error_type = "NotFoundError"


class UnsupportedFormat(InferenceError):
    """Not a safetensors file: pickle-based formats are refused without being opened."""

    status = 415
    error_type = "UnsupportedMediaTypeError"


class IncompatibleAdapter(InferenceError):
    """A readable file that cannot be applied to this base model (shapes, rank, modules...)."""

    status = 422
    error_type = "UnprocessableEntityError"


class QueueFull(InferenceError):
    """Back-pressure: the request queue is at `--max-queue`."""

    status = 429
    error_type = "RateLimitError"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(InferenceError):
    status = 503
    error_type = "ServiceUnavailableError"


# Every error a user can cause, for the `except` clauses that must see all of them.
DOMAIN_ERRORS = (InferenceError, volume_errors.VolumeError)

# What the server answers for each of the volume's errors.
_FROM_VOLUME: tuple[tuple[type[volume_errors.VolumeError], type[InferenceError]], ...] = (
    (volume_errors.InvalidName, InvalidRequest),
    (volume_errors.InvalidPath, InvalidRequest),
    (volume_errors.PathForbidden, PathForbidden),
    (volume_errors.NotFound, AdapterNotFound),
    (volume_errors.UnsupportedFormat, UnsupportedFormat),
    (volume_errors.InvalidAdapter, IncompatibleAdapter),
)


def from_volume(e: volume_errors.VolumeError) -> InferenceError:
    """The server's error for one of the volume's. One that names no input is about the
    adapter's files, which the API names `lora_path`."""
    for volume_kind, kind in _FROM_VOLUME:
        if isinstance(e, volume_kind):
            return kind(e.message, param=e.param or "lora_path")
    return InferenceError(e.message, param=e.param)
