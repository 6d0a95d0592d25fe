"""`lora-operator`: the operator's command line for people, not pods.

    lora-operator adapter push FILE|FOLDER oci://REGISTRY/REPOSITORY:TAG [--base-model ...]

publishes an adapter as an OCI artifact (`ocipush`), which a LoRAAdapter then names in
`source.uri`; `lora-operator run ...` runs the operator (`python -m lora_operator ...`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from urllib3 import exceptions as u3

from lora_operator import ocipush
from lora_operator.rules import errors
from lora_operator.store import oci, sources


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["run"]:
        from lora_operator.__main__ import main as run_operator

        return run_operator(args[1:])
    p = argparse.ArgumentParser(prog="lora-operator", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the operator (python -m lora_operator --help)")
    adapter = sub.add_parser("adapter", help="publish adapters").add_subparsers(
        dest="verb", required=True
    )
    push = adapter.add_parser(
        "push",
        help="push a .safetensors file (or a folder with it and a metadata.json) to an OCI "
        "registry as an adapter artifact",
    )
    push.add_argument("path", type=Path, metavar="FILE|FOLDER")
    push.add_argument("reference", metavar="oci://REGISTRY/REPOSITORY:TAG")
    push.add_argument("--base-model", help="the base model it was trained for (informational)")
    push.add_argument(
        "--trigger-word", action="append", default=[], help="a trigger word (repeatable)"
    )
    push.add_argument("--format", help="its format: lora, loha, lokr ... (informational)")
    push.add_argument(
        "--plain-http", action="store_true", help="the registry speaks plain HTTP (a local one)"
    )
    push.add_argument("--username", help="log in as this user (the password on stdin)")
    push.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )
    a = p.parse_args(args)
    try:
        return _push(a)
    except u3.HTTPError as e:
        hint = "; a registry without TLS needs --plain-http" if not a.plain_http else ""
        print(
            f"lora-operator: cannot reach the registry ({type(e).__name__}){hint}", file=sys.stderr
        )
        return 1
    except (ocipush.PushError, errors.StagingError, OSError, ValueError) as e:
        message = e.message if isinstance(e, errors.StagingError) else str(e)
        print(f"lora-operator: {message}", file=sys.stderr)
        return 1


def _push(a: argparse.Namespace) -> int:
    ref = sources.parse_oci(a.reference)
    if a.password_stdin != bool(a.username):
        raise ocipush.PushError("--username and --password-stdin go together")
    if a.username:
        login: tuple[str, str] | None = (a.username, sys.stdin.readline().rstrip("\r\n"))
    else:
        login = oci.login_for(ocipush.docker_logins(), ref.registry)
    config, layers = ocipush.adapter_blobs(
        a.path, {"baseModel": a.base_model, "triggerWords": a.trigger_word, "format": a.format}
    )
    pusher = ocipush.Pusher(ref, login=login, plain_http=a.plain_http)
    digest = pusher.push(config, layers, ocipush.build_manifest(config, layers))
    print(f"oci://{ref.registry}/{ref.repository}@{digest}")
    print(f"sha256: {layers[0].digest.removeprefix('sha256:')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
