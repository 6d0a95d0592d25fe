"""Container launcher: `python -m lora_devcluster.launch SPEC.json`.

Owns: turning itself into one container process: join the pod's network namespace, unshare a
private mount namespace, bind-mount the pod's volumes at their mountPath, then exec the
container's command with its environment (so the pid the kubelet started is the container).
Must not: talk to the API server; every decision was made by the kubelet and is in the spec.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from lora_devcluster import ns


def run(spec: dict[str, Any]) -> None:
    netns = spec.get("netns")
    if netns:
        ns.setns(netns, ns.CLONE_NEWNET)
    utsns = spec.get("utsns")
    if utsns:
        ns.setns(utsns, ns.CLONE_NEWUTS)
    mounts = spec.get("mounts") or []
    if mounts:
        ns.unshare(ns.CLONE_NEWNS)
        ns.make_mounts_private()
        for m in mounts:
            # The kubelet created missing mount points beforehand (and removes them later).
            ns.bind_mount(m["source"], m["target"], readonly=bool(m.get("readonly")))
    workdir = spec.get("workdir")
    if workdir:
        os.chdir(workdir)
    argv: list[str] = spec["argv"]
    env: dict[str, str] = spec["env"]
    os.execvpe(argv[0], argv, env)


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
