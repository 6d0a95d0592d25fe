"""The cluster the end-to-end suite runs on: the local cluster (the `devcluster` fixtures), or,
with LORA_E2E_KUBECONFIG set, another cluster the project's images were loaded into (kind:
`make e2e-kind`). The suite talks to it only through the API server, so both run it unchanged.

LORA_E2E_NODE_SHELL is the command that runs a shell on that cluster's node (kind:
`docker exec lora-e2e-control-plane`); the suite uses it to kill a container as a crash would.

`make e2e-kind` runs the whole folder. On another cluster, the tests that ask for the local
cluster itself (the `devcluster` fixture: the router's fault tests reach pod IPs and ClusterIPs
from the test process, which only the local cluster's network namespace allows; the docs' dry
runs share its session CRDs) are skipped with that reason; the rest run unchanged.
"""

from __future__ import annotations

import os
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_devcluster import images
from lora_devcluster.harness import Harness


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not os.environ.get("LORA_E2E_KUBECONFIG"):
        return
    skip = pytest.mark.skip(
        reason="needs the local cluster itself (its network namespace), not LORA_E2E_KUBECONFIG's"
    )
    for item in items:
        if "devcluster" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture
def e2e(request: pytest.FixtureRequest) -> Iterator[tuple[Harness, str]]:
    """A Harness and a fresh namespace on the cluster under test."""
    kubeconfig = os.environ.get("LORA_E2E_KUBECONFIG")
    if not kubeconfig:
        h = request.getfixturevalue("devcluster")
        yield h, request.getfixturevalue("devcluster_namespace")
        return
    refs = {i.role: i.ref for i in images.built(("operator", "inference"))}
    node_shell = shlex.split(os.environ.get("LORA_E2E_NODE_SHELL", ""))
    h = Harness.external(Path(kubeconfig), refs, node_shell)
    ns = f"e2e-{uuid.uuid4().hex[:6]}"
    h.kubectl("create", "namespace", ns)
    try:
        yield h, ns
    finally:
        h.kubectl("delete", "namespace", ns, "--wait=false", check=False)
