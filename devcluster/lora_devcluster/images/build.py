"""Building what the cache lacks: debootstrap for the Debian base, gcc for the pause program,
`buildah bud` for the Dockerfiles, each image checked (`catalog.SMOKE`) and written as a
docker-archive tar under its key; `ensure()` and `built()`, the records a node imports.

Owns: the archives in the cache (`<name>-<key>.tar`, the newest `catalog.KEEP_ARCHIVES` of
each), the local bases and the layer-cache tags in buildah's storage. Must not: decide what to
build (`plan.plan_builds` does), import images into a node, or pull from a registry.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lora_devcluster import processes
from lora_devcluster.images import catalog, plan, steps, tree

_HOST_CA_DIR = Path("/etc/ssl/certs")
# What a build takes on 2 busy cores, so a user knows whether to wait.
_HINTS = {"base": " (1-3 min)", "operator": " (about 1 min)", "inference": " (5-10 min)"}


def _build_base(spec: catalog.ImageSpec, cache: Path, work: Path, log: Path) -> None:
    rootfs = work / "rootfs"
    mirror = os.environ.get("LORA_DEBIAN_MIRROR", catalog.DEFAULT_MIRROR)
    # In a mount namespace of its own, so the /proc and /sys debootstrap mounts in the target
    # vanish with it, even when it is killed.
    include = f"--include={','.join(catalog.BASE_PACKAGES)}"
    unshare = ["unshare", "--mount", "--propagation=private"]
    steps.run(
        [
            *unshare,
            "debootstrap",
            "--variant=minbase",
            include,
            catalog.BASE_SUITE,
            str(rootfs),
            mirror,
        ],
        log,
        f"debootstrap {catalog.BASE_SUITE} from {mirror} (LORA_DEBIAN_MIRROR)",
    )
    for rel in catalog.BASE_TRIM:
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
    steps.run(
        ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), *excludes, "-cf", str(tar), "."],
        log,
        "packing the base's root filesystem",
    )
    shutil.rmtree(rootfs)
    with steps.container("scratch", "base") as c:
        steps.run(["buildah", "add", "--quiet", c, str(tar), "/"], log, "adding the base's files")
        path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env = ["--env=LANG=C.UTF-8", f"--env={path}"]
        steps.run(
            ["buildah", "config", "--os=linux", "--arch=amd64", *env, '--cmd=["python3"]', c],
            log,
            "configuring the base",
        )
        replaced = steps.image_id(spec.ref)
        steps.run(["buildah", "commit", "--quiet", c, spec.ref], log, "committing the base")
    if replaced and replaced != steps.image_id(spec.ref):
        # The tag moved to the new base; the old one would linger untagged.
        steps.capture(["buildah", "rmi", replaced])
    tar.unlink()
    steps.smoke(spec.ref, spec, log)
    steps.export(spec.ref, spec, cache, log)


def _build_pause(root: Path, work: Path, log: Path) -> str:
    binary = work / "pause"
    steps.run(
        ["gcc", *catalog.PAUSE_CFLAGS, "-o", str(binary), str(root / catalog.PAUSE_SOURCE)],
        log,
        f"compiling {catalog.PAUSE_SOURCE} (gcc -static needs libc6-dev)",
    )
    iid = work / "iid"
    with steps.container("scratch", "pause") as c:
        steps.run(["buildah", "copy", "--quiet", c, str(binary), "/pause"], log, "adding /pause")
        config = [
            "--os=linux",
            "--arch=amd64",
            f"--user={catalog.PAUSE_USER}",
            '--entrypoint=["/pause"]',
        ]
        steps.run(["buildah", "config", *config, c], log, "configuring the pause image")
        steps.run(
            ["buildah", "commit", "--quiet", "--iidfile", str(iid), c], log, "committing pause"
        )
    return iid.read_text().strip()


def _prefetch(spec: catalog.ImageSpec, wheels: Path, log: Path, progress: steps.Progress) -> bool:
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
        steps.run([*cmd, *step.requirements], log, f"downloading {spec.name}'s wheels")
    return True


def _has_pip() -> bool:
    return steps.capture([sys.executable, "-m", "pip", "--version"]).returncode == 0


def _build_dockerfile(
    spec: catalog.ImageSpec,
    root: Path,
    cache: Path,
    work: Path,
    log: Path,
    progress: steps.Progress,
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
        raise catalog.ImageError(f"{spec.name}: a Dockerfile image without a Dockerfile")
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
            steps.run([*cmd, *offline, str(context)], log, f"buildah bud {spec.dockerfile}")
            return (work / "iid").read_text().strip()
        except catalog.ImageError:
            if "No matching distribution found" not in processes.tail(log, 200):
                raise
            progress(f"{spec.name}: a wheel is not in the wheelhouse; building from the index")
    steps.run([*cmd, str(context)], log, f"buildah bud {spec.dockerfile}")
    return (work / "iid").read_text().strip()


def _prune_archives(cache: Path, name: str, keep: str) -> None:
    """Keep the newest catalog.KEEP_ARCHIVES archives of an image (always the current one)."""
    others = sorted(
        (
            p
            for p in cache.glob(f"{name}-*.tar")
            if re.fullmatch(rf"{name}-[0-9a-f]+\.tar", p.name) and p.name != keep
        ),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for p in others[catalog.KEEP_ARCHIVES - 1 :]:
        p.unlink(missing_ok=True)
        p.with_suffix(".id").unlink(missing_ok=True)


def _prune_bases(current: str) -> None:
    """Untag old local bases (their archives stay in the cache while kept)."""
    for img in steps.buildah_json(["images"]):
        names = img.get("names")
        for name in names if isinstance(names, list) else []:
            if str(name).startswith(f"{catalog.LOCAL_PREFIX}/base:") and name != current:
                steps.capture(["buildah", "rmi", str(name)])


def _ensure_base_loaded(
    spec: catalog.ImageSpec, cache: Path, log: Path, progress: steps.Progress
) -> None:
    """The base in buildah's storage, under the name the Dockerfiles' BASE_IMAGE gets."""
    if steps.image_exists(spec.ref):
        return
    archive = cache / spec.archive_name()
    progress(f"base: loading {archive.name} into buildah's storage")
    steps.run(["buildah", "pull", "--quiet", f"docker-archive:{archive}"], log, "loading the base")
    if not steps.image_exists(spec.ref):
        raise catalog.ImageError(f"{archive} did not load as {spec.ref}; delete it and build again")


def _summary(spec: catalog.ImageSpec, what: str, seconds: float, archive: Path) -> str:
    return (
        f"{spec.name:<9} {what:<6} {seconds:6.1f} s {steps.size(archive):>8}  {spec.ref}  {archive}"
    )


def build_one(
    spec: catalog.ImageSpec,
    specs: Mapping[str, catalog.ImageSpec],
    root: Path,
    cache: Path,
    progress: steps.Progress,
) -> None:
    steps.check_tools(steps.tools_for(spec.kind))
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
                steps.smoke(iid, spec, log)
                steps.export(iid, spec, cache, log)
            finally:
                _keep_for_layer_cache(spec, iid)
            if spec.kind == "dockerfile":
                # Which image of buildah's storage the archive holds, so that tag_local() can
                # name it without reading the archive.
                (cache / spec.id_name()).write_text(iid.removeprefix("sha256:") + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _prune_archives(cache, spec.name, spec.archive_name())


def _keep_for_layer_cache(spec: catalog.ImageSpec, iid: str) -> None:
    """Keep the newest build of a Dockerfile image under a cache tag, so its layers (the 5 GB
    of dependencies above all) serve the next build; the build it replaces is removed."""
    if spec.kind != "dockerfile":
        steps.capture(["buildah", "rmi", iid])
        return
    tag = f"{spec.ref.rsplit(':', 1)[0]}:layer-cache"
    old = steps.capture(["buildah", "images", "--quiet", "--no-trunc", tag]).stdout.split()
    steps.capture(["buildah", "tag", iid, tag])
    for previous in old:
        if previous.removeprefix("sha256:") != iid.removeprefix("sha256:"):
            # --force: the replaced build may still carry the image's own reference
            # (tag_local() names it); no container of ours uses it.
            steps.capture(["buildah", "rmi", "--force", previous])


def _images(
    specs: Mapping[str, catalog.ImageSpec], names: Sequence[str], cache: Path
) -> list[catalog.Image]:
    return [
        catalog.Image(specs[n].ref, cache / specs[n].archive_name(), specs[n].key, n) for n in names
    ]


def _plan(
    root: Path | None, build_args: Mapping[str, str] | None
) -> tuple[Path, dict[str, catalog.ImageSpec]]:
    root = (root or tree.default_root()).resolve()
    return root, plan.plan_images(tree.load_tree(root), build_args)


def built(
    names: Sequence[str] = catalog.NODE_IMAGES,
    *,
    root: Path | None = None,
    cache_dir: Path | None = None,
    build_args: Mapping[str, str] | None = None,
) -> list[catalog.Image]:
    """The images already built for the current tree; builds nothing. Raises
    catalog.MissingImage naming the first image whose archive is missing and how to build it."""
    root, specs = _plan(root, build_args)
    cache = cache_dir or tree.cache_root()
    todo = plan.plan_builds(
        specs, names, [n for n in specs if (cache / specs[n].archive_name()).exists()]
    )
    missing = [n for n in todo if n in names]
    if missing:
        spec = specs[missing[0]]
        raise catalog.MissingImage(
            f"the {spec.name} image ({spec.ref}) is not built for this tree (no "
            f"{cache / spec.archive_name()}); build it: `make images` or "
            f"`lora-devcluster images build`"
        )
    return _images(specs, names, cache)


def ensure(
    names: Sequence[str] = catalog.NODE_IMAGES,
    *,
    root: Path | None = None,
    cache_dir: Path | None = None,
    build_args: Mapping[str, str] | None = None,
    progress: steps.Progress | None = None,
) -> list[catalog.Image]:
    """The images `names` (default: all of them), building what the cache lacks for
    the current tree. Prints one line per image: cached or built, seconds, archive size."""
    say = progress or steps.say
    root, specs = _plan(root, build_args)
    cache = cache_dir or tree.cache_root()

    def archived() -> list[str]:
        return [n for n in specs if (cache / specs[n].archive_name()).exists()]

    took: dict[str, float] = {}
    if plan.plan_builds(specs, names, archived()):
        with steps.locked(cache, say):
            # Another build may have finished while this one waited for the lock.
            todo = plan.plan_builds(specs, names, archived())
            if todo:
                steps.check_tools(())
                removed = steps.cleanup_stale(cache)
                if removed:
                    say(f"removed {len(removed)} buildah container(s) an interrupted build left")
            try:
                for name in todo:
                    t0 = time.monotonic()
                    build_one(specs[name], specs, root, cache, say)
                    took[name] = time.monotonic() - t0
            except BaseException:
                # An interrupted `buildah bud` leaves its working containers behind.
                steps.remove_build_containers()
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
