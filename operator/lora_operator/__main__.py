"""`python -m lora_operator`: run the operator (see `--help` and docs/operator.md)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

import kopf
from lora_runtime import tokenfiles

from lora_operator.controller import Controller
from lora_operator.edges.config import OperatorConfig, parse_args
from lora_operator.edges.handlers import build_registry
from lora_operator.rules import errors
from lora_operator.store import volumecheck


def run(config: OperatorConfig, *, stop_flag: asyncio.Event | None = None) -> None:
    controller = Controller(config)
    kopf.run(
        registry=build_registry(controller),
        standalone=config.standalone,
        peering_name=config.peering,
        identity=controller.identity,  # type: ignore[arg-type]  # kopf's NewType of str
        priority=controller.priority,
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
        liveness_endpoint=f"http://0.0.0.0:{config.health_port}/healthz",
        stop_flag=stop_flag,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    needs_admin_token = config.pod_token_service_account is None and not config.no_admin_token
    if config.admin_token is None and needs_admin_token:
        # No silent open door: pods that require a token would refuse every call, and pods
        # that require none are a choice to make on the command line.
        where = tokenfiles.origin("admin", config.admin_token_file)
        print(
            f"lora-operator: no admin token: {where} holds "
            "none; pass --admin-token-file (the chart mounts its Secret there), or "
            "--pod-token-service-account for pods that check the operator's ServiceAccount "
            "tokens, or --no-admin-token for inference pods that require none",
            file=sys.stderr,
        )
        return 2
    try:
        volumecheck.check_volume(config.volume_root)
    except errors.VolumeUnsupported as e:
        print(f"lora-operator: {e.message}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    # kopf says "Handler ... succeeded" for every event of every object (three per adapter from
    # apply to Ready); the operator logs what it does itself (`action=...`). kopf's warnings
    # and errors are kept.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
