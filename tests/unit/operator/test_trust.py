"""Which labelled pods get the admin token and load calls (trust.refusal, pure)."""

from __future__ import annotations

from typing import Any

import pytest
from lora_operator import model, trust

POLICY = trust.Policy(
    namespaces=frozenset({"lora"}),
    service_account="rel-inference",
    workloads=frozenset({"rel-inference"}),
)


def pod(
    namespace: str = "lora",
    sa: str | None = "rel-inference",
    owner: dict[str, Any] | None = None,
    labels: dict[str, str] | None = None,
) -> model.PodInfo:
    meta: dict[str, Any] = {
        "namespace": namespace,
        "name": "p",
        "uid": "u",
        "labels": {"lora.dev/inference": "true", "pod-template-hash": "5f7c9", **(labels or {})},
    }
    if owner is not None:
        meta["ownerReferences"] = [{"kind": "Other", "name": "x", "uid": "o0"}, owner]
    spec = {"serviceAccountName": sa} if sa else {}
    return model.pod_info({"metadata": meta, "spec": spec, "status": {}})


RS = {"kind": "ReplicaSet", "name": "rel-inference-5f7c9", "uid": "o1", "controller": True}


def test_the_releases_own_pod_is_trusted() -> None:
    p = pod(owner=RS)
    assert (p.service_account, p.owner) == ("rel-inference", ("ReplicaSet", RS["name"], "o1"))
    assert trust.workload_of(p) == "rel-inference"
    assert trust.refusal(p, POLICY) is None


@pytest.mark.parametrize(
    ("p", "words"),
    [
        (pod(namespace="tenant", owner=RS), "namespace tenant"),
        (pod(sa=None, owner=RS), "ServiceAccount 'default'"),
        (pod(sa="other", owner=RS), "ServiceAccount 'other'"),
        (pod(), "a bare pod"),
        (pod(owner={**RS, "name": "lookalike-5f7c9"}), "ReplicaSet lookalike-5f7c9"),
        # A ReplicaSet whose name is not the workload's and the pod's hash.
        (pod(owner={**RS, "name": "rel-inference-other"}), "ReplicaSet rel-inference-other"),
        (pod(owner={**RS, "controller": False}), "a bare pod"),
        (pod(owner={**RS, "kind": "Job", "name": "rel-inference"}), "Job rel-inference"),
    ],
    ids=[
        "other-namespace",
        "default-sa",
        "other-sa",
        "bare-pod",
        "other-deployment",
        "hash-mismatch",
        "not-controller",
        "job",
    ],
)
def test_a_lookalike_is_refused_saying_why(p: model.PodInfo, words: str) -> None:
    reason = trust.refusal(p, POLICY)
    assert reason is not None and words in reason


def test_statefulsets_and_deployments_named_directly_are_workloads() -> None:
    for kind in ("StatefulSet", "Deployment"):
        owner = {"kind": kind, "name": "rel-inference", "uid": "o", "controller": True}
        assert trust.refusal(pod(owner=owner), POLICY) is None


def test_an_open_policy_trusts_every_labelled_pod() -> None:
    assert trust.Policy().open
    assert trust.refusal(pod(namespace="x", sa=None), trust.Policy()) is None
    # Each part is checked alone.
    assert trust.refusal(pod(sa=None), trust.Policy(namespaces=frozenset({"lora"}))) is None
    assert trust.refusal(pod(), trust.Policy(service_account="rel-inference")) is None


def test_the_policy_from_the_command_line() -> None:
    from lora_operator import config

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


def test_a_legacy_service_account_passes_only_with_the_releases_owner() -> None:
    """During an upgrade the previous version's pods (the namespace's default ServiceAccount)
    keep their adapters; a bare pod or another workload's pod as `default` still does not."""
    policy = trust.Policy(
        namespaces=POLICY.namespaces,
        service_account=POLICY.service_account,
        workloads=POLICY.workloads,
        legacy_service_accounts=frozenset({"default"}),
    )
    assert trust.refusal(pod(sa=None, owner=RS), policy) is None
    assert trust.refusal(pod(sa=None), policy) is not None  # a bare pod as `default`
    other = {**RS, "name": "lookalike-5f7c9"}
    assert "ServiceAccount 'default'" in (trust.refusal(pod(sa=None, owner=other), policy) or "")
    assert "ServiceAccount 'other'" in (trust.refusal(pod(sa="other", owner=RS), policy) or "")
    c = __import__("lora_operator.config").config.parse_args(
        ["--inference-workload=w", "--inference-legacy-service-account=default"]
    )
    assert c.trust_policy.legacy_service_accounts == frozenset({"default"})
