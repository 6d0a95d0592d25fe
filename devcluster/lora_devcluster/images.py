"""The project's container images, built without a Docker daemon and cached by their inputs.

`ensure()` returns one `Image` per image a node runs (the Debian base, which helper pods use,
pause, operator, inference): its reference, a docker-archive tar in the cache and the key it was
built under, building what is missing; `built()` returns the same without building. The local
cluster imports those archives into its containerd; `kind load image-archive` takes them too.
`tag_local()` leaves the operator and inference images under their references in buildah's
storage (what `make images` does last), and `push()` copies them to a registry (`make push`).

Owns: the plan (which images exist, which inputs each one has, the key over those inputs: pure
functions of a `Tree` read from the checkout), and its execution (debootstrap for the Debian
base, gcc for the pause program, `buildah bud` for the Dockerfiles, the archives in the cache).
Must not: import images into a node, pull from a registry, or touch images and containers it did
not create.

    python -m lora_devcluster.images build [--only NAME]... [--json]
    python -m lora_devcluster.images list  [--only NAME]... [--json]
    python -m lora_devcluster.images push  REGISTRY [--only NAME]... [--plain-http] [--no-compress]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

# ---- what the images are

NODE_IMAGES = ("base", "pause", "operator", "inference")
"""Every image, in build order (the base first: the Dockerfiles build FROM it); the roles of
the `Image` records."""

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
_PR_SET_PDEATHSIG = 1

_DOCKERFILE_IMAGES = {
    "operator": ("docker/operator.Dockerfile", "lora-operator/operator"),
    "inference": ("docker/inference.Dockerfile", "lora-operator/inference"),
}
# Commands that must succeed in each image before its archive is written: a broken image fails
# its build rather than a pod later. Run by buildah as the image's own user.
_SMOKE: dict[str, tuple[str, ...]] = {
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
_BASE_TRIM = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
)
_HOST_CA_DIR = Path("/etc/ssl/certs")
# What a build takes on 2 busy cores, so a user knows whether to wait.
_HINTS = {"base": " (1-3 min)", "operator": " (about 1 min)", "inference": " (5-10 min)"}


class ImageError(Exception):
    """An image cannot be planned, built or found; the message says what to do."""


class MissingImage(ImageError):
    """`built()` found an image that has not been built for the current tree."""


# ---- the inputs, read once from the checkout


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
    normalises `lora-operator/operator:0.1.0` to `docker.io/lora-operator/operator:0.1.0`, the
    name the kubelet resolves a pod's image to); `key`: changes iff the image's inputs do, so
    an import can be skipped when the node already holds that key; `role`: one of NODE_IMAGES."""

    ref: str
    archive: Path
    key: str
    role: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "ref": self.ref, "archive": str(self.archive), "key": self.key}


# ---- pure: Dockerfiles, .dockerignore, keys, the plan


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments and blanks dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        result.append((word.upper(), rest.strip()))
    if pending.strip():
        word, _, rest = pending.strip().partition(" ")
        result.append((word.upper(), rest.strip()))
    return result


def declared_args(dockerfile_text: str) -> set[str]:
    """The names of the Dockerfile's ARGs (global and per stage)."""
    names: set[str] = set()
    for word, args in dockerfile_instructions(dockerfile_text):
        if word == "ARG":
            names.add(args.split("=", 1)[0].strip())
    return names


def copy_sources(dockerfile_text: str) -> list[str]:
    """The build-context paths the Dockerfile's COPY and ADD read (not `--from` a stage)."""
    sources: list[str] = []
    for word, args in dockerfile_instructions(dockerfile_text):
        if word not in ("COPY", "ADD"):
            continue
        words: list[str]
        rest = args
        flags: list[str] = []
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        if any(f.startswith("--from=") for f in flags):
            continue
        if rest.startswith("["):
            try:
                words = [str(w) for w in json.loads(rest)]
            except json.JSONDecodeError as e:
                raise ImageError(f"cannot parse `{word} {args}`: {e}") from e
        else:
            words = rest.split()
        if len(words) < 2:
            raise ImageError(f"`{word} {args}` names no source and destination")
        for src in words[:-1]:
            if re.match(r"^[a-z]+://", src):
                raise ImageError(f"`{word} {src}`: remote sources cannot be keyed; copy a file")
            sources.append(_clean(src))
    return sources


def _clean(path: str) -> str:
    cleaned = os.path.normpath(path.strip()).lstrip("/")
    return "" if cleaned in (".", "") else cleaned


@dataclasses.dataclass(frozen=True)
class IgnorePattern:
    regex: re.Pattern[str]
    negated: bool


def parse_dockerignore(text: str) -> list[IgnorePattern]:
    """.dockerignore patterns as Docker reads them: `#` comments, `!` exceptions, `*`, `?`,
    `[...]` within a path element, `**` across elements; the last matching pattern decides."""
    patterns: list[IgnorePattern] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        if negated:
            line = line[1:].strip()
        line = _clean(line)
        if not line:
            continue
        patterns.append(IgnorePattern(re.compile(_pattern_regex(line)), negated))
    return patterns


def _pattern_regex(pattern: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                i += 2
                if pattern.startswith("/", i):
                    i += 1
                # `**` at the end takes everything; elsewhere any number of elements (or none).
                out.append(".*" if i >= len(pattern) else "(?:.*/)?")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : end]
                if body.startswith(("!", "^")):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out) + r"\Z"


def is_ignored(path: str, patterns: Sequence[IgnorePattern]) -> bool:
    """Whether the build context leaves `path` out. A pattern that matches a parent directory
    matches everything under it, as in Docker."""
    parents = [path]
    parts = path.split("/")
    parents += ["/".join(parts[:i]) for i in range(1, len(parts))]
    ignored = False
    for p in patterns:
        if any(p.regex.match(candidate) for candidate in parents):
            ignored = not p.negated
    return ignored


def select_context(
    files: Iterable[str], sources: Sequence[str], patterns: Sequence[IgnorePattern]
) -> tuple[str, ...]:
    """The files of the build context that the COPY sources pull in, sorted."""
    compiled = [re.compile(_pattern_regex(s)) if s else None for s in sources]
    chosen: list[str] = []
    for f in files:
        if is_ignored(f, patterns):
            continue
        parts = f.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(rx is None or any(rx.match(p) for p in prefixes) for rx in compiled):
            chosen.append(f)
    return tuple(sorted(chosen))


def compute_key(inputs: Mapping[str, object]) -> str:
    """The key over an image's inputs: a sha256 of their canonical JSON, shortened."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:KEY_LENGTH]


def push_destination(ref: str, registry: str) -> str:
    """Where `push` copies an image: `REGISTRY/<the reference's last path part>:<tag>`, so
    `lora-operator/operator:0.1.0` goes to `registry.example.com/lora-operator/operator:0.1.0`
    for REGISTRY=registry.example.com/lora-operator (pure)."""
    dest = registry.strip().removeprefix("docker://").rstrip("/")
    if not dest or "://" in dest or any(c.isspace() for c in dest) or dest.startswith("/"):
        raise ImageError(
            f"REGISTRY {registry!r}: expected host[:port][/path], "
            "e.g. registry.example.com/lora-operator"
        )
    return f"{dest}/{ref.rsplit('/', 1)[-1]}"


def app_version(chart_yaml: str) -> str:
    """The chart's appVersion, read as the Makefile reads it."""
    m = re.search(r'^appVersion: *"?([^"\n]*)"?\s*$', chart_yaml, re.MULTILINE)
    if not m or not m.group(1).strip():
        raise ImageError("charts/lora-operator/Chart.yaml has no appVersion")
    return m.group(1).strip()


def pip_extra(dockerfile_text: str) -> str | None:
    """The pyproject extra whose dependencies the Dockerfile installs (read from pyproject.toml
    as `["optional-dependencies"]["extra"]`)."""
    runs = " ".join(a for w, a in dockerfile_instructions(dockerfile_text) if w == "RUN")
    m = re.search(r"""\["optional-dependencies"\]\["([a-z0-9_-]+)"\]""", runs)
    return m.group(1) if m else None


def plan_prefetch(
    pyproject: str, extra: str, build_args: Mapping[str, str]
) -> tuple[PipDownload, ...]:
    """The downloads that put every wheel an image installs into the wheelhouse: the build
    backend's requirements and the extra's, torch first from TORCH_INDEX_URL when it is set."""
    data = tomllib.loads(pyproject)
    extras = data.get("project", {}).get("optional-dependencies", {})
    if extra not in extras:
        raise ImageError(f"pyproject.toml has no [{extra}] extra")
    reqs = tuple(data.get("build-system", {}).get("requires", [])) + tuple(extras[extra])
    steps: list[PipDownload] = []
    index = build_args.get("TORCH_INDEX_URL")
    torch = tuple(r for r in reqs if re.match(r"torch\b", r))
    if index and torch:
        steps.append(PipDownload(torch, index_url=index, no_deps=True))
    steps.append(PipDownload(tuple(reqs)))
    return tuple(steps)


def _file_inputs(tree: Tree, paths: Iterable[str]) -> dict[str, str]:
    return {p: tree.files[p] for p in paths}


def _text(tree: Tree, path: str) -> str:
    try:
        return tree.texts[path]
    except KeyError:
        raise ImageError(f"{path} is missing from the checkout") from None


def plan_images(tree: Tree, build_args: Mapping[str, str] | None = None) -> dict[str, ImageSpec]:
    """Every image (base, pause, operator, inference) with its key. Pure: the same tree and
    arguments give the same keys; a key changes iff one of that image's inputs does."""
    args = dict(build_args or {})
    if "BASE_IMAGE" in args:
        raise ImageError("BASE_IMAGE is set by the build (the local Debian base); leave it out")
    specs: dict[str, ImageSpec] = {}

    base_inputs = {
        "kind": "debootstrap",
        "recipe": BASE_RECIPE,
        "suite": BASE_SUITE,
        "variant": "minbase",
        "packages": sorted(BASE_PACKAGES),
        "trim": list(_BASE_TRIM),
    }
    base_key = compute_key(base_inputs)
    base_ref = f"{LOCAL_PREFIX}/base:{base_key}"
    specs["base"] = ImageSpec("base", "debootstrap", base_ref, base_key, smoke=_SMOKE["base"])

    if PAUSE_SOURCE not in tree.files:
        raise ImageError(f"{PAUSE_SOURCE} is missing from the checkout")
    pause_ref = f"{LOCAL_PREFIX}/pause:{PAUSE_VERSION}"
    pause_inputs = {
        "kind": "pause",
        "recipe": PAUSE_RECIPE,
        "ref": pause_ref,
        "source": tree.files[PAUSE_SOURCE],
        "cflags": list(PAUSE_CFLAGS),
        "user": PAUSE_USER,
    }
    specs["pause"] = ImageSpec(
        "pause",
        "pause",
        pause_ref,
        compute_key(pause_inputs),
        context=(PAUSE_SOURCE,),
        smoke=_SMOKE["pause"],
    )

    version = app_version(_text(tree, "charts/lora-operator/Chart.yaml"))
    patterns = parse_dockerignore(tree.texts.get(".dockerignore", ""))
    pyproject = _text(tree, "pyproject.toml")
    for name, (dockerfile, repository) in _DOCKERFILE_IMAGES.items():
        text = _text(tree, dockerfile)
        declared = declared_args(text)
        if "BASE_IMAGE" not in declared:
            raise ImageError(
                f"{dockerfile} has no `ARG BASE_IMAGE`: its FROM cannot be the local base"
            )
        passed = {k: v for k, v in args.items() if k in declared}
        passed["BASE_IMAGE"] = base_ref
        context = select_context(tree.files, copy_sources(text), patterns)
        ref = f"{repository}:{version}"
        inputs = {
            "kind": "dockerfile",
            "recipe": DOCKERFILE_RECIPE,
            "ref": ref,
            "dockerfile": tree.files[dockerfile],
            "files": _file_inputs(tree, context),
            "build_args": passed,
            "base": base_key,
        }
        extra = pip_extra(text)
        specs[name] = ImageSpec(
            name,
            "dockerfile",
            ref,
            compute_key(inputs),
            base="base",
            dockerfile=dockerfile,
            context=context,
            build_args=tuple(sorted(passed.items())),
            prefetch=plan_prefetch(pyproject, extra, passed) if extra else (),
            smoke=_SMOKE[name],
        )
    return specs


def plan_builds(
    specs: Mapping[str, ImageSpec], wanted: Sequence[str], archived: Iterable[str]
) -> list[str]:
    """The images to build, in order (a base before what is built on it), so that every
    wanted image has its archive. `archived`: the names whose archive for the current key
    exists. A base is built only when an image that needs it is built and its archive is gone."""
    unknown = [n for n in wanted if n not in specs]
    if unknown:
        raise ImageError(
            f"unknown image(s) {', '.join(unknown)}; choose from {', '.join(NODE_IMAGES)}"
        )
    have = set(archived)
    todo = [n for n in wanted if n not in have]
    bases = {specs[n].base for n in todo if specs[n].base and specs[n].base not in have}
    # specs are in build order: a base comes before the images built on it.
    return [n for n in specs if n in todo or n in bases]


# ---- I/O: reading the checkout


def default_root() -> Path:
    """The checkout this module sits in (the Dockerfiles and the chart live there)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "docker").is_dir():
        raise ImageError(f"{root} is not a lora-operator checkout; pass --root")
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


def load_tree(root: Path) -> Tree:
    """Hash the checkout's build inputs. Only files under the Dockerfiles' COPY sources and the
    pause source are hashed; everything else is listed with an empty digest (no image reads it)."""
    files = _list_files(root)
    texts = {p: (root / p).read_text() for p in _TEXTS if (root / p).is_file()}
    wanted_roots: set[str] = {PAUSE_SOURCE}
    for dockerfile, _ in _DOCKERFILE_IMAGES.values():
        path = root / dockerfile
        if path.is_file():
            texts[dockerfile] = path.read_text()
            wanted_roots.add(dockerfile)
            wanted_roots.update(s.split("/", 1)[0] for s in copy_sources(texts[dockerfile]))
    # A COPY of the whole context or of a glob may read anything: hash everything then.
    hash_all = any(r == "" or any(c in r for c in "*?[") for r in wanted_roots)
    digests = {
        f: _digest(root / f)
        if hash_all or f in wanted_roots or f.split("/", 1)[0] in wanted_roots
        else ""
        for f in files
    }
    return Tree(files=digests, texts=texts)


# ---- I/O: running tools


Progress = Callable[[str], None]


def _say(message: str) -> None:
    print(f"lora-devcluster images: {message}", file=sys.stderr, flush=True)


def _tail(log: Path, lines: int = 30) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _run(cmd: Sequence[str], log: Path, what: str) -> None:
    """Run a build step with its output appended to `log`; a failure names the step, shows
    the log's tail and where the whole log is. The step runs in a process group of its own
    that is killed when this one is interrupted (debootstrap and buildah would run on)."""
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            code = proc.wait()
        except BaseException:
            _stop_group(proc)
            raise
        f.write(f"# exit {code} after {time.monotonic() - t0:.1f} s\n")
    if code != 0:
        raise ImageError(
            f"{what} failed (exit {code}); the end of its log:\n{_tail(log)}\n  full log: {log}"
        )


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the step's process group (buildah unmounts and removes what it can), SIGKILL
    what is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _capture(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=False)


_PACKAGES = {
    "buildah": "buildah",
    "debootstrap": "debootstrap",
    "gcc": "gcc and libc6-dev",
    "unshare": "util-linux",
    "tar": "tar",
}


def check_tools(tools: Iterable[str]) -> None:
    """Root, and each tool on PATH; the error names the Debian package and `make install`."""
    if os.geteuid() != 0:
        raise ImageError(
            "building images needs root (buildah's storage is /var/lib/containers, debootstrap "
            "chroots); run it as root"
        )
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pkgs = ", ".join(_PACKAGES.get(t, t) for t in missing)
        raise ImageError(
            f"{', '.join(missing)} not found on PATH: `make install` installs them "
            f"(Debian: apt-get install {pkgs})"
        )


def _tools_for(kind: str) -> tuple[str, ...]:
    return {
        "debootstrap": ("buildah", "debootstrap", "unshare", "tar"),
        "pause": ("buildah", "gcc"),
        "dockerfile": ("buildah",),
    }[kind]


@contextlib.contextmanager
def _locked(cache: Path, progress: Progress) -> Iterator[None]:
    """One build at a time per cache (two worktrees share it and buildah's storage)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another image build (lock {cache / '.lock'})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


_CONTAINER_PREFIX = "lora-devcluster-build-"


def _buildah_json(args: Sequence[str]) -> list[dict[str, object]]:
    proc = _capture(["buildah", *args, "--json"])
    if proc.returncode != 0 or not proc.stdout.strip():
        return []
    data = json.loads(proc.stdout)
    return data if isinstance(data, list) else []


def cleanup_stale(cache: Path) -> list[str]:
    """Remove what an interrupted build left (run under the lock, so no build of ours is
    running): buildah containers of our builds and the cache's temporary files."""
    removed = _remove_build_containers()
    tmp = cache / ".tmp"
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    return removed


def _remove_build_containers() -> list[str]:
    removed: list[str] = []
    for c in _buildah_json(["containers", "--all"]):
        name = str(c.get("containername", ""))
        image = str(c.get("imagename", ""))
        # Ours: named by this module, or `buildah bud`'s working containers on our base.
        ours = name.startswith(_CONTAINER_PREFIX) or (
            image.startswith(f"{LOCAL_PREFIX}/base:")
            and re.search(r"-working-container(-\d+)?$", name) is not None
        )
        if ours and _capture(["buildah", "rm", str(c.get("id", name))]).returncode == 0:
            removed.append(name)
    return removed


@contextlib.contextmanager
def _container(image: str, label: str) -> Iterator[str]:
    name = f"{_CONTAINER_PREFIX}{label}-{os.getpid()}"
    proc = _capture(["buildah", "from", "--pull=never", "--name", name, image])
    if proc.returncode != 0:
        raise ImageError(f"buildah from {image} failed: {proc.stderr.strip()}")
    try:
        yield name
    finally:
        _capture(["buildah", "rm", name])


def _image_id(ref: str) -> str | None:
    proc = _capture(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref])
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def _image_exists(ref: str) -> bool:
    return _image_id(ref) is not None


def _smoke(image: str, spec: ImageSpec, log: Path) -> None:
    """Run the image's check in a container of it, as the image's own user."""
    if not spec.smoke:
        return
    fmt = "{{.OCIv1.Config.User}}"
    user = _capture(["buildah", "inspect", "--type", "image", "--format", fmt, image]).stdout
    with _container(image, f"smoke-{spec.name}") as c:
        run = ["buildah", "run", "--isolation", "chroot"]
        run += ["--user", user.strip()] if user.strip() else []
        _run([*run, c, "--", *spec.smoke], log, f"the {spec.name} image's check")


def _export(image: str, spec: ImageSpec, cache: Path, log: Path) -> Path:
    """Write the image as a docker-archive tar under its key: a temporary name, then a rename,
    so a crash never leaves an archive that looks finished."""
    final = cache / spec.archive_name()
    tmp = cache / ".tmp" / f"{spec.archive_name()}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        _run(
            ["buildah", "push", "--quiet", image, f"docker-archive:{tmp}:{spec.ref}"],
            log,
            f"exporting {spec.name}",
        )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _build_base(spec: ImageSpec, cache: Path, work: Path, log: Path) -> None:
    rootfs = work / "rootfs"
    mirror = os.environ.get("LORA_DEBIAN_MIRROR", DEFAULT_MIRROR)
    # In a mount namespace of its own, so the /proc and /sys debootstrap mounts in the target
    # vanish with it, even when it is killed.
    include = f"--include={','.join(BASE_PACKAGES)}"
    unshare = ["unshare", "--mount", "--propagation=private"]
    _run(
        [*unshare, "debootstrap", "--variant=minbase", include, BASE_SUITE, str(rootfs), mirror],
        log,
        f"debootstrap {BASE_SUITE} from {mirror} (LORA_DEBIAN_MIRROR)",
    )
    for rel in _BASE_TRIM:
        d = rootfs / rel
        if d.is_dir() and not d.is_symlink():
            for child in d.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    tar = work / "rootfs.tar"
    # Devices, /proc and /sys are the runtime's to provide.
    excludes = ["--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*"]
    _run(
        ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), *excludes, "-cf", str(tar), "."],
        log,
        "packing the base's root filesystem",
    )
    shutil.rmtree(rootfs)
    with _container("scratch", "base") as c:
        _run(["buildah", "add", "--quiet", c, str(tar), "/"], log, "adding the base's files")
        path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env = ["--env=LANG=C.UTF-8", f"--env={path}"]
        _run(
            ["buildah", "config", "--os=linux", "--arch=amd64", *env, '--cmd=["python3"]', c],
            log,
            "configuring the base",
        )
        replaced = _image_id(spec.ref)
        _run(["buildah", "commit", "--quiet", c, spec.ref], log, "committing the base")
    if replaced and replaced != _image_id(spec.ref):
        # The tag moved to the new base; the old one would linger untagged.
        _capture(["buildah", "rmi", replaced])
    tar.unlink()
    _smoke(spec.ref, spec, log)
    _export(spec.ref, spec, cache, log)


def _build_pause(root: Path, work: Path, log: Path) -> str:
    binary = work / "pause"
    _run(
        ["gcc", *PAUSE_CFLAGS, "-o", str(binary), str(root / PAUSE_SOURCE)],
        log,
        f"compiling {PAUSE_SOURCE} (gcc -static needs libc6-dev)",
    )
    iid = work / "iid"
    with _container("scratch", "pause") as c:
        _run(["buildah", "copy", "--quiet", c, str(binary), "/pause"], log, "adding /pause")
        config = ["--os=linux", "--arch=amd64", f"--user={PAUSE_USER}", '--entrypoint=["/pause"]']
        _run(["buildah", "config", *config, c], log, "configuring the pause image")
        _run(["buildah", "commit", "--quiet", "--iidfile", str(iid), c], log, "committing pause")
    return iid.read_text().strip()


def _prefetch(spec: ImageSpec, wheels: Path, log: Path, progress: Progress) -> bool:
    """Download the wheels the build will install into the wheelhouse on the host (files
    already there are not fetched again). pip's own HTTP cache is no help where a proxy
    strips cache headers; a directory of wheels always is. False: no usable pip here."""
    if not spec.prefetch:
        return False
    if sys.version_info[:2] != (3, 11) or not _has_pip():
        progress(f"{spec.name}: no Python 3.11 pip on this host; the build downloads every wheel")
        return False
    wheels.mkdir(parents=True, exist_ok=True)
    for step in spec.prefetch:
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check"]
        cmd += [f"--dest={wheels}", f"--find-links={wheels}"]
        if step.index_url:
            cmd += ["--index-url", step.index_url]
        if step.no_deps:
            cmd.append("--no-deps")
        _run([*cmd, *step.requirements], log, f"downloading {spec.name}'s wheels")
    return True


def _has_pip() -> bool:
    return _capture([sys.executable, "-m", "pip", "--version"]).returncode == 0


def _build_dockerfile(
    spec: ImageSpec, root: Path, cache: Path, work: Path, log: Path, progress: Progress
) -> str:
    # The context holds exactly the keyed files, so what is built is what the key names
    # (an untracked or ignored file in the checkout cannot slip in).
    context = work / "context"
    for rel in spec.context:
        src, dst = root / rel, context / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    context.mkdir(exist_ok=True)
    if spec.dockerfile is None:
        raise ImageError(f"{spec.name}: a Dockerfile image without a Dockerfile")
    # Layers cached: the Dockerfiles install the dependencies from pyproject.toml alone, so a
    # change to the project's code rebuilds only the small layers after them.
    # --force-rm: no container outlives a failed build.
    cmd = ["buildah", "bud", "--pull=never", "--isolation=chroot", "--network=host"]
    cmd += ["--layers=true", "--force-rm", f"--iidfile={work / 'iid'}"]
    cmd += [f"--file={root / spec.dockerfile}"]
    for k, v in spec.build_args:
        cmd += ["--build-arg", f"{k}={v}"]
    if (_HOST_CA_DIR / "ca-certificates.crt").exists():
        # Package downloads go through TLS only the host's CA bundle trusts: mounted for the
        # build, never copied into a layer.
        cmd += ["-v", f"{_HOST_CA_DIR}:{_HOST_CA_DIR}:ro"]
    wheels = cache / "wheels"
    if _prefetch(spec, wheels, log, progress):
        # Offline from the wheelhouse: with an index as well, pip prefers the index's copy of a
        # wheel it also finds locally and downloads it again.
        # A stable path: the mount is part of the layer cache's key for the RUN steps.
        conf = cache / "pip.conf"
        conf.write_text("[global]\nno-index = true\nfind-links = /wheels\n")
        offline = ["-v", f"{wheels}:/wheels:ro", "-v", f"{conf}:/etc/pip.conf:ro"]
        try:
            _run([*cmd, *offline, str(context)], log, f"buildah bud {spec.dockerfile}")
            return (work / "iid").read_text().strip()
        except ImageError:
            if "No matching distribution found" not in _tail(log, 200):
                raise
            progress(f"{spec.name}: a wheel is not in the wheelhouse; building from the index")
    _run([*cmd, str(context)], log, f"buildah bud {spec.dockerfile}")
    return (work / "iid").read_text().strip()


def _prune_archives(cache: Path, name: str, keep: str) -> None:
    """Keep the newest KEEP_ARCHIVES archives of an image (always the current one)."""
    others = sorted(
        (
            p
            for p in cache.glob(f"{name}-*.tar")
            if re.fullmatch(rf"{name}-[0-9a-f]+\.tar", p.name) and p.name != keep
        ),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for p in others[KEEP_ARCHIVES - 1 :]:
        p.unlink(missing_ok=True)
        p.with_suffix(".id").unlink(missing_ok=True)


def _prune_bases(current: str) -> None:
    """Untag old local bases (their archives stay in the cache while kept)."""
    for img in _buildah_json(["images"]):
        names = img.get("names")
        for name in names if isinstance(names, list) else []:
            if str(name).startswith(f"{LOCAL_PREFIX}/base:") and name != current:
                _capture(["buildah", "rmi", str(name)])


def _ensure_base_loaded(spec: ImageSpec, cache: Path, log: Path, progress: Progress) -> None:
    """The base in buildah's storage, under the name the Dockerfiles' BASE_IMAGE gets."""
    if _image_exists(spec.ref):
        return
    archive = cache / spec.archive_name()
    progress(f"base: loading {archive.name} into buildah's storage")
    _run(["buildah", "pull", "--quiet", f"docker-archive:{archive}"], log, "loading the base")
    if not _image_exists(spec.ref):
        raise ImageError(f"{archive} did not load as {spec.ref}; delete it and build again")


def _size(path: Path) -> str:
    n = path.stat().st_size
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _summary(spec: ImageSpec, what: str, seconds: float, archive: Path) -> str:
    return f"{spec.name:<9} {what:<6} {seconds:6.1f} s {_size(archive):>8}  {spec.ref}  {archive}"


def _build_one(
    spec: ImageSpec, specs: Mapping[str, ImageSpec], root: Path, cache: Path, progress: Progress
) -> None:
    check_tools(_tools_for(spec.kind))
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{spec.name}-{spec.key}.log"
    log.write_text(f"# {spec.name} {spec.ref} key {spec.key}\n")
    work = cache / ".tmp" / f"{spec.name}-{spec.key}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    progress(f"{spec.name}: building{_HINTS.get(spec.name, '')}; log {log}")
    try:
        if spec.kind == "debootstrap":
            _build_base(spec, cache, work, log)
            _prune_bases(spec.ref)
        else:
            if spec.base:
                _ensure_base_loaded(specs[spec.base], cache, log, progress)
            if spec.kind == "pause":
                iid = _build_pause(root, work, log)
            else:
                iid = _build_dockerfile(spec, root, cache, work, log, progress)
            try:
                _smoke(iid, spec, log)
                _export(iid, spec, cache, log)
            finally:
                _keep_for_layer_cache(spec, iid)
            if spec.kind == "dockerfile":
                # Which image of buildah's storage the archive holds, so that tag_local() can
                # name it without reading the archive.
                (cache / spec.id_name()).write_text(iid.removeprefix("sha256:") + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _prune_archives(cache, spec.name, spec.archive_name())


def _keep_for_layer_cache(spec: ImageSpec, iid: str) -> None:
    """Keep the newest build of a Dockerfile image under a cache tag, so its layers (the 5 GB
    of dependencies above all) serve the next build; the build it replaces is removed."""
    if spec.kind != "dockerfile":
        _capture(["buildah", "rmi", iid])
        return
    tag = f"{spec.ref.rsplit(':', 1)[0]}:layer-cache"
    old = _capture(["buildah", "images", "--quiet", "--no-trunc", tag]).stdout.split()
    _capture(["buildah", "tag", iid, tag])
    for previous in old:
        if previous.removeprefix("sha256:") != iid.removeprefix("sha256:"):
            # --force: the replaced build may still carry the image's own reference
            # (tag_local() names it); no container of ours uses it.
            _capture(["buildah", "rmi", "--force", previous])


def _images(specs: Mapping[str, ImageSpec], names: Sequence[str], cache: Path) -> list[Image]:
    return [Image(specs[n].ref, cache / specs[n].archive_name(), specs[n].key, n) for n in names]


def _plan(
    root: Path | None, build_args: Mapping[str, str] | None
) -> tuple[Path, dict[str, ImageSpec]]:
    root = (root or default_root()).resolve()
    return root, plan_images(load_tree(root), build_args)


def built(
    names: Sequence[str] = NODE_IMAGES,
    *,
    root: Path | None = None,
    cache_dir: Path | None = None,
    build_args: Mapping[str, str] | None = None,
) -> list[Image]:
    """The images already built for the current tree; builds nothing. Raises
    MissingImage naming the first image whose archive is missing and how to build it."""
    root, specs = _plan(root, build_args)
    cache = cache_dir or cache_root()
    todo = plan_builds(
        specs, names, [n for n in specs if (cache / specs[n].archive_name()).exists()]
    )
    missing = [n for n in todo if n in names]
    if missing:
        spec = specs[missing[0]]
        raise MissingImage(
            f"the {spec.name} image ({spec.ref}) is not built for this tree (no "
            f"{cache / spec.archive_name()}); build it: `make images` or "
            f"`lora-devcluster images build`"
        )
    return _images(specs, names, cache)


def ensure(
    names: Sequence[str] = NODE_IMAGES,
    *,
    root: Path | None = None,
    cache_dir: Path | None = None,
    build_args: Mapping[str, str] | None = None,
    progress: Progress | None = None,
) -> list[Image]:
    """The images `names` (default: all of them), building what the cache lacks for
    the current tree. Prints one line per image: cached or built, seconds, archive size."""
    say = progress or _say
    root, specs = _plan(root, build_args)
    cache = cache_dir or cache_root()

    def archived() -> list[str]:
        return [n for n in specs if (cache / specs[n].archive_name()).exists()]

    took: dict[str, float] = {}
    if plan_builds(specs, names, archived()):
        with _locked(cache, say):
            # Another build may have finished while this one waited for the lock.
            todo = plan_builds(specs, names, archived())
            if todo:
                check_tools(())
                removed = cleanup_stale(cache)
                if removed:
                    say(f"removed {len(removed)} buildah container(s) an interrupted build left")
            try:
                for name in todo:
                    t0 = time.monotonic()
                    _build_one(specs[name], specs, root, cache, say)
                    took[name] = time.monotonic() - t0
            except BaseException:
                # An interrupted `buildah bud` leaves its working containers behind.
                _remove_build_containers()
                raise
    for name in names:
        spec = specs[name]
        say(
            _summary(
                spec,
                "built" if name in took else "cached",
                took.get(name, 0.0),
                cache / spec.archive_name(),
            )
        )
    return _images(specs, names, cache)


PUSHED_IMAGES = ("operator", "inference")
"""The images a cluster runs from a registry; base and pause are the local node's own."""


def _bare_id(image_id: str | None) -> str:
    return (image_id or "").removeprefix("sha256:")


def tag_local(records: Sequence[Image], *, progress: Progress | None = None) -> None:
    """Leave each image of `records` (what `ensure()` or `built()` returned: operator,
    inference) in buildah's storage under its reference (`lora-operator/operator:<appVersion>`),
    naming the build its archive holds, so that `buildah push` (or podman, skopeo) finds it by
    name. The newest build already sits in the storage as the layer cache, so naming it costs
    nothing; only when the storage has lost it is the archive loaded (about a minute for the
    inference image)."""
    say = progress or _say
    unknown = [r.role for r in records if r.role not in PUSHED_IMAGES]
    if unknown:
        raise ImageError(f"{unknown[0]}: only {', '.join(PUSHED_IMAGES)} are tagged and pushed")
    if records:
        check_tools(())
    for record in records:
        id_file = record.archive.with_suffix(".id")
        want = id_file.read_text().strip() if id_file.exists() else None
        if want and _bare_id(_image_id(record.ref)) == want:
            continue
        if want and _image_exists(want):
            _capture(["buildah", "tag", want, record.ref])
        else:
            log = record.archive.parent / "logs" / f"{record.role}-{record.key}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            say(f"{record.role}: loading {record.archive.name} into buildah's storage")
            pull = ["buildah", "pull", "--quiet", f"docker-archive:{record.archive}"]
            _run(pull, log, f"loading {record.role}")
            want = _bare_id(_image_id(record.ref))
            id_file.write_text(want + "\n")
        if not want or _bare_id(_image_id(record.ref)) != want:
            raise ImageError(f"{record.archive} is not in buildah's storage as {record.ref}")
        say(f"{record.role:<9} tagged {record.ref}")


def push(
    registry: str,
    records: Sequence[Image],
    *,
    plain_http: bool = False,
    compress: bool = True,
    progress: Progress | None = None,
) -> list[str]:
    """Tag each image of `records` (`tag_local`) and copy it from buildah's storage to
    `push_destination(ref, registry)`; returns the references pushed. `plain_http`: a registry
    without TLS (buildah's --tls-verify=false); `compress=False` sends the layers uncompressed
    (for a registry on the same machine: gzipping the inference image's 5 GB takes minutes)."""
    say = progress or _say
    push_destination("lora-operator/operator", registry)  # a bad REGISTRY fails before any work
    tag_local(records, progress=progress)
    pushed: list[str] = []
    for record in records:
        dest = push_destination(record.ref, registry)
        log = record.archive.parent / "logs" / f"push-{record.role}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"# push {record.ref} -> {dest}\n")
        cmd = ["buildah", "push", "--quiet", f"--tls-verify={str(not plain_http).lower()}"]
        cmd += [] if compress else ["--disable-compression"]
        t0 = time.monotonic()
        _run([*cmd, record.ref, f"docker://{dest}"], log, f"pushing {record.role} to {dest}")
        say(f"{record.role:<9} pushed {time.monotonic() - t0:6.1f} s  {dest}")
        pushed.append(dest)
    return pushed


# ---- CLI


def _parse_build_args(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ImageError(f"--build-arg {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def build_parser(prog: str = "python -m lora_devcluster.images") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The project's container images (base, pause, operator, inference), built with "
        "buildah from a local Debian base and kept as docker-archive tars in a cache keyed by "
        f"their inputs ({cache_root()}; LORA_IMAGE_CACHE).",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    for action, help_text in (
        (
            "build",
            "build what is missing for the current tree, leave operator and inference tagged "
            "in buildah's storage; print one line per image",
        ),
        ("list", "the images built for the current tree; fails naming any that is missing"),
        ("push", "push operator and inference (built and tagged first) to REGISTRY"),
    ):
        p = sub.add_parser(action, help=help_text)
        if action == "push":
            p.add_argument(
                "registry",
                metavar="REGISTRY",
                help="host[:port][/path]: the images go to REGISTRY/operator:<appVersion> and "
                "REGISTRY/inference:<appVersion>",
            )
            p.add_argument(
                "--plain-http", action="store_true", help="the registry speaks HTTP, not HTTPS"
            )
            p.add_argument(
                "--no-compress",
                action="store_true",
                help="send the layers uncompressed (a registry on this machine)",
            )
        p.add_argument(
            "--only",
            action="append",
            choices=PUSHED_IMAGES if action == "push" else NODE_IMAGES,
            metavar="NAME",
            help=f"only this image ({', '.join(NODE_IMAGES)}); repeatable",
        )
        p.add_argument(
            "--build-arg",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a Dockerfile ARG (e.g. TORCH_INDEX_URL); part of the image's key",
        )
        p.add_argument("--root", type=Path, help="the checkout (default: this module's)")
        p.add_argument(
            "--cache-dir", type=Path, help="the archive cache (default LORA_IMAGE_CACHE)"
        )
        p.add_argument(
            "--json",
            action="store_true",
            help="print the images ({role, ref, archive, key}) as JSON on stdout",
        )
        p.add_argument("--archives", action="store_true", help="print the archive paths only")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog or "python -m lora_devcluster.images").parse_args(argv)
    # SIGTERM (make's, a CI runner's) unwinds like Ctrl-C: the running step is killed, the
    # build's containers and temporary files are removed.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        build_args = _parse_build_args(args.build_arg)
        root, cache_dir = args.root, args.cache_dir
        if args.action == "push":
            names = tuple(args.only or PUSHED_IMAGES)
            records = ensure(names, root=root, cache_dir=cache_dir, build_args=build_args)
            push(args.registry, records, plain_http=args.plain_http, compress=not args.no_compress)
            return 0
        names = tuple(args.only or NODE_IMAGES)
        act = ensure if args.action == "build" else built
        records = act(names, root=root, cache_dir=cache_dir, build_args=build_args)
        if args.action == "build":
            # The records ensure() built or found: the tree may change meanwhile.
            tag_local([r for r in records if r.role in PUSHED_IMAGES])
    except ImageError as e:
        print(f"lora-devcluster images: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lora-devcluster images: interrupted; nothing half-built was kept", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps([r.as_dict() for r in records], indent=2))
    elif args.archives:
        print("\n".join(str(r.archive) for r in records))
    elif args.action == "list":
        for r in records:
            print(f"{r.role:<9} {r.key}  {_size(r.archive):>8}  {r.ref}  {r.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
