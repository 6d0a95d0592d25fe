"""`lora-inference`: serve a pipeline, or write tiny models and random adapters for tests.

`serve` picks the backend (`lora_inference.backend.Backend`) and passes it to the app: the
diffusers pipeline, loaded in the background, or with `--simulate` the simulated one, in which
case nothing imports torch (the server core imports none; the pipeline module is imported here,
for a real pipeline only).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
from pathlib import Path

from lora_inference.config import ServerConfig, StaticLora


def _static_lora(value: str) -> StaticLora:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora takes NAME=PATH, got {value!r}")
    return StaticLora(name=name, path=Path(path))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora-inference", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a diffusers pipeline with LoRA adapters over HTTP")
    serve.add_argument("--model", type=Path, required=True, help="diffusers model directory")
    serve.add_argument(
        "--served-model-name", default="", help="model id in the API (default: the directory name)"
    )
    serve.add_argument(
        "--adapter-root", type=Path, help="shared adapter volume (see docs/architecture.md)"
    )
    serve.add_argument(
        "--pod-labels-file",
        type=Path,
        help="this pod's labels (a Downward API metadata.labels file): resolve from the adapter "
        "root only adapters whose LoRAAdapter selects them",
    )
    serve.add_argument(
        "--allowed-root",
        type=Path,
        action="append",
        default=[],
        dest="allowed_roots",
        help="directory clients may load adapters from (repeatable)",
    )
    serve.add_argument(
        "--lora",
        type=_static_lora,
        action="append",
        default=[],
        dest="static_loras",
        metavar="NAME=PATH",
        help="adapter loaded and pinned at start (repeatable)",
    )
    serve.add_argument(
        "--accept-base-model",
        action="append",
        default=[],
        dest="accepted_base_models",
        help="another base model name adapters may declare in adapter_config.json",
    )
    serve.add_argument(
        "--max-loras", type=int, default=4, help="adapters resident in the pipeline (GPU slots)"
    )
    serve.add_argument(
        "--max-cpu-loras", type=int, default=32, help="parsed adapters cached in host memory"
    )
    serve.add_argument(
        "--max-lora-rank",
        type=int,
        default=64,
        help="largest rank accepted: every slot has room for this rank in every layer",
    )
    serve.add_argument(
        "--admin-token-file",
        type=Path,
        help="file holding the bearer token for load/unload (or set LORA_ADMIN_TOKEN)",
    )
    serve.add_argument(
        "--client-token-file",
        type=Path,
        help="file holding the bearer token for generation, /v1/models and /v1/adapters "
        "(or set LORA_CLIENT_TOKEN); the admin token is accepted there too",
    )
    serve.add_argument(
        "--operator-service-account",
        metavar="NAMESPACE/NAME",
        help="also accept, for load/unload and the reads, tokens of this ServiceAccount (the "
        "operator's) bound to this pod's namespace, checked with the API server's TokenReview "
        "(needs the pod's own ServiceAccount token; the chart's default)",
    )
    serve.add_argument(
        "--pod-namespace",
        default=os.environ.get("POD_NAMESPACE") or None,
        help="this pod's namespace, whose audience the operator's tokens must be bound to "
        "(default: the environment variable POD_NAMESPACE)",
    )
    serve.add_argument(
        "--no-admin-token",
        action="store_true",
        help="serve load and unload to anyone (a server on a laptop); without it, a missing or "
        "empty admin token refuses to start",
    )
    serve.add_argument(
        "--published-only",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="resolve from --adapter-root only adapters the operator published (target.json), "
        "never a file placed there by hand (the chart turns it on)",
    )
    serve.add_argument(
        "--allow-request-adapters",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let generation requests register adapters with lora.local_path (default: on)",
    )
    serve.add_argument(
        "--device", default=None, help="torch device (default: cuda if available, else cpu)"
    )
    serve.add_argument(
        "--dtype", default="auto", help="auto (float16 on cuda), float32, float16, bfloat16"
    )
    serve.add_argument("--max-batch-size", type=int, default=4, help="images per pipeline call")
    serve.add_argument(
        "--merge",
        choices=("auto", "always", "never"),
        default="auto",
        help="merge a single-adapter batch's adapter into the weights where it pays (auto)",
    )
    serve.add_argument(
        "--max-queue", type=int, default=64, help="queued requests before answering 429"
    )
    serve.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="benchmarks and tests only: no model and no torch; every GPU cost is a sleep from "
        "PROFILE (a bundled name such as h200-sdxl-20step, or a profile file) and images are "
        "8x8 stand-ins; --model then only names the served model",
    )
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)

    tiny = sub.add_parser("tiny-model", help="write a tiny random pipeline, built offline")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--arch", choices=("sd15", "sdxl", "sd3", "flux"), default="sd15")
    tiny.add_argument("--seed", type=int, default=0)

    adapter = sub.add_parser("make-adapter", help="write a random LoRA for a model")
    adapter.add_argument("out", type=Path, help="directory (peft) or .safetensors file (kohya)")
    adapter.add_argument("--model", type=Path, required=True)
    adapter.add_argument("--rank", type=int, default=4)
    adapter.add_argument("--seed", type=int, default=0)
    adapter.add_argument("--format", choices=("peft", "kohya"), default="peft", dest="fmt")
    adapter.add_argument(
        "--text-encoder", action="store_true", help="also adapt the CLIP text encoders"
    )
    adapter.add_argument("--strength", type=float, default=0.2, help="std of the random weights")

    shapes = sub.add_parser(
        "train-shapes",
        help="train the small shapes model and its adapters (the demo's; about 40 min on 2 cores)",
    )
    shapes.add_argument("directory", type=Path, help="writes model/ and adapters/<name>/ here")
    shapes.add_argument("--seed", type=int, default=0)
    shapes.add_argument(
        "--quick", action="store_true", help="a few steps of each part, to check the script runs"
    )
    return parser


def _token(path: Path | None, env: str) -> str | None:
    """A token from its file (mounted from a Secret), else from the environment variable."""
    if path is not None:
        try:
            return path.read_text().strip() or None
        except OSError:
            return None  # `token_problem` has refused to start
    return os.environ.get(env, "").strip() or None


def token_problem(args: argparse.Namespace) -> str | None:
    """Why `serve` must not start with these tokens (None: it may): a token file that is
    missing or empty, or no admin token at all without --no-admin-token. No silent open door."""
    from lora_runtime import tokenfiles as tokens

    for kind, path in (("admin", args.admin_token_file), ("client", args.client_token_file)):
        if path is not None:
            try:
                tokens.read_token(path, kind)
            except tokens.TokenError as e:
                return str(e)
    if args.operator_service_account:
        from lora_inference import tokenreview

        try:
            tokenreview.ApiServer.in_cluster()
        except ValueError as e:
            return str(e)
    if (
        _token(args.admin_token_file, "LORA_ADMIN_TOKEN") is None
        and not args.no_admin_token
        and not args.operator_service_account
    ):
        return (
            f"no admin token: {tokens.origin('admin', None)} is not set and no "
            "--admin-token-file is given; pass one, or --operator-service-account to accept "
            "the operator's ServiceAccount tokens, or --no-admin-token to let anyone who "
            "reaches the server load and unload adapters"
        )
    return None


def default_device(simulated: bool) -> str:
    """The device when --device is not given: the simulation's own, else cuda if available."""
    if simulated:
        from lora_inference.simulate import SIMULATED_DEVICE

        return SIMULATED_DEVICE
    from lora_inference.pipeline import default_device as torch_default

    return torch_default()


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        adapter_root=args.adapter_root,
        pod_labels_file=args.pod_labels_file,
        allowed_roots=tuple(args.allowed_roots),
        static_loras=tuple(args.static_loras),
        accepted_base_models=tuple(args.accepted_base_models),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        admin_token=_token(args.admin_token_file, "LORA_ADMIN_TOKEN"),
        client_token=_token(args.client_token_file, "LORA_CLIENT_TOKEN"),
        admin_token_file=args.admin_token_file,
        client_token_file=args.client_token_file,
        operator_service_account=args.operator_service_account,
        pod_namespace=args.pod_namespace,
        published_only=args.published_only,
        allow_request_adapters=args.allow_request_adapters,
        device=args.device or default_device(bool(args.simulate)),
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        merge=args.merge,
        max_queue=args.max_queue,
        host=args.host,
        port=args.port,
        simulate=args.simulate,
    )


async def serve(config: ServerConfig) -> int:
    from aiohttp import web

    from lora_inference.app import STARTUP, create_app

    if config.simulate:
        from lora_inference import simulate

        profile = simulate.load_profile(config.simulate)
        app = create_app(config, backend=simulate.SimulatedBackend(profile))
    else:
        from lora_inference import pipeline

        app = create_app(config, load=functools.partial(pipeline.load_backend, config))
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    logging.getLogger(__name__).info("listening on %s:%d", config.host, config.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    startup = app[STARTUP]
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({startup, waiter}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if startup.done() and startup.exception() is not None:
        logging.getLogger(__name__).error("startup failed: %s", startup.exception())
        code = 1
    else:
        await waiter
    await runner.cleanup()
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        if args.simulate:
            from lora_inference import simulate

            try:
                simulate.load_profile(args.simulate)
            except simulate.ProfileError as e:
                print(f"lora-inference: --simulate: {e}", file=sys.stderr)
                return 2
        config = config_from_args(args)
        try:
            config.check()
        except ValueError as e:
            print(f"lora-inference: {e}", file=sys.stderr)
            return 2
        problem = token_problem(args)
        if problem is not None:
            print(f"lora-inference: {problem}", file=sys.stderr)
            return 2
        return asyncio.run(serve(config))
    if args.command == "tiny-model":
        from lora_inference.tools.tiny_models import write_tiny_model

        write_tiny_model(args.directory, args.arch, seed=args.seed)
        print(f"wrote a tiny {args.arch} pipeline to {args.directory}")
        return 0
    if args.command == "make-adapter":
        from diffusers import DiffusionPipeline

        from lora_inference.tools.random_adapters import write_random_adapter

        pipe = DiffusionPipeline.from_pretrained(str(args.model))
        out = write_random_adapter(
            args.out,
            pipe,
            base_model=args.model.name,
            rank=args.rank,
            seed=args.seed,
            fmt=args.fmt,
            text_encoder=args.text_encoder,
            strength=args.strength,
        )
        print(f"wrote a rank-{args.rank} {args.fmt} adapter to {out}")
        return 0
    if args.command == "train-shapes":
        from lora_inference.tools import shapes

        shapes.train_all(args.directory, shapes.QUICK if args.quick else shapes.FULL, args.seed)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
