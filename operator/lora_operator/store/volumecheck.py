"""The start-up check of the adapter volume: each operation the store relies on (hard links,
symbolic links, atomic rename), tried on the volume itself, and what to change when one fails.

Must not: leave anything on the volume, or stage anything.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from lora_volume import layout

from lora_operator.rules import errors

# What the store does on the volume, in the order `check_volume` tries it.
VOLUME_STEPS = (
    "write a file",
    "hard-link a file into .objects/",
    "create a symbolic link",
    "rename a symbolic link over another",
    "rename a directory out of .tmp/",
)


def volume_hint(step: str, errno_: int | None) -> str:
    """What to change when `step` failed with `errno_` on the adapter volume (pure)."""
    if errno_ == errno.EROFS:
        return "the volume is mounted read-only; the operator mounts it read-write"
    if errno_ == errno.EXDEV:
        return (
            "the volume's folders are on different file systems (a subPath or a separate "
            "mount under it); mount one volume at the root"
        )
    if errno_ in (errno.ENOSPC, errno.EDQUOT):
        return "the volume is full"
    if step == VOLUME_STEPS[0] and errno_ in (errno.EACCES, errno.EPERM):
        return (
            "the operator's user cannot write it: give the pod an fsGroup the volume honours, "
            "or make the volume writable by uid 65532"
        )
    if step in VOLUME_STEPS[1:3]:
        return (
            "this file system has no hard links or symbolic links (vfat/exFAT, SMB without "
            "UNIX extensions, object-store FUSE mounts)"
        )
    return "this file system does not rename atomically"


def check_volume(volume_root: Path) -> None:
    """Try, on the volume itself, each operation the store relies on; raise VolumeUnsupported
    naming the first that fails and what to change. Leaves nothing behind."""
    if not volume_root.is_dir():
        raise errors.VolumeUnsupported(
            f"the adapter volume {volume_root} does not exist: mount the shared adapter volume "
            "there, read-write, or pass --volume-root"
        )
    tag = f".probe-{os.urandom(6).hex()}"
    tmp_root, objects = layout.tmp_dir(volume_root), volume_root / layout.OBJECTS
    probe, linked = tmp_root / tag, objects / tag
    link_target, renamed = objects / f"{tag}-current", objects / f"{tag}-dir"
    steps = iter(VOLUME_STEPS)
    step = next(steps)
    try:
        tmp_root.mkdir(exist_ok=True)
        objects.mkdir(exist_ok=True)
        probe.mkdir()
        (probe / "file").write_bytes(b"probe")
        step = next(steps)
        os.link(probe / "file", linked)
        step = next(steps)
        os.symlink("file", probe / "new")
        os.symlink("old", link_target)
        step = next(steps)
        os.replace(probe / "new", link_target)
        if os.readlink(link_target) != "file":
            raise OSError(None, "the link still points at the old target")
        step = next(steps)
        (probe / "dir").mkdir()
        os.rename(probe / "dir", renamed)
    except OSError as e:
        raise errors.VolumeUnsupported(
            f"the adapter volume {volume_root} cannot hold the adapter store: could not "
            f"{step} ({e.strerror or e}): {volume_hint(step, e.errno)}. The operator needs "
            "a POSIX file system with hard links, symbolic links and atomic rename (NFS, "
            "CephFS, EFS, Filestore, Azure Files NFS, ext4, xfs)"
        ) from e
    finally:
        shutil.rmtree(probe, ignore_errors=True)
        for leftover in (linked, link_target):
            with contextlib.suppress(OSError):
                leftover.unlink()
        with contextlib.suppress(OSError):
            renamed.rmdir()
