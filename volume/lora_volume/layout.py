"""Where adapters live on disk and which paths a client may name.

The shared adapter volume is written only by the operator and read by every inference pod. Its
layout is defined here, once, for both sides:

    <adapter-root>/<name>/current            symlink -> revisions/<sha256>
    <adapter-root>/<name>/revisions/<sha256>/  the adapter's files, never changed once published
    <adapter-root>/<name>/target.json        which pods it is for (targeting.Target)

`current` is replaced atomically (a new symlink renamed over the old one), so a reader sees either
the old revision or the new one, never a half-written directory. `target.json` is replaced the
same way (a file renamed over the old one), and written before `current` first points anywhere,
so a resolver never sees a published adapter without it; it is outside the revision because a
selector can change while the weights do not. A pod is given the root of its
own namespace as `--adapter-root`. Next to the namespaces, the operator keeps its own folders:

    <volume-root>/.objects/sha256/<sha256>.safetensors   each content stored once
    <volume-root>/.tmp/                                  downloads in progress, cleared at start
    <volume-root>/_shared/                               files any namespace may stage from

and every revision directory holds a hard link to its object named
`pytorch_lora_weights.safetensors`. A plain adapter directory or `<name>.safetensors` file
directly under the root is also resolved, so a volume filled by hand works too, unless the
server resolves published adapters only (`--published-only`, as the chart runs it).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePath
from typing import NamedTuple, TypeVar

from lora_volume import errors, targeting

_P = TypeVar("_P", bound=PurePath)

CURRENT = "current"
TARGET = "target.json"
REVISIONS = "revisions"
OBJECTS = ".objects"
# A folder of the volume that every namespace's LoRAAdapters may copy from (volume-path
# sources); everything else a volume path may name lies in the adapter's own namespace. It
# starts with `_`, which no Kubernetes namespace name can: a namespace called `shared` would
# otherwise have this folder as its adapter root.
SHARED = "_shared"
TMP = ".tmp"
# The name diffusers' training scripts use; `files.find_weights_file` looks for it first.
WEIGHTS_FILE = "pytorch_lora_weights.safetensors"

# Kubernetes object names (RFC 1123 subdomain) plus the characters adapter names commonly use
# (`_`, uppercase); never a path separator, never `..`.
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


def check_adapter_name(name: object, *, param: str = "lora_name") -> str:
    """Return `name` if it is a valid adapter name, else raise InvalidName saying why."""
    if not isinstance(name, str) or not name:
        raise errors.InvalidName(f"'{param}' must be a non-empty string", param=param)
    if not _NAME.fullmatch(name) or ".." in name:
        raise errors.InvalidName(
            f"invalid adapter name {name!r}: use 1-253 letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit",
            param=param,
        )
    return name


def revision_dir(root: _P, name: str, sha256: str) -> _P:
    """A published revision; `root` may be the operator's path or a pod's (a PurePosixPath)."""
    return root / name / REVISIONS / sha256


class PublishedRevision(NamedTuple):
    adapter: str  # the adapter directory's name: the LoRAAdapter it is a revision of
    sha256: str  # the revision directory's name


_REVISION_PATH = re.compile(r"/([^/]+)/" + REVISIONS + r"/([0-9a-f]{64})/?$")


def published_revision(path: str | PurePath) -> PublishedRevision | None:
    """The adapter and revision a path of the form `.../<name>/revisions/<sha256>` names, or
    None for any other path (pure: the path is read as text, never resolved). The server puts
    both in its `/v1/models` card; the operator reads them back from an older server's card
    (or vLLM's), whose `root` is the path itself."""
    match = _REVISION_PATH.search(str(path))
    return PublishedRevision(match.group(1), match.group(2)) if match else None


def current_link(root: Path, name: str) -> Path:
    return root / name / CURRENT


def target_file(root: Path, name: str) -> Path:
    return root / name / TARGET


def read_target(root: Path, name: str, *, param: str | None = None) -> targeting.Target | None:
    """The pods `name` is meant for, or None when the volume does not say (filled by hand).

    `param` is the caller's name for `name`, carried by the NotFound a damaged target raises."""
    try:
        text = target_file(root, name).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise errors.NotFound(
            f"reading the target of adapter {name!r} failed: {e}", param=param
        ) from e
    try:
        return targeting.parse_target(text)
    except ValueError as e:
        raise errors.NotFound(
            f"the target of adapter {name!r} on the volume is damaged ({e}); stage it again",
            param=param,
        ) from e


def namespace_root(volume_root: Path, namespace: str) -> Path:
    """The adapter root of one namespace: what its pods get as `--adapter-root`."""
    return volume_root / namespace


def object_path(volume_root: Path, sha256: str) -> Path:
    """Where the content with this SHA-256 is stored, once for the whole volume."""
    return volume_root / OBJECTS / "sha256" / f"{sha256}.safetensors"


def tmp_dir(volume_root: Path) -> Path:
    """Where downloads in progress live: on the volume, so publishing is a rename."""
    return volume_root / TMP


def resolve_on_root(root: Path, name: str, *, published_only: bool = False) -> Path | None:
    """The adapter path for `name` under `root`, or None when the root has no such adapter.

    `published_only`: only what the operator published (a `current` link), never a file or
    folder placed under the root by hand."""
    link = current_link(root, name)
    if link.exists():
        return link.resolve()
    if published_only:
        return None
    for candidate in (root / name, root / f"{name}.safetensors"):
        # An adapter directory the operator manages is never a hand-filled adapter, even
        # when it has no `current` (unpublished, not collected yet).
        managed = (candidate / REVISIONS).exists() or (candidate / TARGET).exists()
        if candidate.exists() and not managed:
            return candidate.resolve()
    return None


def resolve_allowed(path: str | Path, allowed_roots: tuple[Path, ...], *, param: str) -> Path:
    """Resolve `path` (symlinks and `..` included) and check it lies under an allowed root.

    NotFound when it does not exist, PathForbidden when it resolves outside every root. The
    resolved path is returned, so later reads cannot be redirected by swapping a symlink.
    """
    raw = Path(path)
    if not raw.is_absolute():
        raise errors.InvalidPath(
            f"{param} must be an absolute path, got {str(path)!r}", param=param
        )
    try:
        resolved = raw.resolve(strict=True)
    except FileNotFoundError as e:
        raise errors.NotFound(f"{path} does not exist", param=param) from e
    except (OSError, RuntimeError) as e:
        raise errors.NotFound(f"{path} cannot be resolved: {e}", param=param) from e
    if not allowed_roots:
        raise errors.PathForbidden(
            f"{path} is outside every allowed root: this server allows no adapter paths; "
            "start it with --allowed-root or --adapter-root",
            param=param,
        )
    for root in allowed_roots:
        if resolved.is_relative_to(root.resolve()):
            return resolved
    roots = ", ".join(str(r) for r in allowed_roots)
    raise errors.PathForbidden(
        f"{path} resolves to {resolved}, outside the allowed roots ({roots})", param=param
    )
