"""Handing the built images on: `tag_local()` names the operator and inference images in
buildah's storage (what `make images` does last), `push()` copies them to a registry
(`make push`).

Must not: build (the caller passes what `build.ensure()` or `build.built()` returned).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from lora_devcluster.images import catalog, plan, steps


def _bare_id(image_id: str | None) -> str:
    return (image_id or "").removeprefix("sha256:")


def tag_local(records: Sequence[catalog.Image], *, progress: steps.Progress | None = None) -> None:
    """Leave each image of `records` (what `ensure()` or `built()` returned: operator,
    inference) in buildah's storage under its reference (`lora-operator/operator:<appVersion>`),
    naming the build its archive holds, so that `buildah push` (or podman, skopeo) finds it by
    name. The newest build already sits in the storage as the layer cache, so naming it costs
    nothing; only when the storage has lost it is the archive loaded (about a minute for the
    inference image)."""
    say = progress or steps.say
    unknown = [r.role for r in records if r.role not in catalog.PUSHED_IMAGES]
    if unknown:
        raise catalog.ImageError(
            f"{unknown[0]}: only {', '.join(catalog.PUSHED_IMAGES)} are tagged and pushed"
        )
    if records:
        steps.check_tools(())
    for record in records:
        id_file = record.archive.with_suffix(".id")
        want = id_file.read_text().strip() if id_file.exists() else None
        if want and _bare_id(steps.image_id(record.ref)) == want:
            continue
        if want and steps.image_exists(want):
            steps.capture(["buildah", "tag", want, record.ref])
        else:
            log = record.archive.parent / "logs" / f"{record.role}-{record.key}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            say(f"{record.role}: loading {record.archive.name} into buildah's storage")
            pull = ["buildah", "pull", "--quiet", f"docker-archive:{record.archive}"]
            steps.run(pull, log, f"loading {record.role}")
            want = _bare_id(steps.image_id(record.ref))
            id_file.write_text(want + "\n")
        if not want or _bare_id(steps.image_id(record.ref)) != want:
            raise catalog.ImageError(
                f"{record.archive} is not in buildah's storage as {record.ref}"
            )
        say(f"{record.role:<9} tagged {record.ref}")


def push(
    registry: str,
    records: Sequence[catalog.Image],
    *,
    plain_http: bool = False,
    compress: bool = True,
    progress: steps.Progress | None = None,
) -> list[str]:
    """Tag each image of `records` (`tag_local`) and copy it from buildah's storage to
    `plan.push_destination(ref, registry)`; returns the references pushed. `plain_http`: a registry
    without TLS (buildah's --tls-verify=false); `compress=False` sends the layers uncompressed
    (for a registry on the same machine: gzipping the inference image's 5 GB takes minutes)."""
    say = progress or steps.say
    plan.push_destination(
        "lora-operator/operator", registry
    )  # a bad REGISTRY fails before any work
    tag_local(records, progress=progress)
    pushed: list[str] = []
    for record in records:
        dest = plan.push_destination(record.ref, registry)
        log = record.archive.parent / "logs" / f"push-{record.role}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"# push {record.ref} -> {dest}\n")
        cmd = ["buildah", "push", "--quiet", f"--tls-verify={str(not plain_http).lower()}"]
        cmd += [] if compress else ["--disable-compression"]
        t0 = time.monotonic()
        steps.run([*cmd, record.ref, f"docker://{dest}"], log, f"pushing {record.role} to {dest}")
        say(f"{record.role:<9} pushed {time.monotonic() - t0:6.1f} s  {dest}")
        pushed.append(dest)
    return pushed
