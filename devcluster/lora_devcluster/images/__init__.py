"""The project's container images, built without a Docker daemon and cached by their inputs.

`ensure()` returns one `Image` per image a node runs (the Debian base, which helper pods use,
pause, operator, inference): its reference, a docker-archive tar in the cache and the key it was
built under, building what is missing; `built()` returns the same without building. The local
cluster imports those archives into its containerd; `kind load image-archive` takes them too.
`tag_local()` leaves the operator and inference images under their references in buildah's
storage (what `make images` does last), and `push()` copies them to a registry (`make push`).

    catalog.py  what the images are: names, the recipes' constants, the records, the error
    plan.py     the plan (pure): Dockerfiles, .dockerignore, the keys, which images to build
    tree.py     reading the checkout into a `Tree`; where the checkout and the cache are
    steps.py    running the tools: a step with its log, buildah's storage and containers
    build.py    the builds and the archive cache: `ensure()`, `built()`
    push.py     `tag_local()`, `push()`
    cli.py      `python -m lora_devcluster.images build | list | push`

Must not (any of them): import images into a node, pull from a registry, or touch images and
containers it did not create. This package re-exports what callers use, so they import
`lora_devcluster.images` alone.

    python -m lora_devcluster.images build [--only NAME]... [--json]
    python -m lora_devcluster.images list  [--only NAME]... [--json]
    python -m lora_devcluster.images push  REGISTRY [--only NAME]... [--plain-http] [--no-compress]
"""

from __future__ import annotations

from lora_devcluster.images.build import built, ensure
from lora_devcluster.images.catalog import (
    BASE_PACKAGES,
    NODE_IMAGES,
    PUSHED_IMAGES,
    Image,
    ImageError,
    ImageSpec,
    MissingImage,
    PipDownload,
    Tree,
)
from lora_devcluster.images.cli import build_parser, main
from lora_devcluster.images.plan import (
    app_version,
    compute_key,
    copy_sources,
    declared_args,
    dockerfile_instructions,
    is_ignored,
    parse_dockerignore,
    pip_extra,
    plan_builds,
    plan_images,
    plan_prefetch,
    push_destination,
    select_context,
)
from lora_devcluster.images.push import push, tag_local
from lora_devcluster.images.steps import check_tools, cleanup_stale
from lora_devcluster.images.tree import cache_root, default_root, load_tree

__all__ = [
    "BASE_PACKAGES",
    "NODE_IMAGES",
    "PUSHED_IMAGES",
    "Image",
    "ImageError",
    "ImageSpec",
    "MissingImage",
    "PipDownload",
    "Tree",
    "app_version",
    "build_parser",
    "built",
    "cache_root",
    "check_tools",
    "cleanup_stale",
    "compute_key",
    "copy_sources",
    "declared_args",
    "default_root",
    "dockerfile_instructions",
    "ensure",
    "is_ignored",
    "load_tree",
    "main",
    "parse_dockerignore",
    "pip_extra",
    "plan_builds",
    "plan_images",
    "plan_prefetch",
    "push",
    "push_destination",
    "select_context",
    "tag_local",
]
