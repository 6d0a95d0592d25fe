"""What the images are: their names, the recipes' constants, and the records the plan and the
builds pass around (`Tree`, `ImageSpec`, `Image`), with the one error type of the images.

Owns: the constants a key covers (bump a recipe number here when a build step changes what an
image holds). Must not: read the checkout or run anything (that is `tree` and `steps`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

NODE_IMAGES = ("base", "pause", "operator", "inference")
"""Every image, in build order (the base first: the Dockerfiles build FROM it); the roles of
the `Image` records."""
PUSHED_IMAGES = ("operator", "inference")
"""The images a cluster runs from a registry; base and pause are the local node's own."""

LOCAL_PREFIX = "localhost/lora-devcluster"
PAUSE_VERSION = "3.10"
PAUSE_SOURCE = "hack/pause/pause.c"
PAUSE_CFLAGS = ("-static", "-Os", "-s", "-Wall", "-Wextra")
BASE_SUITE = "bookworm"
# python-is-python3: the Dockerfiles run `python`, which python:3.11-slim has on PATH.
BASE_PACKAGES = ("ca-certificates", "python-is-python3", "python3", "python3-venv")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Bump a recipe number when the steps below change what an image holds without changing any
# input the key already covers; every image built from it is rebuilt.
BASE_RECIPE = 1
PAUSE_RECIPE = 1
DOCKERFILE_RECIPE = 2
# The uid the pause process runs as (Kubernetes' own pause image uses 65535).
PAUSE_USER = "65535:65535"
# How many archives per image the cache keeps (the newest; the others are deleted after a build).
KEEP_ARCHIVES = 2
KEY_LENGTH = 16

DOCKERFILE_IMAGES = {
    "operator": ("docker/operator.Dockerfile", "lora-operator/operator"),
    "inference": ("docker/inference.Dockerfile", "lora-operator/inference"),
}
# Commands that must succeed in each image before its archive is written: a broken image fails
# its build rather than a pod later. Run by buildah as the image's own user.
SMOKE: dict[str, tuple[str, ...]] = {
    "base": ("python3", "-c", "import venv, ssl, ensurepip"),
    "pause": ("/pause", "--version"),
    "operator": (
        "python",
        "-c",
        "import importlib.util, os, sys, lora_operator.__main__, lora_router.__main__; "
        "sys.exit('torch is in the operator image' if importlib.util.find_spec('torch') "
        "else 'lora_inference is in the operator image' "
        "if importlib.util.find_spec('lora_inference') "
        "else f'runs as uid {os.getuid()}, not 65532' if os.getuid() != 65532 else 0)",
    ),
    "inference": (
        "sh",
        "-c",
        "lora-inference --help >/dev/null && python -c 'import torch, diffusers, peft, "
        'lora_inference, os, sys; sys.exit(0 if os.getuid() == 65532 else "not uid 65532")\'',
    ),
}
# Where the Debian base's rootfs drops what a container never reads (docs, man pages, apt's
# package lists and downloaded .debs, logs).
BASE_TRIM = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
)


class ImageError(Exception):
    """An image cannot be planned, built or found; the message says what to do."""


class MissingImage(ImageError):
    """`built()` found an image that has not been built for the current tree."""


@dataclasses.dataclass(frozen=True)
class Tree:
    """The build inputs of a checkout: the content digest of every file a build may read
    (path relative to the root -> digest) and the text of the files the plan parses
    (Dockerfiles, .dockerignore, Chart.yaml, pyproject.toml)."""

    files: Mapping[str, str]
    texts: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class PipDownload:
    """One `pip download` that fills the wheelhouse a build installs from."""

    requirements: tuple[str, ...]
    index_url: str | None = None
    no_deps: bool = False


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """One image, fully decided: what it is built from and the key over those inputs."""

    name: str
    kind: Literal["debootstrap", "pause", "dockerfile"]
    ref: str
    key: str
    base: str | None = None
    dockerfile: str | None = None
    context: tuple[str, ...] = ()
    build_args: tuple[tuple[str, str], ...] = ()
    prefetch: tuple[PipDownload, ...] = ()
    smoke: tuple[str, ...] = ()

    def archive_name(self) -> str:
        return f"{self.name}-{self.key}.tar"

    def id_name(self) -> str:
        """The file beside the archive that holds the built image's ID in buildah's storage."""
        return f"{self.name}-{self.key}.id"


@dataclasses.dataclass(frozen=True)
class Image:
    """What a node needs to import an image. `ref`: the name inside the archive (containerd
    normalises `lora-operator/operator:0.2.0` to `docker.io/lora-operator/operator:0.2.0`, the
    name the kubelet resolves a pod's image to); `key`: changes iff the image's inputs do, so
    an import can be skipped when the node already holds that key; `role`: one of NODE_IMAGES."""

    ref: str
    archive: Path
    key: str
    role: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "ref": self.ref, "archive": str(self.archive), "key": self.key}
