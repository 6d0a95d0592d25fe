"""Running the build's tools: one step at a time with its output in a log, buildah's storage
and containers, the lock that keeps one build per cache.

Owns: the build's processes (each step in a process group of its own, killed with the build),
the containers named `lora-devcluster-build-*` and `buildah bud`'s working containers on the
local base. Must not: decide what to build (`plan`) or touch images and containers it did not
create.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from lora_devcluster import processes
from lora_devcluster.images import catalog

Progress = Callable[[str], None]


def say(message: str) -> None:
    print(f"lora-devcluster images: {message}", file=sys.stderr, flush=True)


def run(cmd: Sequence[str], log: Path, what: str) -> None:
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
            preexec_fn=processes.die_with_parent,
        )
        try:
            code = proc.wait()
        except BaseException:
            processes.stop_group(proc)
            raise
        f.write(f"# exit {code} after {time.monotonic() - t0:.1f} s\n")
    if code != 0:
        end = textwrap.indent(processes.tail(log), "    ")
        raise catalog.ImageError(
            f"{what} failed (exit {code}); the end of its log:\n{end}\n  full log: {log}"
        )


def capture(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
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
        raise catalog.ImageError(
            "building images needs root (buildah's storage is /var/lib/containers, debootstrap "
            "chroots); run it as root"
        )
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pkgs = ", ".join(_PACKAGES.get(t, t) for t in missing)
        raise catalog.ImageError(
            f"{', '.join(missing)} not found on PATH: `make install` installs them "
            f"(Debian: apt-get install {pkgs})"
        )


def tools_for(kind: str) -> tuple[str, ...]:
    return {
        "debootstrap": ("buildah", "debootstrap", "unshare", "tar"),
        "pause": ("buildah", "gcc"),
        "dockerfile": ("buildah",),
    }[kind]


@contextlib.contextmanager
def locked(cache: Path, progress: Progress) -> Iterator[None]:
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


def buildah_json(args: Sequence[str]) -> list[dict[str, object]]:
    proc = capture(["buildah", *args, "--json"])
    if proc.returncode != 0 or not proc.stdout.strip():
        return []
    data = json.loads(proc.stdout)
    return data if isinstance(data, list) else []


def cleanup_stale(cache: Path) -> list[str]:
    """Remove what an interrupted build left (run under the lock, so no build of ours is
    running): buildah containers of our builds and the cache's temporary files."""
    removed = remove_build_containers()
    tmp = cache / ".tmp"
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    return removed


def remove_build_containers() -> list[str]:
    removed: list[str] = []
    for c in buildah_json(["containers", "--all"]):
        name = str(c.get("containername", ""))
        image = str(c.get("imagename", ""))
        # Ours: named by this module, or `buildah bud`'s working containers on our base.
        ours = name.startswith(_CONTAINER_PREFIX) or (
            image.startswith(f"{catalog.LOCAL_PREFIX}/base:")
            and re.search(r"-working-container(-\d+)?$", name) is not None
        )
        if ours and capture(["buildah", "rm", str(c.get("id", name))]).returncode == 0:
            removed.append(name)
    return removed


@contextlib.contextmanager
def container(image: str, label: str) -> Iterator[str]:
    name = f"{_CONTAINER_PREFIX}{label}-{os.getpid()}"
    proc = capture(["buildah", "from", "--pull=never", "--name", name, image])
    if proc.returncode != 0:
        raise catalog.ImageError(f"buildah from {image} failed: {proc.stderr.strip()}")
    try:
        yield name
    finally:
        capture(["buildah", "rm", name])


def image_id(ref: str) -> str | None:
    proc = capture(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref])
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def image_exists(ref: str) -> bool:
    return image_id(ref) is not None


def smoke(image: str, spec: catalog.ImageSpec, log: Path) -> None:
    """Run the image's check in a container of it, as the image's own user."""
    if not spec.smoke:
        return
    fmt = "{{.OCIv1.Config.User}}"
    user = capture(["buildah", "inspect", "--type", "image", "--format", fmt, image]).stdout
    with container(image, f"smoke-{spec.name}") as c:
        argv = ["buildah", "run", "--isolation", "chroot"]
        argv += ["--user", user.strip()] if user.strip() else []
        run([*argv, c, "--", *spec.smoke], log, f"the {spec.name} image's check")


def export(image: str, spec: catalog.ImageSpec, cache: Path, log: Path) -> Path:
    """Write the image as a docker-archive tar under its key: a temporary name, then a rename,
    so a crash never leaves an archive that looks finished."""
    final = cache / spec.archive_name()
    tmp = cache / ".tmp" / f"{spec.archive_name()}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        run(
            ["buildah", "push", "--quiet", image, f"docker-archive:{tmp}:{spec.ref}"],
            log,
            f"exporting {spec.name}",
        )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def size(path: Path) -> str:
    """A file's size for a summary line: MB, or GB from 1 GB."""
    n = path.stat().st_size
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
