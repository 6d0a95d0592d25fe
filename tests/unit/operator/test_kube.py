"""The operator's side of the API client: kopf's login glue (the pod's service account as kopf
takes it) and its own calls, which refuse a name that is a path before sending anything."""

from __future__ import annotations

from pathlib import Path

import kopf
import pytest
from lora_operator.edges import kube
from lora_runtime import login


def test_in_a_pod_kopf_logs_in_with_the_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(login, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    assert kube.in_cluster_login() is None  # no token yet
    (tmp_path / "token").write_text("t\n")
    (tmp_path / "namespace").write_text("lora")
    info = kube.in_cluster_login()
    assert isinstance(info, kopf.ConnectionInfo)
    assert (info.server, info.token, info.default_namespace) == (
        "https://10.0.0.1:443",
        "t",
        "lora",
    )


async def test_a_secret_read_by_a_name_that_is_a_path_sends_nothing() -> None:
    """The API client refuses before a request is made: `kube.KubeApi` pointed at a port where
    nothing listens would fail with a connection error otherwise."""
    api = kube.KubeApi(kopf.ConnectionInfo(server="http://127.0.0.1:1"))
    try:
        with pytest.raises(kube.InvalidName):
            await api.read_secret("team-a", "../../team-b/secrets/hub-creds")
        with pytest.raises(kube.InvalidName):
            await api.read_owner("team-a", "ReplicaSet", "../x")
    finally:
        await api.close()
