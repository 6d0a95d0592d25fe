"""The admin token's Secret, created once (`lora_operator.admintoken`, the chart's hook Job):
what it plans for each state of the Secret, and that it never overwrites one. The API is our
own seam (`KubeApi.request`), answered here from a dict; the chart's tests run the Job on the
local cluster."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from lora_operator import admintoken
from lora_operator.edges import kube

NS, NAME = "lora", "demo-lora-operator-admin-token"
LABELS = {"app.kubernetes.io/component": "admin-token"}


class FakeApi:
    """Secrets by name; records every write."""

    def __init__(self, existing: dict[str, Any] | None = None, *, race: bool = False) -> None:
        self.secrets: dict[str, dict[str, Any]] = {NAME: existing} if existing else {}
        self.writes: list[tuple[str, str, Any]] = []
        self.race = race  # another run creates the Secret between our GET and POST

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        name = path.rsplit("/", 1)[-1]
        if method == "GET":
            if name not in self.secrets:
                raise kube.ApiError(404, "not found")
            return self.secrets[name]
        self.writes.append((method, path, body))
        if method == "POST":
            if self.race:
                raise kube.ApiError(409, "already exists")
            self.secrets[body["metadata"]["name"]] = body
            return body
        if method == "PATCH":
            self.secrets[name]["metadata"].setdefault("annotations", {}).update(
                body["metadata"]["annotations"]
            )
            return self.secrets[name]
        raise AssertionError(method)


def ensure(api: FakeApi) -> str:
    return asyncio.run(admintoken.ensure_secret(api, NS, NAME, LABELS))  # type: ignore[arg-type]


def rendered_by_helm(token: str = "old") -> dict[str, Any]:
    return {
        "metadata": {
            "name": NAME,
            "annotations": {"meta.helm.sh/release-name": "demo"},
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
        },
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


@pytest.mark.parametrize(
    ("existing", "action"),
    [
        (None, "create"),
        ({"metadata": {"name": NAME}}, "exists"),
        (rendered_by_helm(), "keep"),
        (
            {
                "metadata": {
                    "annotations": {
                        "meta.helm.sh/release-name": "demo",
                        "helm.sh/resource-policy": "keep",
                    }
                }
            },
            "exists",
        ),
    ],
    ids=["missing", "created-earlier", "rendered-by-an-earlier-chart", "already-kept"],
)
def test_plan(existing: dict[str, Any] | None, action: str) -> None:
    assert admintoken.plan(existing) == action


def test_a_missing_secret_is_created_with_a_random_token() -> None:
    first, second = FakeApi(), FakeApi()
    assert ensure(first) == ensure(second) == "create"
    tokens = []
    for api in (first, second):
        secret = api.secrets[NAME]
        assert secret["metadata"] == {"namespace": NS, "name": NAME, "labels": LABELS}
        assert secret["type"] == "Opaque" and list(secret["data"]) == ["token"]
        tokens.append(base64.b64decode(secret["data"]["token"]).decode())
    assert len(tokens[0]) >= 43 and tokens[0] != tokens[1]
    # The Secret carries no Helm or Argo CD instance label: no sync takes it for its own.
    assert "app.kubernetes.io/instance" not in first.secrets[NAME]["metadata"]["labels"]


def test_an_existing_secret_is_never_written() -> None:
    api = FakeApi({"metadata": {"name": NAME}, "data": {"token": "c2FtZQ=="}})
    assert ensure(api) == "exists"
    assert ensure(api) == "exists"
    assert api.writes == []


def test_one_an_earlier_chart_rendered_is_kept_on_upgrade_with_its_token() -> None:
    api = FakeApi(rendered_by_helm("old"))
    assert ensure(api) == "keep"
    secret = api.secrets[NAME]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert base64.b64decode(secret["data"]["token"]) == b"old"
    assert [w[0] for w in api.writes] == ["PATCH"]
    assert ensure(api) == "exists"  # and the next run leaves it alone


def test_a_secret_created_meanwhile_by_another_run_wins() -> None:
    api = FakeApi(race=True)
    assert ensure(api) == "exists"
