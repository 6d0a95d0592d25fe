"""Which labelled pods are the release's inference pods: the only ones that get the admin token
and load calls (pure: no I/O, no clock, no kopf).

The label `lora.dev/inference` finds candidates; anyone who may create a pod can set it. A pod
is trusted only when, besides, all of these hold (each is skipped when the policy leaves it
open, as an operator run by hand does; the chart sets all three):

- its namespace is one of the release's (`--inference-namespace`);
- it runs as the release's inference ServiceAccount (`--inference-service-account`): a pod can
  use a ServiceAccount of its own namespace only. A pod owned by one of the release's workloads
  may also run as a ServiceAccount named in `--inference-legacy-service-account` (the chart names
  `default`, what its earlier versions ran inference pods as), so that the pods of the previous
  version keep their adapters while a `helm upgrade` replaces them;
- its controlling owner is one of the release's workloads (`--inference-workload`): a
  Deployment (through its ReplicaSet `<deployment>-<pod-template-hash>`), or a StatefulSet or
  Deployment naming it directly.

`refusal` returns why a pod is not trusted, in words for an Event, or None.
"""

from __future__ import annotations

from dataclasses import dataclass

from lora_operator.model import PodInfo

TEMPLATE_HASH_LABEL = "pod-template-hash"


@dataclass(frozen=True)
class Policy:
    """What makes a labelled pod one of the release's; None: that part is not checked."""

    namespaces: frozenset[str] | None = None
    service_account: str | None = None
    workloads: frozenset[str] | None = None
    # Also accepted for pods owned by one of `workloads` (never alone: see the module docstring).
    legacy_service_accounts: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        return self.namespaces is None and self.service_account is None and self.workloads is None


def workload_of(pod: PodInfo) -> str | None:
    """The workload that controls `pod`: a Deployment's name (its ReplicaSet's name less the
    pod's template hash), a StatefulSet's or a Deployment's own; None for a bare pod or any
    other owner (pure)."""
    if pod.owner is None:
        return None
    kind, name, _ = pod.owner
    if kind in ("StatefulSet", "Deployment"):
        return name
    if kind == "ReplicaSet":
        suffix = f"-{pod.label_map.get(TEMPLATE_HASH_LABEL, '')}"
        if len(suffix) > 1 and name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def refusal(pod: PodInfo, policy: Policy) -> str | None:
    """Why `pod` is not one of the release's inference pods, or None when it is (pure)."""
    if policy.namespaces is not None and pod.namespace not in policy.namespaces:
        return (
            f"namespace {pod.namespace} is not one of the release's inference namespaces "
            f"({', '.join(sorted(policy.namespaces)) or 'none'})"
        )
    workload = workload_of(pod)
    owned = policy.workloads is not None and workload in policy.workloads
    legacy = owned and pod.service_account in policy.legacy_service_accounts
    if (
        policy.service_account is not None
        and pod.service_account != policy.service_account
        and not legacy
    ):
        return (
            f"it runs as ServiceAccount {pod.service_account!r}, not the release's inference "
            f"ServiceAccount {policy.service_account!r}"
        )
    if policy.workloads is not None and not owned:
        owner = f"{pod.owner[0]} {pod.owner[1]}" if pod.owner else "no workload (a bare pod)"
        return (
            f"it is owned by {owner}, not by one of the release's inference workloads "
            f"({', '.join(sorted(policy.workloads)) or 'none'})"
        )
    return None
