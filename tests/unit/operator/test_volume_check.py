"""The operator's start-up check of the adapter volume (`volumecheck.check_volume`): hard links,
symbolic links and atomic renames, tried on the volume itself. The hint for each failure, and a
POSIX volume passing; the failing file systems, which need root to mount, are in
tests/cluster/operator/test_volume_mounts.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from lora_operator.rules import errors
from lora_operator.store import volumecheck


@pytest.mark.parametrize(
    ("step", "errno_", "hint"),
    [
        (volumecheck.VOLUME_STEPS[0], errno.EROFS, "mounted read-only"),
        (volumecheck.VOLUME_STEPS[0], errno.EACCES, "fsGroup"),
        (volumecheck.VOLUME_STEPS[0], errno.ENOSPC, "full"),
        (volumecheck.VOLUME_STEPS[1], errno.EXDEV, "different file systems"),
        (volumecheck.VOLUME_STEPS[1], errno.EPERM, "no hard links or symbolic links"),
        (volumecheck.VOLUME_STEPS[2], errno.ENOSYS, "no hard links or symbolic links"),
        (volumecheck.VOLUME_STEPS[3], errno.EINVAL, "does not rename atomically"),
        (volumecheck.VOLUME_STEPS[4], None, "does not rename atomically"),
    ],
    ids=["ro", "perm", "full", "exdev", "no-link", "no-symlink", "rename", "rename-noerrno"],
)
def test_volume_hint(step: str, errno_: int | None, hint: str) -> None:
    assert hint in volumecheck.volume_hint(step, errno_)


def test_a_posix_volume_passes_and_keeps_nothing(tmp_path: Path) -> None:
    volumecheck.check_volume(tmp_path)
    volumecheck.check_volume(tmp_path)  # twice: nothing left from the first probe is in the way
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == [".objects", ".tmp"]


def test_a_missing_volume_says_where_to_mount_it(tmp_path: Path) -> None:
    with pytest.raises(errors.VolumeUnsupported, match="does not exist: mount the shared"):
        volumecheck.check_volume(tmp_path / "nothing-mounted")
