"""The node's images: imported once into a cached containerd store, then linked into each node.

Importing an image into containerd unpacks every layer, which takes minutes for the inference
image (torch with its CUDA libraries). So the first node to need a set of images imports them
into a *seed*: a containerd root under the cache, keyed by the archives' contents and
containerd's version. Every node then starts from a copy of the seed in which files are hard
links: content blobs and unpacked layers are never written after they are committed (containers
write to layers of their own), so sharing their inodes is safe. Only the two bolt databases,
which containerd writes in place, are real copies.

Owns: the seed's key, building a seed with a throwaway containerd, linking it into a node.
Must not: run on the host: the throwaway containerd keeps its state on the sandbox's /run.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lora_devcluster import processes

# The files containerd rewrites in place: each node needs its own copy.
PRIVATE_FILES = (
    "io.containerd.metadata.v1.bolt/meta.db",
    "io.containerd.snapshotter.v1.overlayfs/metadata.db",
)
SEEDS_KEPT = 2  # each seed holds the images twice (blobs and unpacked layers): keep few


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("LORA_NODE_IMAGE_CACHE", Path(base) / "lora-operator" / "node"))


def containerd_version() -> str:
    out = subprocess.run(["containerd", "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def seed_key(archive_digests: Sequence[str], runtime_version: str) -> str:
    """The seed for a set of image archives (by content, in any order) and a containerd."""
    h = hashlib.sha256(runtime_version.encode())
    for digest in sorted(archive_digests):
        h.update(b"\0" + digest.encode())
    return h.hexdigest()[:16]


def archive_digest(archive: Path) -> str:
    """A cheap identity for an archive: the image cache names archives by their inputs' key
    and writes them once (atomic rename), so name, size and mtime identify the content."""
    st = archive.stat()
    return f"{archive.resolve()}:{st.st_size}:{st.st_mtime_ns}"


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
            else:
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


def prune(cache: Path, keep: str) -> None:
    """Remove old seeds beyond the newest SEEDS_KEPT (never `keep`), and failed attempts."""
    seeds = sorted(
        (d for d in cache.iterdir() if d.is_dir() and not d.name.startswith(".")),
        key=lambda d: d.stat().st_mtime,
        reverse=True,
    )
    for old in [d for d in seeds if d.name != keep][SEEDS_KEPT - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


async def build_seed(
    archives: Sequence[Path],
    seed: Path,
    config_for: Callable[[Path, str, str], str],
    env: Mapping[str, str],
    log: Path,
) -> None:
    """Import `archives` with a containerd of its own rooted in a temporary directory next to
    `seed`, stop it, and rename the directory into place (another node may win the race: then
    ours is dropped)."""
    tmp = seed.parent / f".{seed.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    state = Path("/run/containerd-seed")
    socket = state / "containerd.sock"
    config = tmp.with_suffix(".toml")
    tmp.mkdir(parents=True)
    config.write_text(config_for(tmp, str(state), str(socket)))
    proc = await processes.start("containerd-seed", ["containerd", f"--config={config}"], log, env)
    imported = False
    try:
        deadline = time.monotonic() + 60
        while not socket.exists():
            if not proc.running or time.monotonic() > deadline:
                raise RuntimeError(f"containerd for the image cache did not start; see {log}")
            await asyncio.sleep(0.1)
        ctr = ["ctr", f"--address={socket}", "--namespace=k8s.io"]
        for archive in archives:
            await processes.run_checked([*ctr, "images", "import", str(archive)], env)
        imported = True
    finally:
        await proc.stop(grace=10)
        config.unlink(missing_ok=True)
        if not imported:
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.rename(seed)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another node built the same seed first
