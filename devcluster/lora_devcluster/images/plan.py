"""The plan (pure): Dockerfiles and .dockerignore as Docker reads them, which files each image
reads, the key over an image's inputs, and which images a build must make.

Owns: every decision about what to build, as functions of a `catalog.Tree` and the build
arguments: the same tree gives the same keys, and a key changes iff one of its image's inputs does.
Must not: read files, run tools or look at the cache (the callers pass what exists).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence

from lora_devcluster.images import catalog


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
                raise catalog.ImageError(f"cannot parse `{word} {args}`: {e}") from e
        else:
            words = rest.split()
        if len(words) < 2:
            raise catalog.ImageError(f"`{word} {args}` names no source and destination")
        for src in words[:-1]:
            if re.match(r"^[a-z]+://", src):
                raise catalog.ImageError(
                    f"`{word} {src}`: remote sources cannot be keyed; copy a file"
                )
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
    return hashlib.sha256(blob).hexdigest()[: catalog.KEY_LENGTH]


def push_destination(ref: str, registry: str) -> str:
    """Where `push` copies an image: `REGISTRY/<the reference's last path part>:<tag>`, so
    `lora-operator/operator:0.2.0` goes to `registry.example.com/lora-operator/operator:0.2.0`
    for REGISTRY=registry.example.com/lora-operator (pure)."""
    dest = registry.strip().removeprefix("docker://").rstrip("/")
    if not dest or "://" in dest or any(c.isspace() for c in dest) or dest.startswith("/"):
        raise catalog.ImageError(
            f"REGISTRY {registry!r}: expected host[:port][/path], "
            "e.g. registry.example.com/lora-operator"
        )
    return f"{dest}/{ref.rsplit('/', 1)[-1]}"


def app_version(chart_yaml: str) -> str:
    """The chart's appVersion, read as the Makefile reads it."""
    m = re.search(r'^appVersion: *"?([^"\n]*)"?\s*$', chart_yaml, re.MULTILINE)
    if not m or not m.group(1).strip():
        raise catalog.ImageError("charts/lora-operator/Chart.yaml has no appVersion")
    return m.group(1).strip()


def pip_extra(dockerfile_text: str) -> str | None:
    """The pyproject extra whose dependencies the Dockerfile installs (read from pyproject.toml
    as `["optional-dependencies"]["extra"]`)."""
    runs = " ".join(a for w, a in dockerfile_instructions(dockerfile_text) if w == "RUN")
    m = re.search(r"""\["optional-dependencies"\]\["([a-z0-9_-]+)"\]""", runs)
    return m.group(1) if m else None


def plan_prefetch(
    pyproject: str, extra: str, build_args: Mapping[str, str]
) -> tuple[catalog.PipDownload, ...]:
    """The downloads that put every wheel an image installs into the wheelhouse: the build
    backend's requirements and the extra's, torch first from TORCH_INDEX_URL when it is set."""
    data = tomllib.loads(pyproject)
    extras = data.get("project", {}).get("optional-dependencies", {})
    if extra not in extras:
        raise catalog.ImageError(f"pyproject.toml has no [{extra}] extra")
    reqs = tuple(data.get("build-system", {}).get("requires", [])) + tuple(extras[extra])
    steps: list[catalog.PipDownload] = []
    index = build_args.get("TORCH_INDEX_URL")
    torch = tuple(r for r in reqs if re.match(r"torch\b", r))
    if index and torch:
        steps.append(catalog.PipDownload(torch, index_url=index, no_deps=True))
    steps.append(catalog.PipDownload(tuple(reqs)))
    return tuple(steps)


def _file_inputs(tree: catalog.Tree, paths: Iterable[str]) -> dict[str, str]:
    return {p: tree.files[p] for p in paths}


def _text(tree: catalog.Tree, path: str) -> str:
    try:
        return tree.texts[path]
    except KeyError:
        raise catalog.ImageError(f"{path} is missing from the checkout") from None


def plan_images(
    tree: catalog.Tree, build_args: Mapping[str, str] | None = None
) -> dict[str, catalog.ImageSpec]:
    """Every image (base, pause, operator, inference) with its key. Pure: the same tree and
    arguments give the same keys; a key changes iff one of that image's inputs does."""
    args = dict(build_args or {})
    if "BASE_IMAGE" in args:
        raise catalog.ImageError(
            "BASE_IMAGE is set by the build (the local Debian base); leave it out"
        )
    specs: dict[str, catalog.ImageSpec] = {}

    base_inputs = {
        "kind": "debootstrap",
        "recipe": catalog.BASE_RECIPE,
        "suite": catalog.BASE_SUITE,
        "variant": "minbase",
        "packages": sorted(catalog.BASE_PACKAGES),
        "trim": list(catalog.BASE_TRIM),
    }
    base_key = compute_key(base_inputs)
    base_ref = f"{catalog.LOCAL_PREFIX}/base:{base_key}"
    specs["base"] = catalog.ImageSpec(
        "base", "debootstrap", base_ref, base_key, smoke=catalog.SMOKE["base"]
    )

    if catalog.PAUSE_SOURCE not in tree.files:
        raise catalog.ImageError(f"{catalog.PAUSE_SOURCE} is missing from the checkout")
    pause_ref = f"{catalog.LOCAL_PREFIX}/pause:{catalog.PAUSE_VERSION}"
    pause_inputs = {
        "kind": "pause",
        "recipe": catalog.PAUSE_RECIPE,
        "ref": pause_ref,
        "source": tree.files[catalog.PAUSE_SOURCE],
        "cflags": list(catalog.PAUSE_CFLAGS),
        "user": catalog.PAUSE_USER,
    }
    specs["pause"] = catalog.ImageSpec(
        "pause",
        "pause",
        pause_ref,
        compute_key(pause_inputs),
        context=(catalog.PAUSE_SOURCE,),
        smoke=catalog.SMOKE["pause"],
    )

    version = app_version(_text(tree, "charts/lora-operator/Chart.yaml"))
    patterns = parse_dockerignore(tree.texts.get(".dockerignore", ""))
    pyproject = _text(tree, "pyproject.toml")
    for name, (dockerfile, repository) in catalog.DOCKERFILE_IMAGES.items():
        text = _text(tree, dockerfile)
        declared = declared_args(text)
        if "BASE_IMAGE" not in declared:
            raise catalog.ImageError(
                f"{dockerfile} has no `ARG BASE_IMAGE`: its FROM cannot be the local base"
            )
        passed = {k: v for k, v in args.items() if k in declared}
        passed["BASE_IMAGE"] = base_ref
        context = select_context(tree.files, copy_sources(text), patterns)
        ref = f"{repository}:{version}"
        inputs = {
            "kind": "dockerfile",
            "recipe": catalog.DOCKERFILE_RECIPE,
            "ref": ref,
            "dockerfile": tree.files[dockerfile],
            "files": _file_inputs(tree, context),
            "build_args": passed,
            "base": base_key,
        }
        extra = pip_extra(text)
        specs[name] = catalog.ImageSpec(
            name,
            "dockerfile",
            ref,
            compute_key(inputs),
            base="base",
            dockerfile=dockerfile,
            context=context,
            build_args=tuple(sorted(passed.items())),
            prefetch=plan_prefetch(pyproject, extra, passed) if extra else (),
            smoke=catalog.SMOKE[name],
        )
    return specs


def plan_builds(
    specs: Mapping[str, catalog.ImageSpec], wanted: Sequence[str], archived: Iterable[str]
) -> list[str]:
    """The images to build, in order (a base before what is built on it), so that every
    wanted image has its archive. `archived`: the names whose archive for the current key
    exists. A base is built only when an image that needs it is built and its archive is gone."""
    unknown = [n for n in wanted if n not in specs]
    if unknown:
        raise catalog.ImageError(
            f"unknown image(s) {', '.join(unknown)}; choose from {', '.join(catalog.NODE_IMAGES)}"
        )
    have = set(archived)
    todo = [n for n in wanted if n not in have]
    bases = {specs[n].base for n in todo if specs[n].base and specs[n].base not in have}
    # specs are in build order: a base comes before the images built on it.
    return [n for n in specs if n in todo or n in bases]
