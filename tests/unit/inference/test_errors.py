"""The server's answer to each of the shared volume's errors (`errors.from_volume`, pure)."""

from __future__ import annotations

import pytest
from lora_inference import errors
from lora_volume import errors as volume_errors

EXPECTED = {
    volume_errors.InvalidName: 400,
    volume_errors.InvalidPath: 400,
    volume_errors.PathForbidden: 403,
    volume_errors.NotFound: 404,
    volume_errors.UnsupportedFormat: 415,
    volume_errors.InvalidAdapter: 422,
}


def test_every_volume_error_has_an_answer() -> None:
    assert set(volume_errors.VolumeError.__subclasses__()) == set(EXPECTED)


@pytest.mark.parametrize(
    ("kind", "status"), list(EXPECTED.items()), ids=[k.__name__ for k in EXPECTED]
)
def test_volume_errors_keep_their_message_and_param(
    kind: type[volume_errors.VolumeError], status: int
) -> None:
    mapped = errors.from_volume(kind("fix this", param="lora_name"))
    assert (mapped.status, mapped.message, mapped.param) == (status, "fix this", "lora_name")


def test_a_file_error_names_lora_path() -> None:
    # The volume's file checks know no request field; the file is what the load call names.
    mapped = errors.from_volume(volume_errors.InvalidAdapter("corrupt"))
    assert (mapped.status, mapped.param) == (422, "lora_path")
