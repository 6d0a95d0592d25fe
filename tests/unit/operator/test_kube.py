"""The operator's timestamps in the API's formats (`kube.now_iso`), and the in-cluster login the
operator and the router share."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest
from lora_operator import kube


def test_a_time_has_seconds_and_a_micro_time_microseconds() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", kube.now_iso())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", kube.now_iso(micro=True))


def test_an_offset_moves_the_time_forward() -> None:
    later = datetime.datetime.fromisoformat(kube.now_iso(90))
    now = datetime.datetime.now(datetime.UTC)
    assert 85 <= (later - now).total_seconds() <= 90


@pytest.fixture
def service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(kube, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    (tmp_path / "namespace").write_text("lora\n")
    return tmp_path


def test_in_a_pod_the_login_is_the_service_account_at_the_address_in_the_environment(
    service_account: Path,
) -> None:
    (service_account / "token").write_text("first\n")
    info = kube.in_cluster_login()
    assert info is not None
    assert (info.server, info.token, info.ca_path) == ("https://[fd00::1]:6443", "first", None)
    assert info.default_namespace == kube.pod_namespace() == "lora"
    # A rotated token is read again at the next login.
    (service_account / "token").write_text("second")
    (service_account / "ca.crt").write_text("a CA")
    again = kube.in_cluster_login()
    assert again is not None and again.token == "second"
    assert again.ca_path == str(service_account / "ca.crt")


def test_outside_a_pod_there_is_no_in_cluster_login(
    service_account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert kube.in_cluster_login() is None  # no token file
    (service_account / "token").write_text("t")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert kube.in_cluster_login() is None


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


async def test_a_secret_read_by_a_name_that_is_a_path_sends_nothing() -> None:
    """The API client refuses before a request is made: `kube.KubeApi` pointed at a port where
    nothing listens would fail with a connection error otherwise."""
    import kopf

    api = kube.KubeApi(kopf.ConnectionInfo(server="http://127.0.0.1:1"))
    try:
        with pytest.raises(kube.InvalidName):
            await api.read_secret("team-a", "../../team-b/secrets/hub-creds")
        with pytest.raises(kube.InvalidName):
            await api.read_owner("team-a", "ReplicaSet", "../x")
    finally:
        await api.close()


def test_api_timestamps_parse_back() -> None:
    moment = kube.parse_time("2026-12-06T20:00:00Z")
    assert moment is not None and moment.tzinfo is not None
    assert kube.parse_time("not a time") is None
