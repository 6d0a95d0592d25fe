"""Reading the checkout: the `catalog.Tree` of build inputs (the content digest of each file a
build may read), where the checkout and the archive cache are.

Must not: decide anything about the images (that is `plan`) or write anything.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

from lora_devcluster.images import catalog, plan


def default_root() -> Path:
    """The checkout this module sits in (the Dockerfiles and the chart live there)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "docker").is_dir():
        raise catalog.ImageError(f"{root} is not a lora-operator checkout; pass --root")
    return root


def cache_root() -> Path:
    """LORA_IMAGE_CACHE, or ~/.cache/lora-operator/images (XDG_CACHE_HOME honoured)."""
    override = os.environ.get("LORA_IMAGE_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lora-operator" / "images"


def _list_files(root: Path) -> list[str]:
    """The files a build may read: git's tracked and untracked-but-not-ignored files (what
    `git status` shows), or, outside a git checkout, every file under the root."""
    # safe.directory: a checkout owned by another user is still read (nothing is run from it).
    git = ["git", "-c", "safe.directory=*", "-C", str(root)]
    try:
        out = subprocess.run(
            [*git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
        names = sorted({n for n in out.decode().split("\0") if n})
        return [n for n in names if os.path.lexists(root / n)]
    except (OSError, subprocess.CalledProcessError):
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != ".git"]
            rel = Path(dirpath).relative_to(root)
            found += [(rel / f).as_posix() for f in filenames]
        return sorted(found)


def _digest(path: Path) -> str:
    st = path.lstat()
    h = hashlib.sha256()
    if stat.S_ISLNK(st.st_mode):
        h.update(b"link:" + os.readlink(path).encode())
    else:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    mode = "x" if st.st_mode & stat.S_IXUSR else "-"
    return f"{h.hexdigest()}:{mode}"


_TEXTS = ("pyproject.toml", "charts/lora-operator/Chart.yaml", ".dockerignore")


def load_tree(root: Path) -> catalog.Tree:
    """Hash the checkout's build inputs. Only files under the Dockerfiles' COPY sources and the
    pause source are hashed; everything else is listed with an empty digest (no image reads it)."""
    files = _list_files(root)
    texts = {p: (root / p).read_text() for p in _TEXTS if (root / p).is_file()}
    wanted_roots: set[str] = {catalog.PAUSE_SOURCE}
    for dockerfile, _ in catalog.DOCKERFILE_IMAGES.values():
        path = root / dockerfile
        if path.is_file():
            texts[dockerfile] = path.read_text()
            wanted_roots.add(dockerfile)
            wanted_roots.update(s.split("/", 1)[0] for s in plan.copy_sources(texts[dockerfile]))
    # A COPY of the whole context or of a glob may read anything: hash everything then.
    hash_all = any(r == "" or any(c in r for c in "*?[") for r in wanted_roots)
    digests = {
        f: _digest(root / f)
        if hash_all or f in wanted_roots or f.split("/", 1)[0] in wanted_roots
        else ""
        for f in files
    }
    return catalog.Tree(files=digests, texts=texts)
