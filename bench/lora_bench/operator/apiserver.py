"""The operator's own identity, counted by the API server: a ServiceAccount and a kubeconfig for
the operator alone, and FlowSchemas matching only it, one per verb class and resource, whose
dispatch counters are its requests."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from lora_devcluster.harness import Harness

SA = "lora-operator-bench"
FLOW_PREFIX = "bench-op-"
VERBS = {
    "watch": ["watch"],
    "read": ["get", "list"],
    "write": ["create", "update", "patch", "delete", "deletecollection"],
}
RESOURCES = {
    "adapters": ["loraadapters", "loraadapters/status"],
    "pods": ["pods", "pods/status"],
    "events": ["events"],
    "other": ["*"],
}


def flow_schemas() -> list[dict[str, Any]]:
    """FlowSchemas matching only the operator's ServiceAccount, one per (verb class, resource):
    the API server's dispatch counter per schema is then a per-verb count of its requests."""
    subject = {"kind": "ServiceAccount", "serviceAccount": {"name": SA, "namespace": "default"}}
    out = []
    for i, (res, resources) in enumerate(RESOURCES.items()):
        for j, (verb, verbs) in enumerate(VERBS.items()):
            rule = {
                "verbs": verbs,
                "apiGroups": ["*"],
                "resources": resources,
                "clusterScope": True,
                "namespaces": ["*"],
            }
            out.append(_flow_schema(f"{verb}-{res}", 10 + 3 * i + j, subject, resourceRules=[rule]))
    rule = {"verbs": ["*"], "nonResourceURLs": ["*"]}
    out.append(_flow_schema("nonresource", 40, subject, nonResourceRules=[rule]))
    return out


def _flow_schema(name: str, precedence: int, subject: Any, **rules: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": FLOW_PREFIX + name},
        "spec": {
            "priorityLevelConfiguration": {"name": "workload-high"},
            "matchingPrecedence": precedence,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{"subjects": [subject], **rules}],
        },
    }


def operator_kubeconfig(h: Harness, path: Path) -> Path:
    """A kubeconfig for a cluster-admin ServiceAccount used by the operator alone."""
    h.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SA}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": SA},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": "default"}],
            },
            *flow_schemas(),
        ],
        "default",
    )
    token = h.create(
        f"/api/v1/namespaces/default/serviceaccounts/{SA}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 86400},
        },
    )["status"]["token"]
    config = yaml.safe_load(h.cluster.kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token}
    path.write_text(yaml.safe_dump(config))
    return path


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before.get(key, 0) for key in after}


def operator_requests(h: Harness) -> dict[str, int]:
    """The operator's requests so far, by FlowSchema (verb class and resource)."""
    with urllib.request.urlopen(h.server + "/metrics", context=h.ssl_context, timeout=30) as r:
        text = r.read().decode()
    counts: dict[str, int] = {}
    pattern = re.compile(
        r'^apiserver_flowcontrol_dispatched_requests_total\{[^}]*flow_schema="'
        + FLOW_PREFIX
        + r'([^"]+)"[^}]*\} (\S+)$',
        re.M,
    )
    for m in pattern.finditer(text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
    return counts
