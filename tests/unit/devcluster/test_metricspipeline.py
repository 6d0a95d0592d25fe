"""The metrics pipeline's pure part: which pods Prometheus scrapes and how they are labelled,
the adapter's rules and names, the objects that route the API server to the adapter, and the
front proxy's certificates the API server presents to it. The processes run in
tests/e2e/test_autoscaling.py."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from lora_devcluster import certs, controlplane, metricspipeline
from lora_devcluster.layout import HOST_IP
from lora_devcluster.metricspipeline import ADAPTER_PORT, METRICS, Obj

from tests.support import ROOT
from tests.support.docs import parse_blocks


def _go_replacement(template: str) -> str:
    """`$1` / `${1}` (Go's Expand) as Python's `\\g<1>`."""
    return re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", template)


def pod(
    name: str = "web-0",
    *,
    phase: str = "Running",
    ip: str | None = "10.244.0.7",
    **annotations: str,
) -> Obj:
    """A pod of namespace `shop` as the API server lists it, with `prometheus.io/` annotations."""
    return {
        "metadata": {
            "name": name,
            "namespace": "shop",
            "annotations": {f"prometheus.io/{k}": v for k, v in annotations.items()},
        },
        "status": {"phase": phase, **({"podIP": ip} if ip else {})},
    }


def test_an_annotated_pod_is_scraped_at_its_annotated_port_and_path() -> None:
    (group,) = metricspipeline.build_targets([pod(scrape="true", port="8000", path="/stats")])
    assert group == {
        "targets": ["10.244.0.7:8000"],
        # The adapter maps namespace and pod to the object; __metrics_path__ is Prometheus's.
        "labels": {"__metrics_path__": "/stats", "namespace": "shop", "pod": "web-0"},
    }


def test_a_pod_without_a_path_annotation_is_scraped_at_the_default_path() -> None:
    (group,) = metricspipeline.build_targets([pod(scrape="true", port="8000")])
    assert group["labels"]["__metrics_path__"] == "/metrics"


@pytest.mark.parametrize(
    "other",
    [
        pod(port="8000"),
        pod(scrape="false", port="8000"),
        pod(scrape="true"),
        pod(scrape="true", port="http"),
        pod(scrape="true", port="8000", phase="Succeeded"),
        pod(scrape="true", port="8000", phase="Pending", ip=None),
    ],
    ids=["not-annotated", "scrape-false", "no-port", "named-port", "finished", "pending"],
)
def test_other_pods_are_not_scraped(other: Obj) -> None:
    assert metricspipeline.build_targets([other]) == []


def test_the_targets_are_in_a_stable_order() -> None:
    # The discovery rewrites the file only when the targets change.
    pods = [pod(n, scrape="true", port="1", ip=f"10.244.0.{i}") for i, n in enumerate("cab")]
    groups = metricspipeline.build_targets(pods)
    assert [g["labels"]["pod"] for g in groups] == ["a", "b", "c"]
    assert metricspipeline.build_targets(pods[::-1]) == groups


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (Debian's prometheus)")
def test_prometheus_accepts_the_config_and_the_targets(tmp_path: Path) -> None:
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps(metricspipeline.build_targets([pod(scrape="true", port="8000")])))
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(metricspipeline.build_prometheus_config(targets)))
    out = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True
    )
    # promtool reads the file_sd file too, and names what it cannot parse.
    assert out.returncode == 0 and "WARNING" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_adapter_serves_each_gauge_under_its_custom_metric_name() -> None:
    (rule,) = metricspipeline.build_adapter_config()["rules"]
    names = re.fullmatch(r'\{__name__=~"([^"]+)",namespace!="",pod!=""\}', rule["seriesQuery"])
    assert names is not None
    for series, custom in METRICS.items():
        assert re.fullmatch(names.group(1), series)  # Prometheus anchors the regex
        renamed = re.sub(rule["name"]["matches"], _go_replacement(rule["name"]["as"]), series)
        assert renamed == custom
    assert not re.fullmatch(names.group(1), "vllm:lora_requests_info")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"]


def test_the_autoscale_task_shows_the_rule_the_pipeline_runs() -> None:
    """docs/tasks/autoscale.md's prometheus-adapter rule is the tested one, word for word."""
    doc = ROOT / "docs" / "tasks" / "autoscale.md"
    (block,) = [
        b for b in parse_blocks(doc, doc.read_text()) if b.lang == "yaml" and "rules:" in b.text
    ]
    assert yaml.safe_load(block.text) == metricspipeline.build_adapter_config()


def test_a_metric_named_otherwise_than_its_series_is_refused() -> None:
    with pytest.raises(ValueError, match="PREFIX_NAME"):
        metricspipeline.build_adapter_config({"vllm:num_requests_waiting": "queue"})


def _by_kind(objects: list[Obj]) -> dict[str, list[Obj]]:
    kinds: dict[str, list[Obj]] = {}
    for obj in objects:
        kinds.setdefault(obj["kind"], []).append(obj)
    return kinds


def test_the_api_server_reaches_the_adapter_through_its_service(tmp_path: Path) -> None:
    kinds = _by_kind(metricspipeline.build_adapter_objects())
    (service,) = kinds["Service"]
    (endpoints,) = kinds["EndpointSlice"]
    assert "selector" not in service["spec"]  # else the controller would own the endpoints
    labels = endpoints["metadata"]["labels"]
    assert labels["kubernetes.io/service-name"] == service["metadata"]["name"]
    assert labels["endpointslice.kubernetes.io/managed-by"] != "endpointslice-controller.k8s.io"
    assert endpoints["metadata"]["namespace"] == service["metadata"]["namespace"]
    (port,) = service["spec"]["ports"]
    (slice_port,) = endpoints["ports"]
    assert slice_port["name"] == port["name"] and slice_port["port"] == ADAPTER_PORT
    assert endpoints["endpoints"][0]["addresses"] == [HOST_IP]
    # ... where the adapter listens.
    args = metricspipeline.build_adapter_args(
        tmp_path / "a", config=tmp_path / "c", kubeconfig=tmp_path / "k", cert=tmp_path / "t",
        key=tmp_path / "y",
    )  # fmt: skip
    assert f"--bind-address={HOST_IP}" in args and f"--secure-port={ADAPTER_PORT}" in args
    apiservice = metricspipeline.build_apiservice(b"CA")
    assert apiservice["spec"]["service"] == {
        "name": service["metadata"]["name"],
        "namespace": service["metadata"]["namespace"],
        "port": port["port"],
    }
    assert base64.b64decode(apiservice["spec"]["caBundle"]) == b"CA"
    assert apiservice["metadata"]["name"] == "v1beta1.custom.metrics.k8s.io"
    # The certificate's names are the Service's, as the API server dials it.
    name = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert name in metricspipeline.adapter_dns_names()


def test_the_adapter_gets_the_rbac_of_an_extension_api_server() -> None:
    kinds = _by_kind(metricspipeline.build_adapter_objects())
    (account,) = kinds["ServiceAccount"]
    me = {"kind": "ServiceAccount", "name": account["metadata"]["name"]}
    me["namespace"] = account["metadata"]["namespace"]
    mine = {
        b["roleRef"]["name"]
        for b in kinds["ClusterRoleBinding"] + kinds["RoleBinding"]
        if me in b["subjects"]
    }
    assert "system:auth-delegator" in mine  # TokenReviews and SubjectAccessReviews
    assert "extension-apiserver-authentication-reader" in mine  # the front proxy's CA
    (reader,) = [b for b in kinds["RoleBinding"] if b["roleRef"]["kind"] == "Role"]
    assert reader["metadata"]["namespace"] == "kube-system"
    roles = {r["metadata"]["name"]: r for r in kinds["ClusterRole"]}
    lister = next(roles[n] for n in mine if n in roles)
    assert {"pods", "namespaces"} <= set(lister["rules"][0]["resources"])
    assert {"list", "watch"} <= set(lister["rules"][0]["verbs"])
    # The HPA controller may read the metrics (a cluster whose controllers run as themselves).
    hpa = {
        "kind": "ServiceAccount",
        "name": "horizontal-pod-autoscaler",
        "namespace": "kube-system",
    }
    (binding,) = [b for b in kinds["ClusterRoleBinding"] if hpa in b["subjects"]]
    assert roles[binding["roleRef"]["name"]]["rules"][0]["apiGroups"] == ["custom.metrics.k8s.io"]


def test_the_adapter_authenticates_with_its_token() -> None:
    config = metricspipeline.build_token_kubeconfig("https://127.0.0.1:6443", b"CA", "tok")
    (user,) = config["users"]
    assert user["user"] == {"token": "tok"}
    (cluster,) = config["clusters"]
    assert base64.b64decode(cluster["cluster"]["certificate-authority-data"]) == b"CA"


def test_the_api_server_proxies_with_a_front_proxy_certificate_the_adapter_trusts(
    tmp_path: Path,
) -> None:
    pki = certs.write_pki(tmp_path / "pki", ["127.0.0.1"], [], "n", HOST_IP)
    assert certs.pki_at(tmp_path / "pki") == pki
    args = controlplane.build_apiserver_args(tmp_path, pki)
    flags = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    client = x509.load_pem_x509_certificate(Path(flags["--proxy-client-cert-file"]).read_bytes())
    front_ca = x509.load_pem_x509_certificate(
        Path(flags["--requestheader-client-ca-file"]).read_bytes()
    )
    client.verify_directly_issued_by(front_ca)
    cn = client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert flags["--requestheader-allowed-names"] == cn
    usages = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
    # Its own CA: no client of the cluster's CA can pass identity headers.
    assert front_ca.subject != x509.load_pem_x509_certificate(pki.ca_cert.read_bytes()).subject
    assert Path(flags["--proxy-client-key-file"]).stat().st_mode & 0o077 == 0


def test_the_adapters_serving_certificate_is_the_cluster_cas_for_its_names(
    tmp_path: Path,
) -> None:
    pki = certs.write_pki(tmp_path / "pki", ["127.0.0.1"], [], "n", HOST_IP)
    cert, key = tmp_path / "a.crt", tmp_path / "a.key"
    certs.write_serving_cert(pki, cert, key, metricspipeline.adapter_dns_names(), [HOST_IP])
    served = x509.load_pem_x509_certificate(cert.read_bytes())
    served.verify_directly_issued_by(x509.load_pem_x509_certificate(pki.ca_cert.read_bytes()))
    sans = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == metricspipeline.adapter_dns_names()
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == [HOST_IP]
    usages = served.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert key.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0.0), ("2", 2.0), ("1500m", 1.5), ("333m", 0.333), ("2k", 2000.0)],
    ids=["zero", "whole", "milli", "a-third", "kilo"],
)
def test_quantities_as_the_metrics_api_writes_them(text: str, value: float) -> None:
    assert metricspipeline.parse_quantity(text) == pytest.approx(value)


def test_an_unknown_quantity_is_refused() -> None:
    with pytest.raises(ValueError, match="quantity"):
        metricspipeline.parse_quantity("1Ki")
