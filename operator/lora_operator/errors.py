"""Domain errors of staging: permanent (fix the spec or the source) or transient (retry).

The controller maps them once (`Controller._staging_failed`): `PermanentStagingError` makes the
adapter Failed with no retry for its spec, `TransientStagingError` is retried with backoff.
Messages say what to fix and never contain credentials or signed URLs.
"""

from __future__ import annotations


class StagingError(Exception):
    """Base class. `reason` is a CamelCase word for a condition's `reason` field."""

    permanent = False
    reason = "StagingFailed"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PermanentStagingError(StagingError):
    """Retrying cannot help until the spec or the source changes."""

    permanent = True


class TransientStagingError(StagingError):
    """The same request may succeed later."""

    permanent = False


class InvalidSource(PermanentStagingError):
    reason = "InvalidSource"


class SourceNotFound(PermanentStagingError):
    reason = "SourceNotFound"


class SourceForbidden(PermanentStagingError):
    reason = "SourceForbidden"


class ChecksumMismatch(PermanentStagingError):
    reason = "ChecksumMismatch"


class NotALora(PermanentStagingError):
    reason = "NotALora"


class PickleRefused(PermanentStagingError):
    reason = "PickleRefused"


class TooLarge(PermanentStagingError):
    reason = "TooLarge"


class SourceUnavailable(TransientStagingError):
    reason = "SourceUnavailable"


class DiskFull(TransientStagingError):
    reason = "DiskFull"


class VolumeUnsupported(Exception):
    """The adapter volume lacks what the store needs (checked once, at start): the operator
    cannot run on it until the volume or its mount changes."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
