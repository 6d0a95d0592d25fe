"""The API client's rules (names checked before they become a path, the API's timestamps) and
the logins the operator, the router and the server share: in a pod, outside one (kubeconfig)."""

from __future__ import annotations

import datetime
import re
import ssl
from pathlib import Path

import pytest
import yaml
from lora_runtime import kube, login


def test_a_time_has_seconds_and_a_micro_time_microseconds() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", kube.now_iso())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", kube.now_iso(micro=True))


def test_an_offset_moves_the_time_forward() -> None:
    later = datetime.datetime.fromisoformat(kube.now_iso(90))
    now = datetime.datetime.now(datetime.UTC)
    assert 85 <= (later - now).total_seconds() <= 90


@pytest.fixture
def service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(login, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    (tmp_path / "namespace").write_text("lora\n")
    return tmp_path


def test_in_a_pod_the_login_is_the_service_account_at_the_address_in_the_environment(
    service_account: Path,
) -> None:
    (service_account / "token").write_text("first\n")
    info = login.in_cluster()
    assert info is not None
    assert (info.server, info.token, info.ca_path) == ("https://[fd00::1]:6443", "first", None)
    assert info.default_namespace == login.pod_namespace() == "lora"
    # A rotated token is read again at the next login.
    (service_account / "token").write_text("second")
    (service_account / "ca.crt").write_text("a CA")
    again = login.in_cluster()
    assert again is not None and again.token == "second"
    assert again.ca_path == str(service_account / "ca.crt")


def test_outside_a_pod_there_is_no_in_cluster_login(
    service_account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert login.in_cluster() is None  # no token file
    (service_account / "token").write_text("t")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert login.in_cluster() is None


# ---- names that become part of an API path ------------------------------------------------

NOT_NAMES = [
    "../../team-b/secrets/hub-creds",
    "..",
    "a/b",
    "a?watch=1",
    "a%2Fb",
    "A",
    "a b",
    "-a",
    "a-",
    "a..b",
    "",
    "a" * 254,
    "ä",
    "a\n",
]


@pytest.mark.parametrize("name", NOT_NAMES, ids=range(len(NOT_NAMES)))
def test_a_name_that_is_no_kubernetes_name_never_becomes_a_path(name: str) -> None:
    with pytest.raises(kube.InvalidName) as e:
        kube.object_path("/api/v1", "secrets", "team-a", name)
    assert "is not a Kubernetes name" in str(e.value)
    with pytest.raises(kube.InvalidName):
        kube.object_path("/api/v1", "secrets", name, "x")


def test_names_are_checked_and_quoted_segment_by_segment() -> None:
    assert (
        kube.object_path("/api/v1", "serviceaccounts", "lora", "rel-operator", "token")
        == "/api/v1/namespaces/lora/serviceaccounts/rel-operator/token"
    )
    assert kube.object_path("/apis/apps/v1", "replicasets", "ns", "a.b-1") == (
        "/apis/apps/v1/namespaces/ns/replicasets/a.b-1"
    )
    assert kube.object_path("/apis/events.k8s.io/v1", "events", "ns") == (
        "/apis/events.k8s.io/v1/namespaces/ns/events"
    )
    with pytest.raises(kube.InvalidName):  # a namespace is a label: no dots
        kube.object_path("/api/v1", "secrets", "a.b", "x")


def test_api_timestamps_parse_back() -> None:
    moment = kube.parse_time("2026-12-06T20:00:00Z")
    assert moment is not None and moment.tzinfo is not None
    assert kube.parse_time("not a time") is None


def test_a_kubeconfig_login_is_its_current_context(tmp_path: Path) -> None:
    """Outside a pod (a router run by hand): the current context's server, namespace and user;
    files named relative to the kubeconfig are found beside it, and the first file of
    KUBECONFIG that names an entry wins."""
    (tmp_path / "ca.crt").write_text("a CA")
    first = {
        "current-context": "dev",
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u", "namespace": "n"}}],
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": "https://c:6443", "certificate-authority": "ca.crt"},
            }
        ],
        "users": [{"name": "u", "user": {"token": "t1"}}],
    }
    second = {
        "current-context": "other",
        "users": [{"name": "u", "user": {"token": "t2"}}, {"name": "v", "user": {}}],
    }
    (tmp_path / "one").write_text(yaml.safe_dump(first))
    (tmp_path / "two").write_text(yaml.safe_dump(second))
    found = login.from_kubeconfig(f"{tmp_path / 'one'}:{tmp_path / 'two'}")
    assert found is not None
    assert (found.server, found.token, found.default_namespace) == ("https://c:6443", "t1", "n")
    assert found.ca_path == str(tmp_path / "ca.crt")
    assert found.as_http_headers() == {"Authorization": "Bearer t1"}


def test_a_kubeconfig_of_client_certificates_and_none_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {
        "current-context": "x",
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [
            {"name": "c", "cluster": {"server": "https://c", "insecure-skip-tls-verify": True}}
        ],
        "users": [
            {
                "name": "u",
                "user": {"client-certificate-data": "Y2VydA==", "client-key-data": "a2V5"},
            }
        ],
    }
    (tmp_path / "config").write_text(yaml.safe_dump(config))
    found = login.from_kubeconfig(str(tmp_path / "config"))
    assert found is not None and found.insecure and found.token is None
    assert (found.certificate_data, found.private_key_data) == ("Y2VydA==", "a2V5")
    assert found.as_http_headers() == {}
    monkeypatch.setenv("HOME", str(tmp_path / "nobody"))
    assert login.from_kubeconfig("") is None  # no KUBECONFIG and no ~/.kube/config


def test_a_login_makes_the_tls_context_it_says() -> None:
    assert login.Login(server="https://x").as_ssl_context().verify_mode == ssl.CERT_REQUIRED
    insecure = login.Login(server="https://x", insecure=True).as_ssl_context()
    assert insecure.verify_mode == ssl.CERT_NONE and not insecure.check_hostname
    basic = login.Login(server="https://x", username="a", password="b", token="t")
    assert basic.as_http_headers() == {"Authorization": "Basic YTpi"}
