"""Container launcher: `python -m lora_devcluster.launch SPEC.json`.

Owns: turning itself into one container process: join the pod's network namespace, unshare a
private mount namespace, bind-mount the pod's volumes at their mountPath, then exec the
container's command with its environment (so the pid the kubelet started is the container).
Must not: talk to the API server; every decision was made by the kubelet and is in the spec.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from lora_devcluster import ns, podlogic


def run(spec: dict[str, Any]) -> None:
    netns = spec.get("netns")
    if netns:
        ns.setns(netns, ns.CLONE_NEWNET)
    utsns = spec.get("utsns")
    if utsns:
        ns.setns(utsns, ns.CLONE_NEWUTS)
    mounts = podlogic.order_mounts(
        [podlogic.Mount(m["source"], m["target"], bool(m["readonly"])) for m in spec["mounts"]]
    )
    if mounts:
        ns.unshare(ns.CLONE_NEWNS)
        ns.make_mounts_private()
        image = podlogic.hidden_by_mounts(mounts, image_paths())
        mount_all([*mounts, *(podlogic.Mount(p, p, True) for p in image)])
    workdir = spec.get("workdir")
    if workdir:
        os.chdir(workdir)
    argv: list[str] = spec["argv"]
    env: dict[str, str] = spec["env"]
    os.execvpe(argv[0], argv, env)


def image_paths() -> list[str]:
    """What stands for the container image: this interpreter's environment and the project's
    source tree (an editable install), which the mapped commands need."""
    repo = Path(__file__).resolve().parents[2]
    return sorted({str(repo), sys.prefix, sys.base_prefix})


def mount_all(mounts: list[podlogic.Mount]) -> None:
    """Bind-mount every volume, parents before children.

    Every source is opened (O_PATH) before the first mount and bound from /proc/self/fd/N: a
    volume at /tmp would otherwise hide the sources of later mounts that live under /tmp on the
    host (the cluster's directory, where the kubelet keeps pod volumes and the service-account
    token, is under /tmp in the tests). A mount point below an earlier mount (/tmp/conf inside
    the /tmp volume) does not exist there yet: it is created inside that volume, as a container
    runtime creates mount points in the container's filesystem; the kubelet created every other
    missing mount point on the host beforehand (and removes them later).
    """
    fds = [os.open(m.source, os.O_PATH | os.O_CLOEXEC) for m in mounts]
    try:
        for m, fd in zip(mounts, fds, strict=True):
            if not os.path.lexists(m.target):
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.makedirs(m.target, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(m.target), exist_ok=True)
                    open(m.target, "a").close()
            ns.bind_mount(f"/proc/self/fd/{fd}", m.target, readonly=m.readonly)
    finally:
        for fd in fds:
            os.close(fd)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        run(spec)
    except OSError as e:
        # Lands in the container's log, which the harness shows when a test fails.
        print(f"lora-devcluster: cannot start container: {e}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
