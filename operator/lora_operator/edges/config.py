"""The operator's settings: one frozen value built from the command line (or by a test)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lora_runtime import sizes, tokenfiles

from lora_operator.edges import podtokens
from lora_operator.rules import consent, trust
from lora_operator.rules.model import DEFAULT_POD_VOLUME_ROOT
from lora_operator.store import limits


def _quota_arg(text: str) -> int | None:
    """A size, or `none` (or 0) for no limit."""
    if text.strip().lower() == "none":
        return None
    return sizes.argument(text) or None


def _cidr_arg(text: str) -> str:
    try:
        consent.parse_networks([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text.strip()


@dataclass(frozen=True)
class OperatorConfig:
    volume_root: Path = Path(DEFAULT_POD_VOLUME_ROOT)
    admin_token: str | None = None
    # The token's file, read again when it changes (a rotated Secret); None: `admin_token` as is.
    admin_token_file: Path | None = None
    # Run with no admin token at all (pods that require none): only with --no-admin-token.
    no_admin_token: bool = False
    # Send pods tokens of this ServiceAccount (namespace, name), bound to each pod's namespace,
    # instead of the admin token (podtokens.BoundTokens); None: the admin token.
    pod_token_service_account: tuple[str, str] | None = None
    pod_token_lifetime_s: int = podtokens.DEFAULT_LIFETIME_S
    # Which labelled pods are the release's inference pods (trust.Policy; None: not checked).
    inference_namespaces: tuple[str, ...] | None = None
    inference_service_account: str | None = None
    inference_workloads: tuple[str, ...] | None = None
    inference_legacy_service_accounts: tuple[str, ...] = ()
    # Where sources may be fetched from, and who may use the operator's cloud identity.
    source_hosts: tuple[str, ...] = ()  # empty: no remote host; "*": any host
    # Address ranges sources may reach although refused by default (an internal mirror), and
    # ranges refused besides the defaults (the cluster's pod and Service ranges): consent.Rules.
    source_allow_cidrs: tuple[str, ...] = ()
    source_refuse_cidrs: tuple[str, ...] = ()
    ambient_namespaces: tuple[str, ...] = ("*",)
    # OCI registries (host:port) oci:// sources may reach over plain HTTP (consent.Rules).
    insecure_registries: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    standalone: bool = True
    peering: str | None = None
    # kopf's peering: a replica whose entry is older than this is dead, and the next one acts.
    peering_lifetime_s: int = 20
    peering_priority: int | None = None  # None: the older replica wins (peering.start_priority)
    health_port: int = 8080
    metrics_port: int = 9090
    max_concurrent_stagings: int = limits.DEFAULT_MAX_CONCURRENT
    max_adapter_bytes: int = limits.DEFAULT_MAX_BYTES
    # The bytes of the volume one namespace's revisions may hold (store/quota.py); None: no limit.
    namespace_quota: int | None = limits.DEFAULT_NAMESPACE_QUOTA
    max_concurrent_loads: int = 16
    resync_s: float = 30.0
    load_timeout_s: float = 120.0
    # Transient failures (staging or a pod's load) before the adapter is marked Degraded; the
    # retries go on, with a backoff capped at `max_backoff_s`.
    retry_bound: int = 4
    max_backoff_s: float = 60.0
    # How long deletion waits for pods to unload before it lets the adapter go anyway.
    unload_grace_s: float = 60.0
    hf_endpoint: str | None = None
    # How often status is written (statuswrite.WritePolicy), and how long a pod's worker acts
    # before it reads the pod's /v1/models again, so status follows a long series of loads.
    status_settle_s: float = 3.0
    status_progress_s: float = 10.0
    status_loss_grace_s: float = 30.0
    verify_every_s: float = 2.0
    # How often adapters with spec.autoscale have their request rate measured (the pods' hit
    # counters are read that often) and their replicas reconsidered.
    autoscale_interval_s: float = 15.0

    @property
    def trust_policy(self) -> trust.Policy:
        return trust.Policy(
            namespaces=None
            if self.inference_namespaces is None
            else frozenset(self.inference_namespaces),
            service_account=self.inference_service_account,
            workloads=None
            if self.inference_workloads is None
            else frozenset(self.inference_workloads),
            legacy_service_accounts=frozenset(self.inference_legacy_service_accounts),
        )

    @property
    def source_rules(self) -> consent.Rules:
        return consent.Rules(
            hosts=self.source_hosts,
            ambient=self.ambient_namespaces,
            allow=consent.parse_networks(self.source_allow_cidrs),
            refuse=consent.parse_networks(self.source_refuse_cidrs),
            insecure_registries=self.insecure_registries,
        )


def parse_args(argv: Sequence[str] | None = None) -> OperatorConfig:
    p = argparse.ArgumentParser(
        prog="python -m lora_operator",
        description="Stage LoRAAdapters onto the shared volume and load them on inference pods.",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true", help="no peering (one replica)")
    mode.add_argument("--peering", metavar="NAME", help="kopf peering object (several replicas)")
    p.add_argument(
        "--peering-lifetime-seconds",
        type=int,
        default=20,
        help="with --peering: how long a silent replica counts as alive (takeover time)",
    )
    p.add_argument(
        "--peering-priority",
        type=int,
        default=None,
        help="with --peering: this replica's priority (default: the oldest replica acts)",
    )
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable); default: every namespace",
    )
    p.add_argument(
        "--volume-root",
        type=Path,
        default=Path(os.environ.get("LORA_VOLUME_ROOT", DEFAULT_POD_VOLUME_ROOT)),
        help="the shared adapter volume, mounted read-write (env LORA_VOLUME_ROOT)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        help="the inference pods' admin token, read again when it changes; LORA_ADMIN_TOKEN is "
        "read when no file is given",
    )
    p.add_argument(
        "--no-admin-token",
        action="store_true",
        help="run without an admin token (only for pods that require none); without it, a "
        "missing or empty token refuses to start",
    )
    p.add_argument(
        "--pod-token-service-account",
        metavar="NAMESPACE/NAME",
        help="call inference pods with tokens of this ServiceAccount (the operator's own) from "
        "the TokenRequest API, bound to each pod's namespace, instead of the admin token; the "
        "pods check them with TokenReview (the chart's default)",
    )
    p.add_argument(
        "--pod-token-seconds",
        type=int,
        default=podtokens.DEFAULT_LIFETIME_S,
        help="the lifetime asked for each such token (at least 600); renewed at two thirds",
    )
    p.add_argument(
        "--inference-namespace",
        action="append",
        default=None,
        help="a namespace of the release's inference pods (repeatable); pods elsewhere get no "
        "admin token and no adapters (default: every watched namespace)",
    )
    p.add_argument(
        "--inference-service-account",
        help="the ServiceAccount the release's inference pods run as (default: any)",
    )
    p.add_argument(
        "--inference-legacy-service-account",
        action="append",
        default=[],
        help="a ServiceAccount also accepted for pods owned by an --inference-workload (the "
        "pods of an earlier version, during an upgrade); repeatable",
    )
    p.add_argument(
        "--inference-workload",
        action="append",
        default=None,
        help="a Deployment or StatefulSet whose pods are the release's inference pods "
        "(repeatable; default: any owner, bare pods included)",
    )
    p.add_argument(
        "--source-host",
        action="append",
        default=[],
        help="a host https://, hf://, s3:// and oci:// sources and their redirects may name "
        "(repeatable; *.example.com for its subdomains, * for any host); default: none, volume "
        "paths only",
    )
    p.add_argument(
        "--source-allow-cidr",
        action="append",
        default=[],
        type=_cidr_arg,
        metavar="CIDR",
        help="an address range sources may reach although it is refused by default (loopback, "
        "private, CGNAT...: an internal mirror); repeatable",
    )
    p.add_argument(
        "--source-refuse-cidr",
        action="append",
        default=[],
        type=_cidr_arg,
        metavar="CIDR",
        help="an address range sources may never reach besides the default ones (the "
        "cluster's pod and Service ranges); repeatable",
    )
    p.add_argument(
        "--insecure-registry",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an OCI registry oci:// sources may reach over plain HTTP, and its token service "
        "(a cluster's own registry); repeatable; default: none, https only",
    )
    ambient = p.add_mutually_exclusive_group()
    ambient.add_argument(
        "--ambient-credentials-namespace",
        action="append",
        default=None,
        help="a namespace whose s3:// sources without keys may use the operator's own cloud "
        "identity (repeatable; default: every namespace)",
    )
    ambient.add_argument(
        "--no-ambient-credentials",
        action="store_true",
        help="never sign s3:// requests with the operator's own cloud identity",
    )
    p.add_argument("--health-port", type=int, default=8080, help="liveness at /healthz")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus at /metrics")
    p.add_argument("--max-concurrent-stagings", type=int, default=limits.DEFAULT_MAX_CONCURRENT)
    p.add_argument(
        "--max-adapter-bytes",
        type=sizes.argument,
        default=limits.DEFAULT_MAX_BYTES,
        metavar="SIZE",
        help="the largest adapter file, e.g. 2GiB or 500MB (default 2GiB)",
    )
    p.add_argument(
        "--namespace-quota",
        type=_quota_arg,
        default=limits.DEFAULT_NAMESPACE_QUOTA,
        metavar="SIZE",
        help="the bytes of the adapter volume one namespace's adapters may hold, e.g. 20GiB "
        "(default 20GiB); 'none' or 0: no limit",
    )
    p.add_argument(
        "--max-concurrent-loads", type=int, default=16, help="calls to pods in flight at once"
    )
    p.add_argument(
        "--resync-seconds", type=float, default=30.0, help="how often each pod is re-checked"
    )
    p.add_argument("--load-timeout-seconds", type=float, default=120.0)
    p.add_argument(
        "--autoscale-interval-seconds",
        type=float,
        default=15.0,
        help="how often adapters with spec.autoscale have their request rate measured",
    )
    p.add_argument("--hf-endpoint", help="a Hugging Face Hub mirror for hf:// sources")
    a = p.parse_args(argv)
    token: str | None
    if a.admin_token_file is not None:
        try:
            token = tokenfiles.read_token(a.admin_token_file, "admin")
        except tokenfiles.TokenError as e:
            p.error(str(e))
    else:
        token = os.environ.get("LORA_ADMIN_TOKEN", "").strip() or None
    for flag, value in (
        ("--max-concurrent-stagings", a.max_concurrent_stagings),
        ("--max-concurrent-loads", a.max_concurrent_loads),
        ("--max-adapter-bytes", a.max_adapter_bytes),
    ):
        if value < 1:
            p.error(f"{flag} must be at least 1")
    if a.resync_seconds <= 0 or a.load_timeout_seconds <= 0 or a.autoscale_interval_seconds <= 0:
        p.error(
            "--resync-seconds, --load-timeout-seconds and --autoscale-interval-seconds must be "
            "positive"
        )
    if a.peering and any(set(ns) & set("*?[]!") for ns in a.namespace):
        p.error("with --peering, name each --namespace exactly (no patterns)")
    pod_token_sa: tuple[str, str] | None = None
    if a.pod_token_service_account:
        ns, _, name = a.pod_token_service_account.partition("/")
        if not ns or not name or "/" in name:
            p.error("--pod-token-service-account takes NAMESPACE/NAME")
        pod_token_sa = (ns, name)
    if a.pod_token_seconds < 600:
        p.error("--pod-token-seconds must be at least 600 (the TokenRequest API's minimum)")
    if a.peering_lifetime_seconds < 15:
        # kopf renews an entry 5-10 s before it expires: shorter lifetimes renew every second.
        p.error("--peering-lifetime-seconds must be at least 15")
    return OperatorConfig(
        volume_root=a.volume_root,
        admin_token=token,
        admin_token_file=a.admin_token_file,
        no_admin_token=a.no_admin_token,
        pod_token_service_account=pod_token_sa,
        pod_token_lifetime_s=a.pod_token_seconds,
        inference_namespaces=tuple(a.inference_namespace) if a.inference_namespace else None,
        inference_service_account=a.inference_service_account or None,
        inference_workloads=tuple(a.inference_workload) if a.inference_workload else None,
        inference_legacy_service_accounts=tuple(a.inference_legacy_service_account),
        source_hosts=tuple(h for h in a.source_host if h),
        source_allow_cidrs=tuple(a.source_allow_cidr),
        source_refuse_cidrs=tuple(a.source_refuse_cidr),
        insecure_registries=tuple(r.strip() for r in a.insecure_registry if r.strip()),
        ambient_namespaces=()
        if a.no_ambient_credentials
        else tuple(a.ambient_credentials_namespace or ("*",)),
        namespaces=tuple(a.namespace),
        standalone=a.peering is None,
        peering=a.peering,
        peering_lifetime_s=a.peering_lifetime_seconds,
        peering_priority=a.peering_priority,
        health_port=a.health_port,
        metrics_port=a.metrics_port,
        max_concurrent_stagings=a.max_concurrent_stagings,
        max_adapter_bytes=a.max_adapter_bytes,
        namespace_quota=a.namespace_quota,
        max_concurrent_loads=a.max_concurrent_loads,
        resync_s=a.resync_seconds,
        load_timeout_s=a.load_timeout_seconds,
        autoscale_interval_s=a.autoscale_interval_seconds,
        hf_endpoint=a.hf_endpoint,
    )
