"""Domain errors of staging: permanent (fix the spec or the source) or transient (retry).

Every failure to stage is a `StagingError`; its `reason` is the reason of the `Staged`
condition (and of the phase's Event). The controller maps them once
(`controller.stager.Stager._failed`, phases as `status.summarise` decides them):

    PermanentStagingError  the adapter is Failed; not staged again until the spec changes (a
                           new metadata.generation)
    TransientStagingError  retried, never given up, `backoff.delay` apart (1, 2, 4 ... capped at
                           `max_backoff_s`); the phase is Staging with the failure's reason
                           below `retry_bound` failures in a row, Degraded from there on, until
                           an attempt succeeds

The shared volume's checks (names, volume paths, the LoRA file: `lora_volume`) raise their own
errors; `from_volume` says which staging error each one is, and `staging.Store.stage` applies it,
the one place they meet staging.

`VolumeUnsupported` is no staging error: the volume check at start raises it and the operator
exits with its message (`__main__`). Failed calls to inference pods are `podclient.PodError`s,
which `podstate.transition` maps the same way per pod. Messages say what to fix and never
contain credentials or signed URLs.

Values only (pure): they live with the rules because the rules raise them too (`consent`,
`composition`); the store raises them and the controller maps them.
"""

from __future__ import annotations

from lora_volume import errors as volume_errors


class StagingError(Exception):
    """Base class. `reason` is a CamelCase word for a condition's `reason` field."""

    permanent = False
    reason = "StagingFailed"
    # A composition's member is missing or unusable: no retry fixes that by itself, so the
    # adapter is Degraded at the first failure (its pods keep the revision they hold), and it
    # is staged again as soon as the member changes.
    degrades_at_once = False

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


class QuotaExceeded(TransientStagingError):
    """The namespace's adapters would take more of the volume than `--namespace-quota`: no
    retry helps until the namespace frees some (an adapter deleted and collected) or the quota
    is raised, so the adapter is Degraded at the first failure; the retries go on and stage it
    once there is room."""

    reason = "QuotaExceeded"
    degrades_at_once = True


class MemberNotStaged(TransientStagingError):
    """A member of `spec.compose` has no staged revision yet: staged again once it has."""

    reason = "MemberNotStaged"


class MemberMissing(TransientStagingError):
    """A member of `spec.compose` does not exist (or is being deleted)."""

    reason = "MemberMissing"
    degrades_at_once = True


class MemberInvalid(TransientStagingError):
    """A member of `spec.compose` cannot be stacked here: another base model, or a composition
    itself."""

    reason = "MemberInvalid"
    degrades_at_once = True


class VolumeUnsupported(Exception):
    """The adapter volume lacks what the store needs (checked once, at start): the operator
    cannot run on it until the volume or its mount changes."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def from_volume(e: volume_errors.VolumeError) -> StagingError:
    """The staging error for one of the volume's checks: a name, a volume path or the file."""
    if isinstance(e, volume_errors.NotFound):
        return SourceNotFound(f"{e.message}; check the path on the volume")
    if isinstance(e, volume_errors.UnsupportedFormat):
        return PickleRefused(e.message)
    if isinstance(e, volume_errors.InvalidAdapter):
        return NotALora(e.message)
    # A bad name, a path naming no single adapter, or one outside the volume: fix the spec.
    return InvalidSource(e.message)
