"""The tables of (a), (b) and (c), and the detail per configuration."""

from __future__ import annotations

import argparse
import os

from lora_bench.operator import configuration


def per_adapter(requests: dict[str, int] | None, prefix: str, k: int) -> float:
    return sum(v for key, v in (requests or {}).items() if key.startswith(prefix)) / k


def print_table(rows: list[configuration.Row], args: argparse.Namespace) -> None:
    print("\n(a) apply -> Ready against the bare load calls")
    print(
        f"{'N':>3}{'K':>6} |{'apply':>7}{'bare':>8}{'held':>8}{'Ready':>8}"
        f"{'(held-apply)/bare':>18}{'Ready-held':>11} |{'writes/adapter':>15}"
        f"{'events/adapter':>15}"
    )
    for r in rows:
        print(
            f"{r.n:3d}{r.k:6d} |{r.apply_s:7.2f}{r.bare_s:8.2f}{r.held_s:8.2f}{r.ready_s:8.2f}"
            f"{(r.held_s - r.apply_s) / r.bare_s:18.2f}{r.ready_s - r.held_s:11.2f} |"
            f"{per_adapter(r.apply_requests, 'write-adapters', r.k):15.2f}"
            f"{per_adapter(r.apply_requests, 'write-events', r.k):15.2f}"
        )
    print(
        "apply: `kubectl apply` itself; bare: the load calls alone, all pods; held: apply -> every"
        " pod lists all K;\nReady: apply -> every LoRAAdapter Ready N/N; writes/adapter: the"
        " operator's writes to LoRAAdapters (kopf's\nfinalizer and status patches) from apply to"
        " Ready, per adapter; events/adapter: its Event writes (creates and series patches)."
    )
    print(f"\n(b) a killed server back to all K; (c) at rest over {args.quiet:.0f} s; deletion")
    print(
        f"{'N':>3}{'K':>6} |{'pod Ready':>10}{'back':>8}{'limit':>8}{'back/limit':>11} |"
        f"{'RSS MiB':>8}{'req/adapter':>12}{'watches':>8} |{'kubectl':>8}{'delete':>8}"
        f"{'bare unload':>12}{'delete/bare':>12}"
    )
    for r in rows:
        limit = r.pod_ready_s + r.bare_pod_s
        print(
            f"{r.n:3d}{r.k:6d} |{r.pod_ready_s:10.2f}{r.back_s:8.2f}{limit:8.2f}"
            f"{r.back_s / limit:11.2f} |{r.rss_mib:8.0f}"
            f"{per_adapter(r.requests, '', r.k) - per_adapter(r.requests, 'watch-', r.k):12.2f}"
            f"{sum(v for key, v in (r.requests or {}).items() if key.startswith('watch-')):8d} |"
            f"{r.kubectl_delete_s:8.2f}{r.delete_s:8.2f}{r.bare_unload_s:12.2f}"
            f"{r.delete_s / r.bare_unload_s:12.2f}"
        )
    print(
        "pod Ready: kill -> the pod Ready again; back: kill -> /v1/models lists all K; limit: pod"
        " Ready + the bare loads\nof K on one pod; req/adapter: the operator's API requests other"
        " than watches over the quiet window, per adapter;\nkubectl: `kubectl delete --all`"
        " itself; delete: from its start until every object is gone and no pod holds one;\nbare"
        " unload: the unload calls alone."
    )
    print("\nDetail")
    for r in rows:
        req = {key: v for key, v in sorted((r.requests or {}).items()) if v}
        during = {key: v for key, v in sorted((r.apply_requests or {}).items()) if v}
        print(
            f"N={r.n} K={r.k}: apply -> Ready: operator CPU {r.apply_cpu_s:.2f} s"
            f" ({r.apply_cpu_s / r.k * 1000:.0f} ms per adapter); requests {during}"
        )
        by = ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in (r.apply_cpu_by or {}).items())
        print(
            f"N={r.n} K={r.k}: apply -> Ready: CPU seconds by process ({os.cpu_count()} cores x"
            f" {r.ready_s:.1f} s = {(os.cpu_count() or 1) * r.ready_s:.0f}): {by}"
        )
        print(
            f"N={r.n} K={r.k}: server /ready after kill {r.server_ready_s:.2f} s; bare per pod"
            f" {r.bare_pod_s:.2f} s; requests in {r.quiet_s:.0f} s: {req or 'none'}"
        )
