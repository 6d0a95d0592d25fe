"""What the router forwards: an allowlist (paths, pure), and its empty-token refusal."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from lora_router import config, paths

from tests.support.stand_ins import Pod, pods


@pytest.mark.parametrize(
    ("method", "path", "ok"),
    [
        ("POST", "/v1/images/generations", True),
        ("post", "/v1/images/generations", True),
        ("GET", "/v1/images/generations", False),
        ("GET", "/metrics", False),
        ("GET", "/v1/adapters", False),
        ("POST", "/v1/load_lora_adapter", False),
        ("POST", "/v1/unload_lora_adapter", False),
        ("GET", "/v1/images/generations/../../metrics", False),
        ("POST", "/v1/images/generations/", False),
        ("GET", "/anything", False),
    ],
    ids=[
        "generation",
        "lowercase",
        "get-generation",
        "metrics",
        "adapters",
        "load",
        "unload",
        "dotdot",
        "trailing-slash",
        "other",
    ],
)
def test_only_generation_is_forwarded(method: str, path: str, ok: bool) -> None:
    assert paths.forwarded(method, path) is ok


def test_the_404_says_what_the_router_serves() -> None:
    assert "per pod" in paths.refusal("POST", "/v1/load_lora_adapter", "svc")
    message = paths.refusal("GET", "/metrics", "svc")
    assert "GET /metrics is not served" in message and "POST /v1/images/generations" in message


def test_an_empty_client_token_refuses_to_start_naming_the_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORA_CLIENT_TOKEN_SECRET", "Secret lora/clients, key token")
    token = tmp_path / "token"
    token.write_text("\n")
    for args in (["--client-token-file", str(token)], ["--client-token-file", str(tmp_path / "x")]):
        with pytest.raises(SystemExit):
            config.parse_args(["--namespace", "ns", *args])
        assert "Secret lora/clients, key token" in capsys.readouterr().err


async def test_paths_outside_the_allowlist_never_reach_a_pod(
    start_router: Any, start_backend: Any
) -> None:
    router = await start_router()
    pod = Pod("a")
    await pods(start_backend, router, pod)
    for method, path in [
        ("GET", "/metrics"),
        ("GET", "/v1/adapters"),
        ("POST", "/v1/load_lora_adapter"),
        ("DELETE", "/v1/images/generations"),
        ("GET", "/anything"),
    ]:
        async with router.session.request(method, router.url(path)) as resp:
            assert resp.status == 404, (method, path)
            assert (await resp.json())["error"]["type"] == "NotFoundError"
    assert pod.calls == Counter()
