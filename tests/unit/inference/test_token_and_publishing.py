"""The server's trust boundaries: no silent open door at start, tokens rotated without a
restart, and, as the chart runs it, only published adapters resolved by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lora_inference.cli import build_parser, token_problem
from lora_volume.targeting import Target

from tests.support.http import assert_error
from tests.unit.inference.conftest import ADMIN_TOKEN, Assets, publish

SECRET = "Secret lora/rel-admin-token, key token"


def problem(*args: str) -> str | None:
    return token_problem(build_parser().parse_args(["serve", "--model", "m", *args]))


@pytest.mark.parametrize("content", [None, "", " \n"], ids=["missing", "empty", "blank"])
def test_a_missing_or_empty_token_file_is_refused_naming_the_secret(
    tmp_path: Path, content: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORA_ADMIN_TOKEN_SECRET", SECRET)
    monkeypatch.setenv("LORA_CLIENT_TOKEN_SECRET", "Secret lora/clients, key key")
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    admin = problem("--admin-token-file", str(token))
    assert admin is not None and SECRET in admin and str(token) in admin
    good = tmp_path / "good"
    good.write_text("t")
    client = problem("--admin-token-file", str(good), "--client-token-file", str(token))
    assert client is not None and "client token" in client and "Secret lora/clients" in client


def test_no_admin_token_at_all_needs_the_explicit_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORA_ADMIN_TOKEN", raising=False)
    assert "--no-admin-token" in (problem() or "")
    assert problem("--no-admin-token") is None
    monkeypatch.setenv("LORA_ADMIN_TOKEN", "t")
    assert problem() is None


def test_the_server_refuses_to_start_with_an_empty_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "LORA_ADMIN_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "lora_inference.cli", "serve", "--model", str(tmp_path),
         "--admin-token-file", str(token)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "is empty" in done.stderr, done.stderr


async def test_a_rotated_token_file_is_used_without_a_restart(
    start_server: Any, assets: Assets, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(ADMIN_TOKEN)
    server = await start_server(admin_token=ADMIN_TOKEN, admin_token_file=token)
    body = {"lora_name": "a", "lora_path": str(assets.adapter_a)}
    assert (await server.post("/v1/load_lora_adapter", body))[0] == 200
    replacement = tmp_path / "token.new"
    replacement.write_text("rotated-token\n")
    replacement.replace(token)  # what the kubelet's symlink swap amounts to
    status, answer = await server.post("/v1/load_lora_adapter", body)
    assert_error(status, answer, 401)
    body = {"lora_name": "b", "lora_path": str(assets.adapter_a)}
    status, _ = await server.post("/v1/load_lora_adapter", body, token="rotated-token")
    assert status == 200


async def test_published_only_never_serves_a_hand_placed_file_by_name(
    start_server: Any, assets: Assets, tmp_path: Path
) -> None:
    root = tmp_path / "volume"
    publish(root, "published", assets.adapter_a, Target(assets.model.name))
    publish(root, "no-target", assets.adapter_a, None)  # a current link, but no target.json
    (root / "by-hand").symlink_to(assets.adapter_a)
    standalone = await start_server(adapter_root=root)
    chart = await start_server(adapter_root=root, published_only=True)
    for name in ("published", "no-target", "by-hand"):
        await standalone.image(model=name)  # a lone server resolves its directory by name
    await chart.image(model="published")
    for name in ("no-target", "by-hand"):
        status, body = await chart.post(
            "/v1/images/generations", {"prompt": "x", "size": "32x32", "model": name}, token=None
        )
        assert "does not exist" in assert_error(status, body, 404, param="model")["message"]
