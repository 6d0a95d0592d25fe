"""The node's images: imported into one cached containerd store, then linked into each node.

Importing an image into containerd unpacks every layer, which takes minutes for the inference
image (torch with its CUDA libraries). So the images are imported into a *store*: a containerd
root under the cache that outlives clusters. An archive already imported is not imported again;
a new build of an image is imported over the old one, and containerd shares every layer the two
have in common (the dependency layers: only the project's own layers are new) and collects the
old image's own. Every node then starts from a copy of the store in which files are hard links:
content blobs and unpacked layers are never written after they are committed (containers write
to layers of their own), so sharing their inodes is safe. Only the two bolt databases, which
containerd writes in place, are real copies. A lock serialises nodes that start at once.

Owns: which archives the store holds, updating it with a throwaway containerd, linking it into
a node, recovering from a store an interrupted update left behind.
Must not: run on the host: the throwaway containerd keeps its state on the sandbox's /run.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from lora_devcluster import processes

# The files containerd rewrites in place: each node needs its own copy.
PRIVATE_FILES = (
    "io.containerd.metadata.v1.bolt/meta.db",
    "io.containerd.snapshotter.v1.overlayfs/metadata.db",
)
# archive identity -> ref, written after each complete update
RECORD = "lora-devcluster-images.json"
GC_TAG = "localhost/lora-devcluster/collect-garbage:now"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("LORA_NODE_IMAGE_CACHE", Path(base) / "lora-operator" / "node"))


def archive_identity(archive: Path) -> str:
    """A cheap identity for an archive: the image cache names archives by their inputs' key
    and writes them once (atomic rename), so path, size and mtime identify the content."""
    st = archive.stat()
    return f"{archive.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def normalize_ref(ref: str) -> str:
    """The name containerd gives an image reference (`lora-operator/x:1` is
    `docker.io/lora-operator/x:1`; `localhost/...` and other registries stay as they are)."""
    first, _, rest = ref.partition("/")
    if not rest:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def plan_update(
    held: Mapping[str, str], wanted: Mapping[str, str], listed: Sequence[str]
) -> tuple[list[str], list[str]]:
    """What to import (identities of archives the store lacks) and which image names to
    remove (those no wanted archive provides), given what the store's record says it holds and
    what containerd lists."""
    to_import = [identity for identity in wanted if held.get(identity) != wanted[identity]]
    keep = {normalize_ref(ref) for ref in wanted.values()}
    to_remove = sorted(name for name in listed if name not in keep)
    return to_import, to_remove


def listed_or(identities: Sequence[str], wanted: Mapping[str, str]) -> str:
    """The containerd name of the first image imported (the one to tag for a collection)."""
    return normalize_ref(wanted[identities[0]])


def link_tree(seed: Path, root: Path) -> None:
    """Copy `seed` to `root` with hard links, except the databases containerd writes."""
    for dirpath, dirnames, filenames in os.walk(seed):
        rel = Path(dirpath).relative_to(seed)
        target = root / rel
        target.mkdir(parents=True, exist_ok=True)
        shutil.copystat(dirpath, target)
        for name in filenames:
            src = Path(dirpath, name)
            if str(rel / name) in PRIVATE_FILES:
                shutil.copy2(src, target / name)
            elif src.is_symlink():
                os.symlink(os.readlink(src), target / name)
            elif name != RECORD:
                _link_or_copy(src, target / name)
        for name in dirnames:
            if Path(dirpath, name).is_symlink():
                os.symlink(os.readlink(Path(dirpath, name)), target / name)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.copy2(src, dst)  # the cache is on another filesystem: slower, same result


@contextlib.contextmanager
def locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


async def provide(
    images: Mapping[Path, str],
    node_root: Path,
    config_for: Callable[[Path, str, str], str],
    env: Mapping[str, str],
    log: Path,
    progress: Callable[[str], object] | None = None,
) -> None:
    """Give a node (its containerd root, `node_root`) the `images` (archive -> ref): update
    the store under the cache with what it lacks, then link the store into the node."""
    cache = cache_dir()
    store = cache / "store"
    wanted = {archive_identity(a): ref for a, ref in images.items()}
    archives = {archive_identity(a): a for a in images}
    with locked(cache):
        try:
            await _update(store, wanted, archives, config_for, env, log, progress)
        except RuntimeError:
            # An update interrupted before may have left the store inconsistent: start over.
            if progress:
                progress(f"rebuilding the image store {store} from scratch")
            shutil.rmtree(store, ignore_errors=True)
            await _update(store, wanted, archives, config_for, env, log, progress)
        t = time.monotonic()
        link_tree(store, node_root)
    if progress:
        progress(f"linked the node's images from {store} in {time.monotonic() - t:.1f} s")


async def _update(
    store: Path,
    wanted: Mapping[str, str],
    archives: Mapping[str, Path],
    config_for: Callable[[Path, str, str], str],
    env: Mapping[str, str],
    log: Path,
    progress: Callable[[str], object] | None,
) -> None:
    record = store / RECORD
    try:
        held: dict[str, str] = json.loads(record.read_text())
    except (OSError, ValueError):
        held = {}
    if held == dict(wanted):
        return
    store.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)  # until this update completes, the store is suspect
    state = Path("/run/containerd-store")
    socket = state / "containerd.sock"
    config = store.parent / "store.toml"
    config.write_text(config_for(store, str(state), str(socket)))
    proc = await processes.start("containerd-store", ["containerd", f"--config={config}"], log, env)
    try:
        deadline = time.monotonic() + 60
        while not socket.exists():
            if not proc.running or time.monotonic() > deadline:
                raise RuntimeError(f"containerd for the image store did not start; see {log}")
            await asyncio.sleep(0.1)
        ctr = ["ctr", f"--address={socket}", "--namespace=k8s.io"]
        listed = (await processes.run_checked([*ctr, "images", "ls", "--quiet"], env)).split()
        to_import, to_remove = plan_update(held, wanted, listed)
        for identity in to_import:
            t = time.monotonic()
            archive = archives[identity]
            await processes.run_checked([*ctr, "images", "import", str(archive)], env)
            if progress:
                progress(f"imported {archive.name} in {time.monotonic() - t:.1f} s")
        if to_import or to_remove:
            # A synchronous removal makes containerd collect what no image references any
            # more: the layers of images removed here or replaced by a new build of the same
            # name. A throwaway tag gives it something to remove when nothing else goes.
            if not to_remove:
                await processes.run_checked(
                    [*ctr, "images", "tag", "--force", listed_or(to_import, wanted), GC_TAG], env
                )
                to_remove = [GC_TAG]
            await processes.run_checked([*ctr, "images", "rm", "--sync", *to_remove], env)
    finally:
        await proc.stop(grace=10)
        config.unlink(missing_ok=True)
    record.write_text(json.dumps(dict(wanted), indent=1, sort_keys=True))
