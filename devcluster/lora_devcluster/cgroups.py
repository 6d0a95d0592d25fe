"""The cluster's cgroups, seen from the host: find them and remove them.

The kubelet puts every pod under the cluster's own `cgroupRoot` (see `Layout.cgroup_root`) in
each cgroup v1 hierarchy the host mounts. cgroups are not files of the cluster's directory and
outlive the processes in them, so `down` removes them here, deepest first, once the sandbox's
processes are gone.

Owns: creating the root in each hierarchy (the kubelet requires it to exist), listing and
removing the cgroup directories under it.
Must not: unmount or change the host's hierarchies, or touch a cgroup outside the root.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def hierarchies(mounts_file: str = "/proc/self/mounts") -> list[Path]:
    """The mount points of the host's cgroup hierarchies (v1 controllers, v2 unified)."""
    found = []
    for line in Path(mounts_file).read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] in ("cgroup", "cgroup2"):
            found.append(Path(fields[1]))
    return found


def existing(cgroup_root: str) -> list[Path]:
    """The cluster's top cgroup directory in each hierarchy where it exists."""
    return [d for h in hierarchies() if (d := h / cgroup_root.lstrip("/")).is_dir()]


def create(cgroup_root: str) -> None:
    """Create `cgroup_root` in every hierarchy. A new v1 cpuset cgroup starts with no CPUs and
    no memory nodes, so it inherits its parent's before anything joins it."""
    for h in hierarchies():
        d = h / cgroup_root.lstrip("/")
        d.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (d / name).exists() and not (d / name).read_text().strip():
                (d / name).write_text((d.parent / name).read_text())


def remove(cgroup_root: str, timeout: float = 10) -> list[str]:
    """Remove every cgroup under `cgroup_root`, deepest first, retrying while the kernel still
    counts exiting tasks in them. Returns what could not be removed (empty on success)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for top in existing(cgroup_root):
            for dirpath, _, _ in os.walk(top, topdown=False):
                try:
                    os.rmdir(dirpath)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    left.append(f"{dirpath}: {e.strerror}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
