"""pytest fixtures for tests on a real local cluster (registered through the pytest11 entry
point, so every test suite of the project can use them).

- `devcluster` (session): starts a cluster in a temporary directory, makes this process join
  the cluster's network namespace (so the test, kopf's threads started later, kubectl and helm
  reach the API server at 127.0.0.1:6443 and pod IPs 10.244.0.N), sets KUBECONFIG and PATH,
  and stops everything after the last test that uses it (or at the end of the session, also
  after a failure or Ctrl-C), returning this process to its own network namespace.
- `devcluster_namespace` (function): a fresh namespace per test, deleted after it.
- `devcluster_metrics` (module): the metrics pipeline on that cluster (metricspipeline:
  Prometheus scraping the annotated pods, prometheus-adapter serving custom.metrics.k8s.io for
  HorizontalPodAutoscalers), for the tests of one module, stopped after its last test; only the
  modules that ask for it pay its start and need its binaries.
- When a test using a namespace fails, its containers' logs are added to the report.

Without the binaries the fixtures skip, except under CI (CI set), where they fail: CI must
never pass by skipping the cluster tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from lora_devcluster import cluster as cluster_mod
from lora_devcluster import harness, images, metricspipeline

_NAMESPACE_KEY = pytest.StashKey[str]()
_HARNESS_KEY = pytest.StashKey[harness.Harness]()
_STACK_KEY = pytest.StashKey[contextlib.ExitStack]()
_LAST_USER_KEY = pytest.StashKey[str]()


def _unavailable(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"devcluster unavailable under CI: {message}", pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def running_cluster(roles: tuple[str, ...] | None = None) -> Iterator[harness.Harness]:
    """Start a cluster, join its network namespace, and undo both on exit. `roles`: the
    project's images imported into its node (default: all; a test that pulls the pushed ones
    from the cluster's registry imports only the node's own, `base` and `pause`)."""
    try:
        bins = cluster_mod.bin_dir()
        cluster_mod.check_host(bins)
        node_images = images.built(roles) if roles is not None else images.built()
    except (
        cluster_mod.ClusterError,
        images.ImageError,
        OSError,
        subprocess.CalledProcessError,
    ) as e:
        _unavailable(str(e))
        raise
    root = Path(tempfile.mkdtemp(prefix="lora-devcluster-")) / "cluster"
    try:
        # With the registry: tests push images and the chart to it and install from it.
        with cluster_mod.joined(
            root, binaries=bins, node_images=node_images, die_with_parent=True, with_registry=True
        ) as c:
            yield harness.Harness(c)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def devcluster(pytestconfig: pytest.Config) -> Iterator[harness.Harness]:
    stack = contextlib.ExitStack()
    pytestconfig.stash[_STACK_KEY] = stack
    with stack:
        yield stack.enter_context(running_cluster())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Remember the last test that needs the cluster (after deselection: trylast).
    users = [item for item in items if "devcluster" in getattr(item, "fixturenames", ())]
    if users:
        config.stash[_LAST_USER_KEY] = users[-1].nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    # Stop the cluster as soon as no later test needs it, instead of at the end of the session:
    # the rest of the session gets its memory and CPU back, and runs in the host's network
    # namespace again.
    if item.config.stash.get(_LAST_USER_KEY, None) == item.nodeid:
        stack = item.config.stash.get(_STACK_KEY, None)
        if stack is not None:
            stack.close()


@pytest.fixture(scope="module")
def devcluster_metrics(
    devcluster: harness.Harness, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[metricspipeline.Pipeline]:
    problem = metricspipeline.missing(devcluster.cluster.bin_dir)
    if problem:
        _unavailable(problem)
    with metricspipeline.running(devcluster, tmp_path_factory.mktemp("metrics")) as pipeline:
        yield pipeline


def _namespace_name(test_name: str) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{stem or 't'}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def devcluster_namespace(
    devcluster: harness.Harness, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A namespace of the test's own, deleted after it, returned once its `default`
    ServiceAccount exists: the controller manager creates that a moment after the namespace,
    and until then the API server refuses any pod that would run as it (a loaded machine made
    that moment long enough for a server-side dry run of the chart to meet it)."""
    name = _namespace_name(request.node.name)
    devcluster.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    devcluster.wait_for(
        f"the default ServiceAccount of namespace {name}",
        lambda: devcluster.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout=60,
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
        ns_name = item.stash[_NAMESPACE_KEY]
        when = report.when
        report.sections.append((f"devcluster pods ({when})", h.describe_pods(ns_name)))
        report.sections.append((f"devcluster container logs ({when})", h.container_logs(ns_name)))
        report.sections.append(
            (f"devcluster supervisor/kubelet log, tail ({when})", h.node_log_tail())
        )
