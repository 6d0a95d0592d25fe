"""`python -m lora_devcluster.images build | list | push` (also `lora-devcluster images ...`).

Must not: hold any logic of its own beyond parsing arguments and printing the records.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from lora_devcluster.images import build, catalog, push, steps, tree


def _parse_build_args(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise catalog.ImageError(f"--build-arg {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def build_parser(prog: str = "python -m lora_devcluster.images") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The project's container images (base, pause, operator, inference), built with "
        "buildah from a local Debian base and kept as docker-archive tars in a cache keyed by "
        f"their inputs ({tree.cache_root()}; LORA_IMAGE_CACHE).",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    for action, help_text in (
        (
            "build",
            "build what is missing for the current tree, leave operator and inference tagged "
            "in buildah's storage; print one line per image",
        ),
        ("list", "the images built for the current tree; fails naming any that is missing"),
        (
            "push",
            "push operator and inference (built and tagged first) to REGISTRY",
        ),
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
            choices=catalog.PUSHED_IMAGES if action == "push" else catalog.NODE_IMAGES,
            metavar="NAME",
            help=f"only this image ({', '.join(catalog.NODE_IMAGES)}); repeatable",
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
            names = tuple(args.only or catalog.PUSHED_IMAGES)
            records = build.ensure(names, root=root, cache_dir=cache_dir, build_args=build_args)
            push.push(
                args.registry, records, plain_http=args.plain_http, compress=not args.no_compress
            )
            return 0
        names = tuple(args.only or catalog.NODE_IMAGES)
        act = build.ensure if args.action == "build" else build.built
        records = act(names, root=root, cache_dir=cache_dir, build_args=build_args)
        if args.action == "build":
            # The records ensure() built or found: the tree may change meanwhile.
            push.tag_local([r for r in records if r.role in catalog.PUSHED_IMAGES])
    except catalog.ImageError as e:
        print(f"lora-devcluster images: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "lora-devcluster images: interrupted; nothing half-built was kept",
            file=sys.stderr,
        )
        return 130
    if args.json:
        print(json.dumps([r.as_dict() for r in records], indent=2))
    elif args.archives:
        print("\n".join(str(r.archive) for r in records))
    elif args.action == "list":
        for r in records:
            print(f"{r.role:<9} {r.key}  {steps.size(r.archive):>8}  {r.ref}  {r.archive}")
    return 0
