"""pytest fixtures for tests on a real local cluster (registered through the pytest11 entry
point, so every test suite of the project can use them).

- `devcluster` (session): starts a cluster in a temporary directory, makes this process join
  the cluster's network namespace (so the test, kopf's threads started later, kubectl and helm
  reach the API server at 127.0.0.1:6443 and pod IPs 10.244.0.N), sets KUBECONFIG and PATH,
  and stops everything at the end of the session, also after a failure or Ctrl-C.
- `devcluster_namespace` (function): a fresh namespace per test, deleted after it.
- When a test using a namespace fails, its containers' logs are added to the report.

Without the binaries the fixtures skip, except under CI (CI set), where they fail: CI must
never pass by skipping the cluster tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from lora_devcluster import cluster as cluster_mod
from lora_devcluster import harness, ns

_NAMESPACE_KEY = pytest.StashKey[str]()
_HARNESS_KEY = pytest.StashKey[harness.Harness]()


def _unavailable(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"devcluster unavailable under CI: {message}", pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def running_cluster() -> Iterator[harness.Harness]:
    """Start a cluster, join its network namespace, and undo both on exit."""
    if os.geteuid() != 0:
        _unavailable("lora-devcluster needs root (namespaces and bind mounts)")
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            _unavailable(f"{tool} is not installed (util-linux / iproute2)")
    try:
        bins = cluster_mod.bin_dir()
    except (cluster_mod.ClusterError, OSError) as e:
        _unavailable(str(e))
        raise
    missing = cluster_mod.missing_binaries(bins)
    if missing:
        _unavailable(f"missing {', '.join(missing)} in {bins}: run `make binaries`")
    root = Path(tempfile.mkdtemp(prefix="lora-devcluster-")) / "cluster"
    saved_env = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    switch: ns.NetnsSwitch | None = None
    try:
        c = cluster_mod.up(root, binaries=bins, die_with_parent=True)
        switch = ns.NetnsSwitch(c.netns)
        switch.enter()
        os.environ.update({k: v for k, v in c.env().items() if k in saved_env})
        yield harness.Harness(c)
    finally:
        if switch is not None:
            switch.leave()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cluster_mod.down(root)
        shutil.rmtree(root.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def devcluster() -> Iterator[harness.Harness]:
    with running_cluster() as h:
        yield h


def _namespace_name(test_name: str) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{stem or 't'}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def devcluster_namespace(
    devcluster: harness.Harness, request: pytest.FixtureRequest
) -> Iterator[str]:
    name = _namespace_name(request.node.name)
    devcluster.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    request.node.stash[_NAMESPACE_KEY] = name
    request.node.stash[_HARNESS_KEY] = devcluster
    yield name
    with contextlib.suppress(harness.ApiError):
        devcluster.delete(f"/api/v1/namespaces/{name}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _NAMESPACE_KEY in item.stash and _HARNESS_KEY in item.stash:
        h = item.stash[_HARNESS_KEY]
        report.sections.append(
            (
                f"devcluster container logs ({report.when})",
                h.container_logs(item.stash[_NAMESPACE_KEY]),
            )
        )
