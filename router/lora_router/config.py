"""The router's settings: one frozen value built from the command line (or by a test)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lora_runtime import login, sizes, tokenfiles


@dataclass(frozen=True)
class PodService:
    """A Service whose EndpointSlices list inference pods, and the base models its pods serve
    (empty: not said; its pods take any request)."""

    name: str
    models: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> PodService:
        """`SERVICE`, or `MODEL[,MODEL...]=SERVICE` (the served model name and the names it
        accepts); raise ValueError for anything else."""
        models, sep, name = text.rpartition("=")
        listed = frozenset(m.strip() for m in models.split(",")) if sep else frozenset()
        if not name or (sep and (not listed or "" in listed)):
            raise ValueError(f"expected SERVICE or MODEL[,MODEL...]=SERVICE, got {text!r}")
        return cls(name=name, models=listed)


@dataclass(frozen=True)
class RouterConfig:
    namespace: str = "default"
    # whose EndpointSlices list the pods: one per base model in a release that serves several
    services: tuple[PodService, ...] = (PodService("lora-operator-inference-pods"),)
    port_name: str = "http"
    port: int = 8000
    metrics_port: int = 9090
    poll_interval_s: float = 1.0  # how often each pod's residency is read
    stale_after_s: float = 5.0  # a report older than this counts as none
    load_factor: float = 0.25  # e: no pod above ceil((1 + e) x mean load)
    max_body_bytes: int = 1024**2
    connect_timeout_s: float = 3.0
    upstream_timeout_s: float = 600.0  # a whole request, answer included
    # After SIGTERM, new connections still arrive until kube-proxy and the Service's other
    # clients have seen the pod leave its endpoints: keep answering for this long, not Ready.
    shutdown_delay_s: float = 5.0
    # The pods' client token, sent with the router's own residency polls only: client requests
    # carry their own Authorization, so the router never lends its token to a client.
    client_token_file: Path | None = None


def parse_args(argv: Sequence[str] | None = None) -> RouterConfig:
    d = RouterConfig()
    p = argparse.ArgumentParser(
        prog="python -m lora_router",
        description="Send each generation to an inference pod that holds its adapter.",
    )
    p.add_argument(
        "--namespace", help="the inference pods' namespace (default: the router pod's own)"
    )
    p.add_argument(
        "--service",
        action="append",
        metavar="[MODEL[,MODEL...]=]SERVICE",
        help="a Service whose EndpointSlices list the pods, with the base models they serve "
        f"(repeat it for each model; default: {d.services[0].name})",
    )
    p.add_argument("--port-name", default=d.port_name, help="the pods' port, by its name")
    p.add_argument("--port", type=int, default=d.port, help="where the router listens")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="/metrics here")
    p.add_argument("--poll-interval-seconds", type=float, default=d.poll_interval_s)
    p.add_argument("--stale-after-seconds", type=float, default=d.stale_after_s)
    p.add_argument(
        "--load-factor",
        type=float,
        default=d.load_factor,
        help="e: a pod takes no request beyond ceil((1 + e) x mean load)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=sizes.argument,
        default=d.max_body_bytes,
        metavar="SIZE",
        help="the largest request body, e.g. 1MiB (413 beyond)",
    )
    p.add_argument("--connect-timeout-seconds", type=float, default=d.connect_timeout_s)
    p.add_argument("--upstream-timeout-seconds", type=float, default=d.upstream_timeout_s)
    p.add_argument(
        "--shutdown-delay-seconds",
        type=float,
        default=d.shutdown_delay_s,
        help="after SIGTERM, keep answering new requests this long (not Ready) before stopping",
    )
    p.add_argument(
        "--client-token-file",
        type=Path,
        help="a file holding the pods' client token, for the residency polls (GET /v1/adapters)",
    )
    a = p.parse_args(argv)
    for flag, value in (
        ("--poll-interval-seconds", a.poll_interval_seconds),
        ("--stale-after-seconds", a.stale_after_seconds),
        ("--connect-timeout-seconds", a.connect_timeout_seconds),
        ("--upstream-timeout-seconds", a.upstream_timeout_seconds),
        ("--max-body-bytes", a.max_body_bytes),
    ):
        if value <= 0:
            p.error(f"{flag} must be positive")
    if a.load_factor < 0:
        p.error("--load-factor must be at least 0")
    if a.shutdown_delay_seconds < 0:
        p.error("--shutdown-delay-seconds must be at least 0")
    if a.client_token_file is not None:
        try:
            tokenfiles.read_token(a.client_token_file, "client")
        except tokenfiles.TokenError as e:
            p.error(f"--client-token-file: {e}")
    try:
        services = tuple(PodService.parse(t) for t in a.service) if a.service else d.services
    except ValueError as e:
        p.error(f"--service: {e}")
    if len({s.name for s in services}) < len(services):
        p.error("--service: each Service once")
    if len(services) > 1 and not all(s.models for s in services):
        p.error("--service: with several Services, name the models each serves (MODEL=SERVICE)")
    namespace = a.namespace or login.pod_namespace()
    if not namespace:
        p.error("--namespace is required outside a pod")
    return RouterConfig(
        namespace=namespace,
        services=services,
        port_name=a.port_name,
        port=a.port,
        metrics_port=a.metrics_port,
        poll_interval_s=a.poll_interval_seconds,
        stale_after_s=a.stale_after_seconds,
        load_factor=a.load_factor,
        max_body_bytes=a.max_body_bytes,
        connect_timeout_s=a.connect_timeout_seconds,
        upstream_timeout_s=a.upstream_timeout_seconds,
        shutdown_delay_s=a.shutdown_delay_seconds,
        client_token_file=a.client_token_file,
    )
