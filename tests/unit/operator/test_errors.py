"""The staging error for each of the shared volume's errors (`errors.from_volume`, pure)."""

from __future__ import annotations

import pytest
from lora_operator.rules import errors
from lora_volume import errors as volume_errors

EXPECTED = {
    volume_errors.InvalidName: "InvalidSource",
    volume_errors.InvalidPath: "InvalidSource",
    volume_errors.PathForbidden: "InvalidSource",
    volume_errors.NotFound: "SourceNotFound",
    volume_errors.UnsupportedFormat: "PickleRefused",
    volume_errors.InvalidAdapter: "NotALora",
}


def test_every_volume_error_is_mapped() -> None:
    assert set(volume_errors.VolumeError.__subclasses__()) == set(EXPECTED)


@pytest.mark.parametrize(
    ("kind", "reason"), list(EXPECTED.items()), ids=[k.__name__ for k in EXPECTED]
)
def test_volume_errors_are_permanent_and_keep_their_message(
    kind: type[volume_errors.VolumeError], reason: str
) -> None:
    mapped = errors.from_volume(kind("fix this"))
    assert (mapped.reason, mapped.permanent) == (reason, True)
    assert mapped.message.startswith("fix this")
