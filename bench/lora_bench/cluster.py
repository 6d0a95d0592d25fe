"""The local cluster a benchmark runs on: lora-devcluster started in a folder of the caller's,
this process joined to its network (so it reaches the API server and pod IPs directly), torn
down however the benchmark ends, and then checked for anything left behind.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from lora_devcluster import cluster as cluster_mod
from lora_devcluster import images
from lora_devcluster.harness import Harness


@contextlib.contextmanager
def local_cluster(
    root: Path, node_images: Sequence[images.Image], *, namespace: str | None = None
) -> Iterator[Harness]:
    """A cluster in `root` with `node_images` on its node. When the benchmark fails inside,
    `namespace`'s pods and the end of their logs go to stderr first; after the teardown one
    line says how long the cluster lived and whether it left anything behind."""
    started = time.monotonic()
    with cluster_mod.joined(root, node_images=node_images, die_with_parent=True) as c:
        h = Harness(c)
        try:
            yield h
        except BaseException:
            if namespace is not None:
                print(h.describe_pods(namespace), file=sys.stderr)
                print(h.container_logs(namespace)[-6000:], file=sys.stderr)
            raise
    left = cluster_mod.leftovers(root)
    print(
        f"cluster up to torn down in {time.monotonic() - started:.0f} s; "
        + (f"LEFT BEHIND: {left}" if left else "nothing left behind")
    )
