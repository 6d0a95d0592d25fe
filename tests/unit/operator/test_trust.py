"""Which labelled pods get a pod token and load calls (trust, pure): the pod alone
(`static_refusal`) and its owner chain as the API server returned it (`next_owner`, `refusal`)."""

from __future__ import annotations

from typing import Any

import pytest
from lora_operator.edges import config
from lora_operator.rules import model, trust
from lora_operator.rules.trust import Owner, Ref

POLICY = trust.Policy(
    namespaces=frozenset({"lora"}),
    service_account="rel-inference",
    workloads=frozenset({"rel-inference"}),
)


CONTAINERS = [{"name": "inference", "image": "registry/inference:1", "args": ["serve"]}]
# The labels the release's template gives its pods (and its ReplicaSets), and its selector.
LABELS = {"lora.dev/inference": "true", "app": "inference"}
SELECTOR = {"matchLabels": {"app": "inference"}}


def pod(
    namespace: str = "lora",
    sa: str | None = "rel-inference",
    owner: dict[str, Any] | None = None,
    containers: list[dict[str, Any]] = CONTAINERS,
) -> model.PodInfo:
    meta: dict[str, Any] = {
        "namespace": namespace,
        "name": "p",
        "uid": "u",
        "labels": {**LABELS, "pod-template-hash": "5f7c9"},
    }
    if owner is not None:
        meta["ownerReferences"] = [{"kind": "Other", "name": "x", "uid": "o0"}, owner]
    spec: dict[str, Any] = {"containers": containers}
    if sa:
        spec["serviceAccountName"] = sa
    return model.pod_info({"metadata": meta, "spec": spec, "status": {}})


RS_REF = {"kind": "ReplicaSet", "name": "rel-inference-5f7c9", "uid": "rs1", "controller": True}
DEPLOY_REF = {"kind": "Deployment", "name": "rel-inference", "uid": "d1", "controller": True}


def body(
    kind_ref: dict[str, Any],
    owner: dict[str, Any] | None,
    sa: str = "rel-inference",
    containers: list[dict[str, Any]] = CONTAINERS,
    labels: dict[str, str] = LABELS,
    selector: dict[str, Any] = SELECTOR,
) -> dict[str, Any]:
    """An apps/v1 object as the API server returns it."""
    template = {"serviceAccountName": sa, "containers": containers}
    return {
        "metadata": {
            "name": kind_ref["name"],
            "uid": kind_ref["uid"],
            "labels": labels,
            "ownerReferences": [owner] if owner else [],
        },
        "spec": {"selector": selector, "template": {"spec": template}},
    }


RS = trust.owner_from("ReplicaSet", body(RS_REF, DEPLOY_REF))
DEPLOY = trust.owner_from("Deployment", body(DEPLOY_REF, None))


def walk(p: model.PodInfo, objects: dict[tuple[str, str], Owner]) -> list[Owner]:
    """The chain the identity prover would read, from a fake API server's objects by name."""
    chain: list[Owner] = []
    while (ref := trust.next_owner(p, chain)) is not None:
        found = objects.get((ref.kind, ref.name))
        if found is None:
            break
        chain.append(found)
    return chain


OBJECTS = {("ReplicaSet", RS.name): RS, ("Deployment", DEPLOY.name): DEPLOY}


def test_extra_containers_of_a_mesh_do_not_count() -> None:
    sidecar = {"name": "istio-proxy", "image": "istio/proxyv2:1"}
    p = pod(owner=RS_REF, containers=[*CONTAINERS, sidecar])
    assert trust.refusal(p, POLICY, walk(p, OBJECTS)) is None


def test_the_releases_own_pod_is_trusted_through_its_chain() -> None:
    p = pod(owner=RS_REF)
    assert (p.service_account, p.owner) == ("rel-inference", ("ReplicaSet", RS.name, "rs1"))
    assert RS.controller == Ref("Deployment", "rel-inference", "d1")
    chain = walk(p, OBJECTS)
    assert chain == [RS, DEPLOY]
    assert trust.refusal(p, POLICY, chain) is None
    # Without the chain the verdict cannot be reached: never trusted on the pod's word.
    assert trust.refusal(p, POLICY) is not None


def test_a_statefulset_pod_is_trusted_through_its_statefulset() -> None:
    ref = {"kind": "StatefulSet", "name": "rel-inference", "uid": "s1", "controller": True}
    sts = trust.owner_from("StatefulSet", body(ref, None))
    p = pod(owner=ref)
    assert walk(p, {("StatefulSet", "rel-inference"): sts}) == [sts]
    assert trust.refusal(p, POLICY, [sts]) is None


def _forged_uid() -> tuple[model.PodInfo, list[Owner]]:
    p = pod(owner={**RS_REF, "uid": "not-rs1"})
    return p, walk(p, OBJECTS)


def _rs_of_a_lookalike_deployment() -> tuple[model.PodInfo, list[Owner]]:
    ref = {**DEPLOY_REF, "name": "mine", "uid": "d9"}
    rs = trust.owner_from("ReplicaSet", body(RS_REF, ref))
    mine = trust.owner_from("Deployment", body(ref, None))
    p = pod(owner=RS_REF)
    return p, walk(p, {("ReplicaSet", RS.name): rs, ("Deployment", "mine"): mine})


def _own_rs_naming_the_real_deployment_by_name_only() -> tuple[model.PodInfo, list[Owner]]:
    rs = trust.owner_from("ReplicaSet", body(RS_REF, {**DEPLOY_REF, "uid": "guessed"}))
    p = pod(owner=RS_REF)
    return p, walk(p, {("ReplicaSet", RS.name): rs, ("Deployment", DEPLOY.name): DEPLOY})


def _orphan_rs() -> tuple[model.PodInfo, list[Owner]]:
    rs = trust.owner_from("ReplicaSet", body(RS_REF, None))
    p = pod(owner=RS_REF)
    return p, walk(p, {("ReplicaSet", RS.name): rs})


def _owner_gone() -> tuple[model.PodInfo, list[Owner]]:
    p = pod(owner=RS_REF)
    return p, walk(p, {})


def _template_runs_as_another_account() -> tuple[model.PodInfo, list[Owner]]:
    rs = trust.owner_from("ReplicaSet", body(RS_REF, DEPLOY_REF, sa="something-else"))
    p = pod(owner=RS_REF)
    return p, walk(p, {("ReplicaSet", RS.name): rs, ("Deployment", DEPLOY.name): DEPLOY})


def _a_genuine_reference_on_a_pod_of_ones_own() -> tuple[model.PodInfo, list[Owner]]:
    """A bare pod that copies the genuine ReplicaSet's reference, UID included, but runs an
    image of its own."""
    mine = [{"name": "inference", "image": "attacker/collector:1", "args": ["serve"]}]
    p = pod(owner=RS_REF, containers=mine)
    return p, walk(p, OBJECTS)


def _a_replicaset_the_deployment_does_not_keep() -> tuple[model.PodInfo, list[Owner]]:
    """A ReplicaSet of one's own that names the real Deployment by UID, but whose labels the
    Deployment's selector does not match: the Deployment controller releases it."""
    rs = trust.owner_from("ReplicaSet", body(RS_REF, DEPLOY_REF, labels={"app": "own-rs"}))
    p = pod(owner=RS_REF)
    return p, walk(p, {("ReplicaSet", RS.name): rs, ("Deployment", DEPLOY.name): DEPLOY})


def _a_pod_the_replicaset_does_not_keep() -> tuple[model.PodInfo, list[Owner]]:
    rs = trust.owner_from(
        "ReplicaSet", body(RS_REF, DEPLOY_REF, selector={"matchLabels": {"x": "y"}})
    )
    p = pod(owner=RS_REF)
    return p, walk(p, {("ReplicaSet", RS.name): rs, ("Deployment", DEPLOY.name): DEPLOY})


def _the_server_with_other_arguments() -> tuple[model.PodInfo, list[Owner]]:
    mine = [{**CONTAINERS[0], "args": ["serve", "--no-admin-token"]}]
    p = pod(owner=RS_REF, containers=mine)
    return p, walk(p, OBJECTS)


def _not_a_release_workload() -> tuple[model.PodInfo, list[Owner]]:
    policy_other = {**DEPLOY_REF, "name": "other"}
    rs = trust.owner_from("ReplicaSet", body(RS_REF, policy_other))
    other = trust.owner_from("Deployment", body(policy_other, None))
    p = pod(owner=RS_REF)
    return p, walk(p, {("ReplicaSet", RS.name): rs, ("Deployment", "other"): other})


@pytest.mark.parametrize(
    ("case", "words"),
    [
        (lambda: (pod(namespace="tenant", owner=RS_REF), []), "namespace tenant"),
        (lambda: (pod(sa=None, owner=RS_REF), []), "ServiceAccount 'default'"),
        (lambda: (pod(sa="other", owner=RS_REF), []), "ServiceAccount 'other'"),
        (lambda: (pod(), []), "a bare pod"),
        (lambda: (pod(owner={**RS_REF, "controller": False}), []), "a bare pod"),
        (lambda: (pod(owner=DEPLOY_REF), []), "forged"),
        (lambda: (pod(owner={**RS_REF, "kind": "Job"}), []), "Job"),
        (_forged_uid, "forged or stale"),
        (_rs_of_a_lookalike_deployment, "Deployment mine"),
        (_own_rs_naming_the_real_deployment_by_name_only, "forged or stale"),
        (_orphan_rs, "not controlled by a Deployment"),
        (_owner_gone, "does not exist"),
        (_template_runs_as_another_account, "'something-else'"),
        (_not_a_release_workload, "Deployment other"),
        (_a_genuine_reference_on_a_pod_of_ones_own, "template declares"),
        (_the_server_with_other_arguments, "template declares"),
        (_a_replicaset_the_deployment_does_not_keep, "does not keep it"),
        (_a_pod_the_replicaset_does_not_keep, "does not keep it"),
    ],
    ids=[
        "other-namespace",
        "default-sa",
        "other-sa",
        "bare-pod",
        "not-controller",
        "deployment-owns-pod-directly",
        "job",
        "owner-uid-forged",
        "replicaset-of-a-lookalike-deployment",
        "own-replicaset-naming-the-real-deployment",
        "orphan-replicaset",
        "owner-gone",
        "template-service-account-differs",
        "other-workload",
        "genuine-reference-other-image",
        "genuine-reference-other-arguments",
        "replicaset-not-kept-by-the-deployment",
        "pod-not-kept-by-the-replicaset",
    ],
)
def test_a_lookalike_is_refused_saying_why(case: Any, words: str) -> None:
    p, chain = case()
    reason = trust.refusal(p, POLICY, chain)
    assert reason is not None and words in reason


def test_the_chain_is_read_link_by_link_and_stops_where_it_cannot_go_on() -> None:
    p = pod(owner=RS_REF)
    assert trust.next_owner(p, []) == Ref("ReplicaSet", RS.name, "rs1")
    assert trust.next_owner(p, [RS]) == Ref("Deployment", "rel-inference", "d1")
    assert trust.next_owner(p, [RS, DEPLOY]) is None
    assert trust.next_owner(pod(), []) is None  # a bare pod: nothing to read
    assert trust.next_owner(pod(owner=DEPLOY_REF), []) is None  # refused without reading


def test_an_open_policy_trusts_every_labelled_pod_without_reading_anything() -> None:
    assert trust.Policy().open and not trust.Policy().needs_chain
    assert trust.refusal(pod(namespace="x", sa=None), trust.Policy()) is None
    # Each part is checked alone.
    assert trust.refusal(pod(sa=None), trust.Policy(namespaces=frozenset({"lora"}))) is None
    assert trust.refusal(pod(), trust.Policy(service_account="rel-inference")) is None


def test_the_policy_from_the_command_line() -> None:
    assert config.parse_args([]).trust_policy.open
    c = config.parse_args(
        [
            "--inference-namespace=lora",
            "--inference-service-account=rel-inference",
            "--inference-workload=rel-inference",
            "--inference-workload=sd15",
        ]
    )
    assert c.trust_policy == trust.Policy(
        namespaces=frozenset({"lora"}),
        service_account="rel-inference",
        workloads=frozenset({"rel-inference", "sd15"}),
    )


def test_a_legacy_service_account_passes_only_through_a_proven_chain() -> None:
    """During an upgrade the previous version's pods (the namespace's default ServiceAccount)
    keep their adapters; a bare pod, another workload's pod, or one whose workload runs as
    another account, does not."""
    policy = trust.Policy(
        namespaces=POLICY.namespaces,
        service_account=POLICY.service_account,
        workloads=POLICY.workloads,
        legacy_service_accounts=frozenset({"default"}),
    )
    # The previous version's ReplicaSet made its pods as `default`; the Deployment's template
    # has moved on to the inference account.
    old_rs = trust.owner_from("ReplicaSet", body(RS_REF, DEPLOY_REF, sa="default"))
    p = pod(sa=None, owner=RS_REF)
    assert trust.refusal(p, policy, [old_rs, DEPLOY]) is None
    assert trust.refusal(pod(sa=None), policy) is not None  # a bare pod as `default`
    assert "'rel-inference'" in (trust.refusal(p, policy, [RS, DEPLOY]) or "")
    assert "ServiceAccount 'other'" in (trust.refusal(pod(sa="other", owner=RS_REF), policy) or "")
    c = config.parse_args(["--inference-workload=w", "--inference-legacy-service-account=default"])
    assert c.trust_policy.legacy_service_accounts == frozenset({"default"})
