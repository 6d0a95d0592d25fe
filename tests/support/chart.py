"""The Helm chart as the tests read it: where it and its scenarios are, `helm template` run with
no cluster (the `helm` fixture finds the binary), the rendered objects picked by kind and name;
for the end-to-end suite, the CRDs applied to the local cluster (`crds`) and a server-side dry
run; and every metric the code registers (what the chart's monitors and alerts may name).

A plugin (tests/conftest.py loads it), so every suite gets the `helm` and `crds` fixtures without
importing a test module. Imports no torch (`registered_metrics` imports the server's metrics
module when called).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, NoReturn

import pytest
import yaml
from lora_devcluster import cluster as cluster_mod
from lora_devcluster.harness import Harness

from tests.support import ROOT

CHART = ROOT / "charts" / "lora-operator"
CRD_SOURCE = ROOT / "crds" / "lora.dev_loraadapters.yaml"
CRD_COPY = CHART / "crds-src" / "lora.dev_loraadapters.yaml"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
EXAMPLES = ROOT / "examples"
EXAMPLE_ADAPTERS = sorted(EXAMPLES.glob("adapter*.yaml"))
EXAMPLE_VALUES = sorted(EXAMPLES.glob("values-*.yaml"))
MONITORING_CRDS = ROOT / "tests" / "e2e" / "testdata" / "monitoring-crds.yaml"
# The registry every render names unless a test says otherwise: the chart has no default and
# refuses to render without one (`image.registry`).
REGISTRY = "registry.example.com"
REGISTRY_FLAGS = ("--set", f"image.registry={REGISTRY}")
RELEASE = "demo"
NAMESPACE = "lora-system"
FULLNAME = f"{RELEASE}-lora-operator"

Obj = dict[str, Any]


def unavailable(message: str) -> NoReturn:
    """A tool the test needs is missing: skipped here, a failure under CI (where it must be)."""
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def helm() -> str:
    found = shutil.which("helm")
    if found:
        return found
    try:
        candidate = cluster_mod.bin_dir() / "helm"
    except (cluster_mod.ClusterError, OSError, subprocess.CalledProcessError) as e:
        unavailable(f"helm unavailable: {e}")
    if not candidate.exists():
        unavailable(f"no helm in {candidate.parent}: run `make binaries`")
    return str(candidate)


# The Kubernetes version a render without a cluster assumes: the local cluster's
# (hack/build-binaries.sh). helm's own default, 1.20, is older than Chart.yaml's kubeVersion.
KUBE_VERSION = "v1.37.2"


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    """helm `args`; `template` and `lint` render for KUBE_VERSION unless `args` name one."""
    if args[:1] in (("template",), ("lint",)) and "--kube-version" not in args:
        args = (*args, "--kube-version", KUBE_VERSION)
    return subprocess.run(
        [helm, *args], capture_output=True, text=True, timeout=60, check=False, env=_helm_env()
    )


def _helm_env() -> dict[str, str]:
    # No kubeconfig: rendering must not depend on a cluster (lookup answers empty).
    env = dict(os.environ)
    env.pop("KUBECONFIG", None)
    return env


def template_text(helm: str, *args: str, namespace: str = NAMESPACE) -> str:
    """`helm template` of the chart with REGISTRY (which `args` may override)."""
    proc = run_helm(helm, "template", RELEASE, str(CHART), "-n", namespace, *REGISTRY_FLAGS, *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def render(helm: str, *args: str, namespace: str = NAMESPACE) -> list[Obj]:
    text = template_text(helm, *args, namespace=namespace)
    return [d for d in yaml.safe_load_all(text) if d]


def refused(helm: str, *args: str) -> str:
    proc = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *REGISTRY_FLAGS, *args)
    assert proc.returncode != 0, f"helm template {' '.join(args)} should fail"
    return proc.stderr


def of_kind(docs: list[Obj], kind: str) -> list[Obj]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Obj], kind: str, name: str) -> Obj:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, got {[d['metadata'] for d in found]}"
    return found[0]


def container(deployment: Obj) -> Obj:
    containers: list[Obj] = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def of_component(docs: list[Obj], kind: str, component: str) -> list[Obj]:
    return [
        d
        for d in of_kind(docs, kind)
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]


def operator_args(docs: list[Obj]) -> list[str]:
    args: list[str] = container(one(docs, "Deployment", f"{FULLNAME}-operator"))["args"]
    return args


@pytest.fixture(scope="module")
def crds(devcluster: Harness, helm: str) -> Harness:
    """The LoRAAdapter CRD (applied from crds/, as the operator tests do), kopf's peering CRDs
    and stand-ins for the Prometheus Operator's, so that the chart's custom objects can be
    dry-run."""
    h = devcluster
    h.kubectl("apply", "-f", str(CRD_SOURCE))
    peering = [
        d
        for d in render(helm, "--set", "operator.replicas=2")
        if d["kind"] == "CustomResourceDefinition" and d["spec"]["group"] == "kopf.dev"
    ]
    h.apply(peering)
    h.kubectl("apply", "-f", str(MONITORING_CRDS))
    for name in (
        "loraadapters.lora.dev",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
        *(
            f"{p}.monitoring.coreos.com"
            for p in ("servicemonitors", "podmonitors", "prometheusrules")
        ),
    ):
        h.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return h


def in_cluster(
    h: Harness, argv: list[str], *, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `argv` from the checkout against the cluster (its kubeconfig and binaries); unchecked."""
    return subprocess.run(
        argv,
        cwd=ROOT,
        input=input,
        capture_output=True,
        text=True,
        env=h.cluster.env(),
        timeout=120,
        check=False,
    )


def server_dry_run(h: Harness, namespace: str, rendered: str) -> str:
    argv = ["kubectl", "apply", "--dry-run=server", "-n", namespace, "-f", "-"]
    proc = in_cluster(h, argv, input=rendered)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def registered_metrics() -> dict[str, tuple[str, set[str]]]:
    """Every metric the operator, the inference server and the router register: name -> (type,
    labels)."""
    from lora_inference import metrics as inference_metrics
    from lora_operator.edges import metrics as operator_metrics
    from lora_router import metrics as router_metrics

    found: dict[str, tuple[str, set[str]]] = {}
    for module in (operator_metrics, inference_metrics, router_metrics):
        for collector in vars(module.Metrics()).values():
            name = getattr(collector, "_name", None)
            if name:
                found[name] = (collector._type, set(collector._labelnames))
    return found
