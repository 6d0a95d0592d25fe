"""Which labelled pods are the release's inference pods: the only ones that get a pod token and
load calls (pure: no I/O, no clock, no kopf).

The label `lora.dev/inference` finds candidates; anyone who may create a pod can set it, and
names prove nothing either: a pod may carry any `ownerReferences`, and a tenant may create a
ReplicaSet named like the release's. A pod is trusted only when all of these hold (each is
skipped when the policy leaves it open, as an operator run by hand does; the chart sets all):

- its namespace is one of the release's (`--inference-namespace`);
- it runs as the release's inference ServiceAccount (`--inference-service-account`): a pod can
  use a ServiceAccount of its own namespace only. `--inference-legacy-service-account` accepts
  another name too (an upgrade from a chart that ran the pods as `default`), never alone: the
  owner chain below must still hold;
- its controlling owner chain, each link read from the API server and matched by UID, ends at
  one of the release's workloads (`--inference-workload`): Pod -> ReplicaSet -> Deployment, or
  Pod -> StatefulSet. A pod whose ownerReference names a Deployment directly is forged
  (Deployments own ReplicaSets, not pods); a reference whose UID is not the named object's is
  forged or stale; each link must be one its owner's controller keeps (the pod's labels match
  its ReplicaSet's or StatefulSet's selector, the ReplicaSet's labels its Deployment's: what
  does not match, the controller releases); the pod's ServiceAccount must be the one its
  owner's template names; and it must run its owner's containers as the owner's template
  declares them (image, command, arguments), so a pod that claims a genuine owner runs the
  release's server, not its own.

Within one namespace, whoever may create pods and ReplicaSets there can still make a copy that
matches all of this for the moments before the Deployment controller scales it away: such a
pod runs what its own template says, and what it could be sent opens that namespace's pods only
(`lora_volume.podauth`). The identity prover reads every chain again at least once a minute, so
a released copy loses its trust.

The I/O is the controller's (`controller.identity`): it asks `next_owner` which object to read,
reads it, and repeats, then asks `refusal` for the verdict on the chain it read.
`static_refusal` is the part that needs no chain (kopf's index applies it to every event).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_volume import targeting

from lora_operator.rules.model import Container, PodInfo, containers_of

# The workload kinds a chain may end at, and the owner kinds a pod may name.
DEPLOYMENT, REPLICASET, STATEFULSET = "Deployment", "ReplicaSet", "StatefulSet"
MAX_CHAIN = 2  # Pod -> ReplicaSet -> Deployment


@dataclass(frozen=True)
class Policy:
    """What makes a labelled pod one of the release's; None: that part is not checked."""

    namespaces: frozenset[str] | None = None
    service_account: str | None = None
    workloads: frozenset[str] | None = None
    # Also accepted for pods whose owner chain proves them (see the module docstring).
    legacy_service_accounts: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        return self.namespaces is None and self.service_account is None and self.workloads is None

    @property
    def needs_chain(self) -> bool:
        """Whether a verdict needs the owner chain read from the API server."""
        return self.workloads is not None


@dataclass(frozen=True)
class Ref:
    """An ownerReference: what an object says its controlling owner is."""

    kind: str
    name: str
    uid: str


@dataclass(frozen=True)
class Owner:
    """An owner as the API server returned it."""

    kind: str
    name: str
    uid: str
    controller: Ref | None  # its own controlling owner
    service_account: str  # the ServiceAccount its pod template names ("default" when none)
    containers: tuple[Container, ...] = ()  # its pod template's
    labels: tuple[tuple[str, str], ...] = ()  # its own
    selector: targeting.Selector | None = None  # which objects it keeps; None: it has none

    def keeps(self, labels: Mapping[str, str]) -> bool:
        """Whether its controller keeps an object with `labels` (it releases any other)."""
        return self.selector is not None and self.selector.matches(labels)


def owner_from(kind: str, body: Mapping[str, Any]) -> Owner:
    """The parts of a ReplicaSet, Deployment or StatefulSet the verdict reads (pure)."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    template = (spec.get("template") or {}).get("spec") or {}
    selector = spec.get("selector")
    return Owner(
        kind=kind,
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        controller=controller_ref(meta.get("ownerReferences")),
        service_account=str(template.get("serviceAccountName") or "default"),
        containers=containers_of(template),
        labels=tuple(sorted((str(k), str(v)) for k, v in (meta.get("labels") or {}).items())),
        selector=targeting.parse_selector(selector)
        if isinstance(selector, Mapping) and selector
        else None,
    )


def controller_ref(refs: object) -> Ref | None:
    """The ownerReference marked `controller: true`, if any (pure)."""
    for o in refs if isinstance(refs, list) else ():
        if isinstance(o, Mapping) and o.get("controller"):
            return Ref(str(o.get("kind", "")), str(o.get("name", "")), str(o.get("uid", "")))
    return None


def next_owner(pod: PodInfo, chain: Sequence[Owner]) -> Ref | None:
    """The next owner to read from the API server to judge `pod`, given what was read so far;
    None when the chain is complete or cannot go on (pure)."""
    if not chain:
        if pod.owner is None or pod.owner[0] not in (REPLICASET, STATEFULSET):
            return None
        return Ref(*pod.owner)
    last = chain[-1]
    if len(chain) >= MAX_CHAIN or last.kind != REPLICASET or last.controller is None:
        return None
    if last.controller.kind != DEPLOYMENT:
        return None
    return last.controller


def static_refusal(pod: PodInfo, policy: Policy) -> str | None:
    """Why `pod` cannot be one of the release's, judged from the pod alone, or None when the
    owner chain may still prove it (pure)."""
    if policy.namespaces is not None and pod.namespace not in policy.namespaces:
        return (
            f"namespace {pod.namespace} is not one of the release's inference namespaces "
            f"({', '.join(sorted(policy.namespaces)) or 'none'})"
        )
    legacy = policy.needs_chain and pod.service_account in policy.legacy_service_accounts
    if (
        policy.service_account is not None
        and pod.service_account != policy.service_account
        and not legacy
    ):
        return (
            f"it runs as ServiceAccount {pod.service_account!r}, not the release's inference "
            f"ServiceAccount {policy.service_account!r}"
        )
    if not policy.needs_chain:
        return None
    if pod.owner is None:
        return "it has no controlling owner (a bare pod), so no release workload made it"
    kind, name, _ = pod.owner
    if kind == DEPLOYMENT:
        return (
            f"its ownerReference names Deployment {name} directly, but Deployments own "
            "ReplicaSets, never pods: the reference is forged"
        )
    if kind not in (REPLICASET, STATEFULSET):
        return f"it is owned by {kind} {name}, not by a ReplicaSet or StatefulSet"
    return None


def unlike_template(pod: PodInfo, owner: Owner) -> str | None:
    """Why `pod` does not run what `owner`'s template declares, or None when every container of
    the template is in the pod with its image, command and arguments (pure). Containers the pod
    has besides (a service mesh's sidecar) do not count."""
    mine = {c[0]: c for c in pod.containers}
    for container in owner.containers:
        if mine.get(container[0]) != container:
            return (
                f"its container {container[0]!r} is not the one {owner.kind} {owner.name}'s "
                "template declares (image, command and arguments)"
            )
    return None


def refusal(pod: PodInfo, policy: Policy, chain: Sequence[Owner] = ()) -> str | None:
    """Why `pod` is not one of the release's inference pods, or None when it is, given the
    owners read from the API server along its chain (`next_owner`'s order) (pure)."""
    reason = static_refusal(pod, policy)
    if reason is not None or policy.workloads is None or pod.owner is None:
        return reason  # (a bare pod is refused by static_refusal when the chain is needed)
    ref = Ref(*pod.owner)
    workload: Owner | None = None
    for i, owner in enumerate(chain):
        if owner.kind != ref.kind or owner.name != ref.name:
            return f"the API server returned {owner.kind} {owner.name} for {ref.kind} {ref.name}"
        if owner.uid != ref.uid:
            return (
                f"its owner reference names {ref.kind} {ref.name} with UID {ref.uid}, but that "
                f"object's UID is {owner.uid}: the reference is forged or stale"
            )
        kept = pod.label_map if i == 0 else dict(chain[i - 1].labels)
        if not owner.keeps(kept):
            what = "its labels" if i == 0 else f"ReplicaSet {chain[i - 1].name}'s labels"
            return (
                f"{what} do not match {owner.kind} {owner.name}'s selector: that controller "
                "does not keep it"
            )
        if i == 0 and (unlike := unlike_template(pod, owner)) is not None:
            return unlike
        if owner.kind != REPLICASET:
            workload = owner
            break
        if owner.controller is None or owner.controller.kind != DEPLOYMENT:
            return f"its ReplicaSet {owner.name} is not controlled by a Deployment"
        ref = owner.controller
    if workload is None:
        return f"its owner {ref.kind} {ref.name} does not exist (any more)"
    if workload.name not in policy.workloads:
        return (
            f"it is owned by {workload.kind} {workload.name}, not by one of the release's "
            f"inference workloads ({', '.join(sorted(policy.workloads)) or 'none'})"
        )
    maker = chain[0]  # the template the pod was made from (a rollout's old pods: the old one)
    if pod.service_account != maker.service_account:
        return (
            f"it runs as ServiceAccount {pod.service_account!r}, but {maker.kind} "
            f"{maker.name} runs its pods as {maker.service_account!r}"
        )
    return None
