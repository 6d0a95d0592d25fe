"""Mount points the kubelet had to create on the host, shared by every cluster on the machine.

A container's volume is bind-mounted at its mountPath inside the container's own mount
namespace, but the directory it is mounted on must exist in the (shared) filesystem. The
kubelet creates missing ones and records them here; `down` removes those that are empty and
that no process on the machine still mounts something on. The check matters: removing a
directory that is a mount point in another namespace silently detaches that mount, so one
cluster's `down` would break another cluster's running pods.

Owns: the registry file (/run/lora-devcluster/mountpoints, under a lock) and the cleanup.
Must not: remove anything that is not an empty directory or empty file it recorded.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

REGISTRY = Path(os.environ.get("LORA_DEVCLUSTER_RUN_DIR", "/run/lora-devcluster")) / "mountpoints"


@contextlib.contextmanager
def _locked(registry: Path) -> Iterator[list[str]]:
    """The registry's lines, under an exclusive lock; the list is written back on exit."""
    registry.parent.mkdir(parents=True, exist_ok=True)
    with open(registry, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        lines = [line for line in f.read().splitlines() if line]
        yield lines
        f.seek(0)
        f.truncate()
        f.write("".join(f"{line}\n" for line in lines))


def record(path: Path, registry: Path = REGISTRY) -> None:
    with _locked(registry) as lines:
        if str(path) not in lines:
            lines.append(str(path))


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def in_use() -> set[str]:
    """Every mount point of every process on the machine (all mount namespaces)."""
    points: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/mountinfo").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split()
            if len(fields) > 4:
                points.add(_unescape(fields[4]))
    return points


def remove_unused(registry: Path = REGISTRY) -> None:
    """Remove recorded mount points nobody mounts on any more (deepest first, only if empty)."""
    if not registry.exists():
        return
    with _locked(registry) as lines:
        busy = in_use()
        keep = []
        for raw in sorted(set(lines), key=len, reverse=True):
            p = Path(raw)
            if os.path.realpath(p) in busy:
                keep.append(raw)
                continue
            with contextlib.suppress(OSError):
                if p.is_dir() and not p.is_symlink():
                    p.rmdir()  # fails if not empty: never remove what someone put there
                elif p.is_file() and p.stat().st_size == 0:
                    p.unlink()
            if p.exists():
                keep.append(raw)
        lines[:] = sorted(keep)
    if not lines:
        with contextlib.suppress(OSError):
            registry.unlink()
            registry.parent.rmdir()
